"""How long ``launch.run`` takes to start CPU ranks, run one all-reduce and join them: each rank a
fork of a forkserver that imported torch once (the launcher's way for CPU ranks) against each rank
a freshly spawned interpreter (the way before, and still the way for CUDA ranks). Each start
method runs in its own fresh process, so the first launch includes starting the forkserver.

    python benchmarks/rank_start.py [--nproc 2,4] [--launches 5]

Printed per start method and N: the first launch, and the median and range of the others (s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _all_reduce(ctx):
    import torch
    import torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()


def _child(method: str, nproc: int, launches: int) -> None:
    import torch.multiprocessing as mp

    from shardlab import launch
    if method == "spawn":
        launch.rank_context = lambda device: mp.get_context("spawn")
    times = []
    for _ in range(launches):
        t0 = time.perf_counter()
        out = launch.run(_all_reduce, nproc, device="cpu")
        times.append(time.perf_counter() - t0)
        assert out == [float(nproc)] * nproc, out
    print(json.dumps(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="2,4")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    print("| start method | N | first launch s | later launches s, median (min-max) |")
    print("|---|---|---|---|")
    for n in (int(x) for x in args.nproc.split(",")):
        for method in ("spawn", "forkserver"):
            out = subprocess.run([sys.executable, __file__, "--child", method, str(n), str(args.launches)],
                                 check=True, capture_output=True, text=True, cwd=ROOT).stdout
            times = json.loads(out.strip().splitlines()[-1])
            rest = times[1:] or times
            print(f"| {method} | {n} | {times[0]:.2f} | {statistics.median(rest):.2f} "
                  f"({min(rest):.2f}-{max(rest):.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
