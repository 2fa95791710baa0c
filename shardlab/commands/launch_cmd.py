"""``shardlab launch --nproc N script.py [args...]``: run a script as N local ranks.

Each rank is ``python script.py args...`` with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port), so a script
written for torchrun or ``shardlab.initialize`` runs unchanged. When a rank fails, the others are
stopped and its exit code is returned, the rank named (launch.spawn_script): no hang.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import launch
from ..errors import ConfigError


def configure(parser):
    parser.add_argument("--nproc", type=int, default=1, help="local ranks to start (default 1)")
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def main(args) -> int:
    if args.nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {args.nproc}")
    if not Path(args.script).is_file():
        raise ConfigError("script", f"{args.script} is not a file; write shardlab launch --nproc N script.py [args]")
    return launch.spawn_script(args.nproc, [args.script, *args.script_args, *args.overrides])
