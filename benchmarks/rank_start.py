"""How long ``launch.run`` takes to start CPU ranks and join them: each rank a fork of a
forkserver that imported torch once (the launcher's way for CPU ranks) against each rank a freshly
spawned interpreter (the way before, and still the way for CUDA ranks), and a forkserver without
``torch._dynamo`` among its imports (the way before 2026-11-29). Each start method runs in its own
fresh process, so the first launch includes starting the forkserver.

    python benchmarks/rank_start.py [--nproc 2,4] [--launches 5] [--work allreduce,train]

``--work``: what each launch runs. ``allreduce``: one all-reduce; ``train``: ``shardlab train
configs/tiny.toml`` for two steps (the model built on the meta device and materialised, as every
training rank does), in-process through the CLI, so each launch is what a user's run starts.
Printed per work, start method and N: the first launch, and the median and range of the others (s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
METHODS = ("spawn", "forkserver-no-dynamo", "forkserver")


def _all_reduce(ctx):
    import torch
    import torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()


def _train(nproc: int, out: str) -> None:
    from shardlab.cli import main as cli_main
    rc = cli_main(["train", str(ROOT / "configs" / "tiny.toml"), "--nproc", str(nproc), "--overwrite",
                   "--train.steps=2", "--train.eval_every=0", "--checkpoint.every=0",
                   f"--logging.run_dir={out}/run", f"--data.cache_dir={out}/cache"])
    assert rc == 0, rc


def _child(method: str, nproc: int, launches: int, work: str) -> None:
    import torch.multiprocessing as mp

    from shardlab import launch, launch_procs
    if method == "spawn":
        launch.rank_context = launch_procs.rank_context = lambda device: mp.get_context("spawn")
    elif method == "forkserver-no-dynamo":
        launch_procs._PRELOAD = [m for m in launch_procs._PRELOAD if m != "torch._dynamo"]
    times = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(launches):
            t0 = time.perf_counter()
            if work == "train":
                _train(nproc, out)
            else:
                assert launch.run(_all_reduce, nproc, device="cpu") == [float(nproc)] * nproc
            times.append(time.perf_counter() - t0)
    print(json.dumps(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="2,4")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--work", default="allreduce,train")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3])
        return 0
    print("| work | start method | N | first launch s | later launches s, median (min-max) |")
    print("|---|---|---|---|---|")
    for work in args.work.split(","):
        for n in (int(x) for x in args.nproc.split(",")):
            for method in METHODS:
                out = subprocess.run([sys.executable, __file__, "--child", method, str(n), str(args.launches), work],
                                     check=True, capture_output=True, text=True, cwd=ROOT).stdout
                times = json.loads(out.strip().splitlines()[-1])
                rest = times[1:] or times
                print(f"| {work} | {method} | {n} | {times[0]:.2f} | {statistics.median(rest):.2f} "
                      f"({min(rest):.2f}-{max(rest):.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
