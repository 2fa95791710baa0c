"""Back-to-back latency of the shared-memory transport's small calls (docs/collectives.md, "The host
barrier"): N ranks on this host call ``barrier()`` and then ``all_reduce`` of 4 KiB (fp32) many
times in a row, and each rank reports its mean time per call; the table shows the slowest rank.

Unlike ``shardlab bench comm`` (a process-group barrier and a timer around each call, which
dominate at this size), nothing runs between the calls: the figure is the transport's own cost.

    python benchmarks/shm_latency.py --nproc 2 4 --calls 2000
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _worker(ctx, calls: int):
    import torch.distributed as dist

    from shardlab.distributed.ledger import Ledger
    from shardlab.distributed.shm import SharedComm
    sh = SharedComm("latency", dist.group.WORLD, list(range(ctx.world_size)), ctx.rank, Ledger())
    x = torch.ones(1024)
    for _ in range(100):  # the arena, the first mappings, warm caches
        sh.all_reduce(x.fill_(1))
    out = {}
    for name, call in (("barrier", sh.barrier), ("all_reduce 4 KiB", lambda: sh.all_reduce(x))):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="group sizes (default 2 4)")
    ap.add_argument("--calls", type=int, default=2000, help="calls of each kind per rank (default 2000)")
    args = ap.parse_args(argv)
    from shardlab.launch import run
    print("| ranks | barrier us per call | all_reduce 4 KiB us per call |")
    print("|---|---|---|")
    for n in args.nproc:
        res = run(_worker, n, args.calls, timeout_s=600)
        slow = {k: max(r[k] for r in res) for k in res[0]}
        print(f"| {n} | {slow['barrier']:.1f} | {slow['all_reduce 4 KiB']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
