"""Collectives benchmark: shardlab's own algorithms vs the backend, nccl-tests style.

    python benchmarks/comm.py                    # the two runs recorded in docs/collectives.md
    python benchmarks/comm.py --nproc 4 ...      # any `shardlab bench comm` arguments

The recorded runs: (1) all-reduce bus bandwidth at N = 4 for 1 MiB .. 64 MiB (own ring, rhd,
tree vs gloo); (2) all-reduce at N = 8 for 4 B .. 16 MiB: the tree/ring crossover that sets
algorithms.AUTO_CROSSOVER_BYTES; (3) the other collectives at N = 4, 64 KiB and 4 MiB.
"""
import sys

from shardlab import cli

RUNS = [
    ["bench", "comm", "--nproc", "4", "--ops", "all_reduce", "--sizes", "1M..64M", "--factor", "4",
     "--algorithms", "backend,ring,rhd,tree", "--iters", "10", "--json", "runs/bench_comm_n4.json",
     "--plot", "runs/bench_comm_n4.png"],
    ["bench", "comm", "--nproc", "8", "--ops", "all_reduce", "--sizes", "4..16M", "--factor", "4",
     "--algorithms", "backend,ring,tree,rhd", "--iters", "10", "--json", "runs/bench_comm_n8.json",
     "--plot", "runs/bench_comm_n8.png"],
    ["bench", "comm", "--nproc", "4", "--ops", "all_gather,reduce_scatter,all_to_all,broadcast",
     "--sizes", "64K,4M", "--algorithms", "backend,ring,tree", "--iters", "10",
     "--json", "runs/bench_comm_n4_ops.json"],
]

if __name__ == "__main__":
    import os
    os.makedirs("runs", exist_ok=True)
    if len(sys.argv) > 1:
        sys.exit(cli.main(["bench", "comm"] + sys.argv[1:]))
    for argv in RUNS:
        print("$ shardlab " + " ".join(argv), flush=True)
        code = cli.main(argv)
        if code:
            sys.exit(code)
