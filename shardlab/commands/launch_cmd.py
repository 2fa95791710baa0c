"""``shardlab launch --nproc N script.py [args...]``: run a script as N local ranks.

Each rank is ``python script.py args...`` with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port), so a script
written for torchrun or ``shardlab.initialize`` runs unchanged. When a rank fails, the others are
stopped and its exit code is returned, the rank named (launch.spawn_script): no hang.
``--max-restarts K``: after a failure all ranks are started again, at most K times; each sees
``TORCHELASTIC_RESTART_COUNT`` (as under torchrun) and resumes from its own checkpoint.
``--launcher ray``: each rank is a Ray Train worker that runs the script with the same environment
(launch_ray.run_script, TORCHELASTIC_* included); ``--max-restarts K`` is then Ray's
``FailureConfig(max_failures=K)``; a failing script's exit status is returned as locally.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import launch, launch_ray
from ..errors import ConfigError, at_least


def configure(parser):
    parser.add_argument("--nproc", type=int, default=1, help="local ranks to start (default 1)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="after a rank failure, start all ranks again, at most K times")
    launch_ray.add_flags(parser)
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def main(args) -> int:
    at_least(args.nproc, 1, "--nproc")
    if not Path(args.script).is_file():
        raise ConfigError("script", f"{args.script} is not a file; write shardlab launch --nproc N script.py [args]")
    at_least(args.max_restarts, 0, "--max-restarts")
    argv = [args.script, *args.script_args, *args.overrides]
    opts = launch_ray.options(args, args.max_restarts, None, args.nproc)
    if opts:  # Ray Train workers, each running the script; restarts are Ray's FailureConfig
        argv[0] = str(Path(args.script).resolve())  # Ray workers run elsewhere: absolute, and in this directory
        try:
            launch_ray.run(launch_ray.run_script, args.nproc, argv, str(Path.cwd()), opts=opts, timeout_s=1800)
        except launch.WorkerError as err:
            code = getattr(err, "exit_code", None)
            if code is None:
                raise
            return launch.script_failure(err.rank, code, lambda m: print(m, file=sys.stderr))  # as locally
        return 0
    for attempt in range(args.max_restarts + 1):
        code = launch.spawn_script(args.nproc, argv, restart_count=attempt, max_restarts=args.max_restarts)
        if code == 0 or attempt == args.max_restarts:
            return code
        print(f"shardlab launch: restart {attempt + 1}/{args.max_restarts}: starting {args.nproc} rank(s) again "
              f"(TORCHELASTIC_RESTART_COUNT={attempt + 1})", file=sys.stderr, flush=True)
    return code
