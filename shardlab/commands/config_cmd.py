"""``shardlab config show CONFIG [--nproc N] [--section.key=value ...]``: the resolved config,
each field with its docstring; validated (against --nproc when given)."""
from __future__ import annotations

from .. import config as C


def configure(parser):
    parser.add_argument("action", choices=["show"], help="show: print the resolved config")
    parser.add_argument("config", nargs="?", help="TOML, JSON or DeepSpeed JSON file (defaults if omitted)")
    parser.add_argument("--nproc", type=int, default=None, help="validate against this world size")


def main(args) -> int:
    cfg = C.load(args.config, args.overrides)
    cfg.validate(args.nproc)
    print(C.describe(cfg))
    return 0
