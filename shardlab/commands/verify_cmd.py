"""``shardlab verify [--arch A] [--nproc N] [--layouts a,b] [--steps K]``: the parity matrix (analysis/verify.py)."""
from __future__ import annotations

from .. import config as C
from ..errors import at_least
from ..analysis.verify import BASE, DEFAULT_ARCH, _merge, LAYOUTS, TOL, layout_config, layouts, run_layout
from ..models.spec import get_spec, specs
from ..train.data import prepare


def configure(parser):
    parser.add_argument("--arch", default=DEFAULT_ARCH,
                        help=f"architecture (model.arch, default {DEFAULT_ARCH}): {', '.join(sorted(specs()))}")
    parser.add_argument("--nproc", type=int, default=4, help="ranks per layout (default 4)")
    parser.add_argument("--layouts", default=None, help=f"comma-separated subset of: {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per layout")
    parser.add_argument("--transport", default=None, choices=("process_group", "shared", "auto"),
                        help="parallel.comm_transport of every layout (default: the config's, auto): "
                             "shared runs the collectives through shared memory (docs/collectives.md)")
    parser.add_argument("--comm-thread", action="store_true",
                        help="parallel.comm_thread = true in every layout: the shared-memory transport's "
                             "asynchronous collectives on a thread per comm (docs/collectives.md)")


def overrides(args) -> dict:
    """``--model.*`` / ``--train.*`` / ``--data.*`` overrides applied to every layout (and the reference);
    ``--parallel.*`` is refused (each layout sets its own degrees), as are the other sections."""
    extra = C.parse_overrides(list(getattr(args, "overrides", None) or []))
    for section, values in extra.items():
        if section not in ("model", "train", "data"):
            key = f"{section}.{next(iter(values))}"
            raise C.ConfigError(key, "shardlab verify takes --model.*, --train.* and --data.* overrides; "
                                     "each layout sets its own parallel degrees (use --layouts/--nproc)")
    if "arch" in extra.get("model", {}):
        args.arch = extra["model"].pop("arch")
    C.check_ranges(C.load(None, extra))  # each value's type and range, one line naming the field
    if getattr(args, "transport", None):
        extra.setdefault("parallel", {})["comm_transport"] = args.transport
    if getattr(args, "comm_thread", False):
        extra.setdefault("parallel", {})["comm_thread"] = True
    return extra


def main(args) -> int:
    at_least(args.nproc, 1, "--nproc")
    at_least(args.steps, 1, "--steps")
    extra = overrides(args)
    arch = args.arch
    if get_spec(arch).task != "lm":
        raise C.ConfigError("--arch", f"the parity matrix trains language models; {arch} is not one")
    allowed = layouts(arch)
    names = args.layouts.split(",") if args.layouts else allowed
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise C.ConfigError("--layouts", f"unknown layout {unknown[0]!r} for --arch {arch}; "
                                         f"choose from {', '.join(allowed)}")
    if extra:  # an override that breaks the model for every layout is an error, not "nothing fits"
        base = _merge(BASE, {"model": {**get_spec(arch).verify_model, "arch": arch}, "train": {"steps": args.steps}})
        C.from_dict(_merge(base, extra)).validate(1)
    fitting = [n for n in names if layout_config(n, args.nproc, args.steps, arch, extra) is not None]
    skipped = [n for n in names if n not in fitting]
    if not fitting:  # a parity matrix that ran nothing must not read "0 failed"
        sizes = [n for n in (1, 2, 4, 8) if any(layout_config(x, n, args.steps, arch, extra) for x in names)]
        raise C.ConfigError("--nproc", f"none of the {len(names)} layouts asked for fits {args.nproc} ranks; "
                                       f"use --nproc {' or '.join(map(str, sizes)) or '4 with other --layouts'}")
    first = layout_config(fitting[0], args.nproc, arch=arch, extra=extra) if fitting else None
    data_dir = str(prepare(first.data if first else C.Config().data))
    shown = " ".join(f"--{s}.{k}={v}" for s, kv in extra.items() for k, v in kv.items())
    print(f"shardlab verify --arch {arch}{' ' + shown if shown else ''}: {len(fitting)} layouts on {args.nproc} ranks, {args.steps} steps, "
          f"float64, tolerance {TOL:g}" + (f" (not fitting {args.nproc} ranks: {', '.join(skipped)})" if skipped else ""))
    print("| layout | degrees | max abs loss diff | max abs param diff | bytes sent/step (all ranks) | result |")
    print("|---|---|---|---|---|---|")
    cache, failures = {}, 0
    for name in fitting:
        r = run_layout(name, args.nproc, data_dir, args.steps, cache, arch, extra)
        failures += not r["ok"]
        if "loss_diff" in r:
            print(f"| {name} | {r['detail']} | {r['loss_diff']:.2e} | {r['param_diff']:.2e} | "
                  f"{r['bytes_per_step']:,.0f} | {'pass' if r['ok'] else 'FAIL ' + r['error']} |", flush=True)
        else:
            print(f"| {name} | {r['detail']} | - | - | - | FAIL {r['error']} |", flush=True)
    print(f"{len(fitting) - failures} passed, {failures} failed")
    return 1 if failures else 0
