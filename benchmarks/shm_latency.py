"""Back-to-back cost of the shared-memory transport's calls (docs/collectives.md, "The host
barrier" and "On a GPU", item 5): N ranks on this host call ``barrier()`` and then ``all_reduce``
of 4 KiB (fp32) many times in a row, and each rank reports its mean time per call; the table
shows the slowest rank. ``--sizes``: then all-reduce at each size in one phase and in two
(``SharedComm(one_shot_ranks=N)`` against ``0``), alternating call by call, median per call.

Unlike ``shardlab bench comm`` (a process-group barrier and a timer around each call, which
dominate at small sizes), nothing runs between the calls: the figure is the transport's own cost.

    python benchmarks/shm_latency.py --nproc 2 4 --calls 2000 --sizes 4K 256K 4M 16M
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _worker(ctx, calls: int, sizes: list[int]):
    import torch.distributed as dist

    from shardlab.distributed.ledger import Ledger
    from shardlab.distributed.shm import SharedComm
    n = ctx.world_size
    sh = SharedComm("latency", dist.group.WORLD, list(range(n)), ctx.rank, Ledger())
    x = torch.ones(1024)
    for _ in range(100):  # the arena, the first mappings, warm caches
        sh.all_reduce(x.fill_(1))
    out = {}
    for name, call in (("barrier", sh.barrier), ("all_reduce 4 KiB", lambda: sh.all_reduce(x))):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    phases = {k: SharedComm(k, dist.group.WORLD, list(range(n)), ctx.rank, Ledger(), one_shot_ranks=v)
              for k, v in (("one", n), ("two", 0))}
    for size in sizes:
        y = torch.ones(size // 4)
        times = {k: [] for k in phases}
        for i in range(3 + max(5, min(400, (64 << 20) // size))):  # 3 untimed
            for k, c in phases.items():
                t0 = time.perf_counter()
                c.all_reduce(y.fill_(1))
                if i >= 3:
                    times[k].append(time.perf_counter() - t0)
        out[size] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="group sizes (default 2 4)")
    ap.add_argument("--calls", type=int, default=2000, help="calls of each kind per rank (default 2000)")
    ap.add_argument("--sizes", nargs="*", default=[], help="all-reduce sizes for one phase vs two (4K 256K 4M ...)")
    args = ap.parse_args(argv)
    from shardlab.commands.bench_comm import parse_size
    sizes = [parse_size(v) for v in args.sizes]
    from shardlab.launch import run
    results = {n: run(_worker, n, args.calls, sizes, timeout_s=600) for n in args.nproc}
    print("| ranks | barrier us per call | all_reduce 4 KiB us per call |")
    print("|---|---|---|")
    for n, res in results.items():
        print(f"| {n} | {max(r['barrier'] for r in res):.1f} | {max(r['all_reduce 4 KiB'] for r in res):.1f} |")
    if sizes:
        print("\n| ranks | bytes | all_reduce in one phase, us | in two phases, us | one / two |")
        print("|---|---|---|---|---|")
        for n, res in results.items():
            for size in sizes:
                one, two = (max(r[size][k] for r in res) for k in ("one", "two"))
                print(f"| {n} | {size:,} | {one:.1f} | {two:.1f} | {one / two:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
