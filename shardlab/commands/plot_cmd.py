"""``shardlab plot RUN_DIR [RUN_DIR ...] [--out loss.png]``: draw a run's loss curves, or several
runs' in one picture (train/plot.py)."""
from __future__ import annotations

from pathlib import Path

from ..train.plot import plot_runs


def configure(parser):
    parser.add_argument("run_dir", nargs="+", help="run directories holding metrics.jsonl (several: one picture)")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/loss.png; needed for several runs)")


def main(args) -> int:
    from ..config import ConfigError
    for run_dir in args.run_dir:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise ConfigError("RUN_DIR", f"{run_dir}/metrics.jsonl not found; pass a directory written by "
                                         "`shardlab train` (logging.run_dir)")
    if len(args.run_dir) > 1 and not args.out:
        raise ConfigError("--out", f"{len(args.run_dir)} runs are drawn into one picture; name it, e.g. --out compare.png")
    from ..errors import output_file
    output_file(args.out, "--out")
    print(plot_runs(args.run_dir, args.out))
    return 0
