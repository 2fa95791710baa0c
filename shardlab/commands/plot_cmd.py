"""``shardlab plot RUN_DIR [--out loss.png]``: draw a run's loss curves (train/plot.py)."""
from __future__ import annotations

from pathlib import Path

from ..train.plot import plot_run


def configure(parser):
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/loss.png)")


def main(args) -> int:
    from ..config import ConfigError
    if not (Path(args.run_dir) / "metrics.jsonl").exists():
        raise ConfigError("RUN_DIR", f"{args.run_dir}/metrics.jsonl not found; pass a directory written by "
                                     "`shardlab train` (logging.run_dir)")
    from ..errors import output_file
    output_file(args.out, "--out")
    print(plot_run(args.run_dir, args.out))
    return 0
