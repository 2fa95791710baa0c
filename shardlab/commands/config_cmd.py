"""``shardlab config show CONFIG [--nproc N] [--section.key=value ...]``: the resolved config,
each field with its docstring; validated (against --nproc when given, with a config that
gives no degrees spread over the ranks as ``shardlab train --nproc`` runs it)."""
from __future__ import annotations

import dataclasses
import json

from .. import config as C


def configure(parser):
    parser.add_argument("action", choices=["show"], help="show: print the resolved config")
    parser.add_argument("config", nargs="?", help="TOML, JSON or DeepSpeed JSON file (defaults if omitted)")
    parser.add_argument("--nproc", type=int, default=None, help="validate against this world size")


def main(args) -> int:
    from ..errors import at_least
    from ..train.finetune import load_resolved
    if args.nproc is not None:
        at_least(args.nproc, 1, "--nproc")
    cfg = load_resolved(args.config, args.overrides, args.nproc)  # as train --nproc runs it
    print(describe(cfg))
    return 0


def describe(cfg: C.Config) -> str:
    """The resolved config as TOML-like text with each field's docstring as a comment."""
    lines = []
    for section in C.SECTIONS:
        obj = getattr(cfg, section)
        lines.append(f"[{section}]")
        for fl in dataclasses.fields(obj):
            v = getattr(obj, fl.name)
            rng = C.allowed(fl)
            lines.append(f"{fl.name} = {json.dumps(v)}  # {fl.metadata.get('doc', '')}" + (f" [{rng}]" if rng else ""))
        lines.append("")
    return "\n".join(lines)
