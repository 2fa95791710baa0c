"""``shardlab bench comm``: time collectives like nccl-tests, shardlab's own algorithms and the
backend's side by side, in one run on the same ranks.

    shardlab bench comm --nproc 4 --ops all_reduce --sizes 1K..64M --algorithms backend,ring,tree,rhd
    shardlab bench comm --nproc 4 --ops all --algorithms backend --transport process_group,shared

Conventions (nccl-tests): ``size`` is the message in bytes (all_reduce, broadcast), the gathered
output (all_gather), the full input (reduce_scatter) or one rank's input (all_to_all).
algbw = size / time; busbw = algbw * 2(N-1)/N for all_reduce, * (N-1)/N for all_gather,
reduce_scatter and all_to_all, * 1 for broadcast: the per-link rate of a bandwidth-optimal
algorithm, comparable across N. ``sendrecv`` (nccl-tests' sendrecv_perf): every rank sends
``size`` bytes to the next rank and receives as many from the previous one (``Comm.exchange``,
point-to-point: only the backend's column and the shared one), busbw = algbw. ``x bk`` is busbw relative to the backend column. The
``shared`` column (``--transport shared``) is the shared-memory transport (distributed/shm.py).

Two tiers (``--nodes K``): the ranks form K simulated nodes of N/K consecutive ranks, the group's
communicator is wrapped by distributed/tiers.py, and each column gains ``inter KiB``: the bytes one
rank sends over the slow tier per call (the most of any rank), next to the time, which
``--inter-gbps`` / ``--inter-latency-us`` throttle to that tier's speed (docs/collectives.md).

Timing (unlike nccl-tests, which averages back-to-back calls): the algorithms take turns call
by call, each call starts after a barrier and is timed on every rank; ``time`` is the median
over the iterations of the slowest rank's time. On a shared, loaded machine this keeps a burst
of someone else's load from landing on one column only. The JSON also has mean and min.
"""
from __future__ import annotations

import json
import re
import sys
import time

import torch

from ..errors import output_file

TRANSPORTS = ("process_group", "shared", "shared_2phase", "shared_naps", "shared_sync")
"""--transport values: the backend (the --algorithms columns), the shared-memory transport, the
same with its all-reduce always in two phases (reduce-scatter, all-gather; groups of 2, and of up
to 4 for small chunks, all-reduce in one), the same with its waits napping after 64 yields whatever the cores
(``shm_host.spin_seconds``), and on CUDA its first version (stream drained at each barrier)."""
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
       "broadcast": lambda n: 1.0, "sendrecv": lambda n: 1.0}
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--sizes: cannot read {text!r}; write e.g. 4, 1K, 4M or 1G (powers of 1024)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str, factor: int = 2) -> list[int]:
    """``"1K..64M"`` -> 1K, 2K, ..., 64M (times ``factor``); ``"4,1K,4M"`` -> that list."""
    out = []
    for part in text.split(","):
        if ".." in part:
            lo, hi = (parse_size(p) for p in part.split(".."))
            if lo < 1 or hi < lo or factor < 2:
                raise ValueError(f"--sizes: range {part!r} must go up from >= 1 byte (factor >= 2)")
            while lo <= hi:
                out.append(lo)
                lo *= factor
        else:
            out.append(parse_size(part))
            if out[-1] < 1:  # ran a 1-element tensor labelled 0B
                raise ValueError(f"--sizes: {part!r} is 0 bytes; give sizes of at least 1 byte, e.g. 4")
    return sorted(set(out))


def human(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def configure(parser):
    parser.add_argument("target", choices=["comm"], help="what to benchmark (comm: collectives)")
    parser.add_argument("--nproc", type=int, default=4, help="number of ranks to spawn (default 4)")
    parser.add_argument("--ops", default="all_reduce", help=f"comma list of {', '.join(OPS)} or 'all'")
    parser.add_argument("--sizes", default="1K..64M", help="bytes: '1K..64M' (x factor) or a list '4,1K,4M'")
    parser.add_argument("--factor", type=int, default=2, help="step factor of a size range (default 2)")
    parser.add_argument("--algorithms", default="backend,ring,tree,rhd",
                        help="comma list of backend, ring, tree, rhd, auto")
    parser.add_argument("--transport", default="process_group",
                        help="comma list of process_group (the --algorithms columns), shared (one column: "
                             "shared memory, distributed/shm.py), shared_2phase (its all-reduce in two phases "
                             "at every group size), shared_naps (its waits nap after 64 yields) and "
                             "shared_sync (on CUDA: its first version, the stream drained at each barrier)")
    parser.add_argument("--dtype", default="float32", help="element type (float32, bfloat16, int64, ...)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per point (fewer for huge sizes)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per point")
    parser.add_argument("--burst", type=int, default=1,
                        help="calls back to back per timed sample, time divided by them (default 1: each call "
                             "timed alone after a barrier, which counts the ranks' skew leaving it; "
                             "nccl-tests times calls back to back)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--json", default=None, help="write every measured point to this JSON file")
    parser.add_argument("--plot", default=None, help="write busbw vs size to this PNG")
    parser.add_argument("--profile", default=None, help="write a torch.profiler Chrome trace per rank here")
    parser.add_argument("--nodes", type=int, default=1, help="simulated nodes (consecutive ranks); >1: per-tier bytes")
    parser.add_argument("--inter-gbps", type=float, default=0.0, help="throttle the slow tier to this GB/s per rank (0: no)")
    parser.add_argument("--inter-latency-us", type=float, default=0.0, help="latency per slow-tier message, microseconds")


def _settings(args) -> dict:
    from ..distributed.algorithms import ALGORITHMS

    ops = list(OPS) if args.ops == "all" else [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"--ops: unknown {bad}; choose from {', '.join(OPS)} or 'all'")
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad:
        raise ValueError(f"--algorithms: unknown {bad}; choose from {', '.join(ALGORITHMS)}")
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS] or ([] if transports else ["(none)"])
    if bad:
        raise ValueError(f"--transport: unknown {bad}; choose from {', '.join(TRANSPORTS)}")
    if "process_group" not in transports:
        algorithms = []
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype: {args.dtype!r} is not a torch dtype (float32, bfloat16, int64, ...)")
    if args.nproc < 2:
        raise ValueError("--nproc: collectives need at least 2 ranks")
    if args.nodes < 1 or args.nproc % args.nodes:
        raise ValueError(f"--nodes: {args.nodes} must be >= 1 and divide --nproc {args.nproc}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters / --warmup: need iters >= 1 and warmup >= 0, got {args.iters} / {args.warmup}")
    if not 1 <= args.burst <= 16:
        raise ValueError(f"--burst: {args.burst} must be 1 to 16 (repeated in-place reductions grow the values)")
    if args.inter_gbps < 0 or args.inter_latency_us < 0:
        raise ValueError("--inter-gbps / --inter-latency-us: must be >= 0")
    return dict(ops=ops, sizes=parse_sizes(args.sizes, args.factor), algorithms=algorithms,
                shared=[t for t in transports if t != "process_group"], dtype=args.dtype, iters=args.iters, warmup=args.warmup, burst=args.burst, profile=args.profile,
                nodes=args.nodes, link=(args.inter_gbps, args.inter_latency_us))


def columns(op: str, algorithms: list[str], sizes: list[int]) -> list[str]:
    """The requested algorithms that run something different for ``op`` (e.g. every own choice
    is the ring for all_gather), so that no implementation is timed twice under two names."""
    from ..distributed.algorithms import select

    if op == "sendrecv":  # point-to-point has no algorithm choice: the backend's
        return ["backend"] if algorithms else []
    out, seen = [], set()
    for a in algorithms:
        key = tuple(select(op, a, size) for size in sizes)
        if key not in seen:
            seen.add(key)
            out.append(a)
    return out


def label(op: str, algorithm: str) -> str:
    from ..distributed.algorithms import select

    if algorithm in ("backend", "auto") or algorithm in TRANSPORTS:
        return algorithm
    impl = select(op, algorithm, 1)
    return algorithm if impl == algorithm else impl


def _call(comms, op: str, x: torch.Tensor, algorithm: str, splits):
    comm = comms.get(algorithm, comms["process_group"])
    if op == "all_reduce":
        comm.all_reduce(x, algorithm=algorithm)
    elif op == "all_gather":
        comm.all_gather(x, algorithm=algorithm)
    elif op == "reduce_scatter":
        comm.reduce_scatter(x, algorithm=algorithm)
    elif op == "all_to_all":
        comm.all_to_all(x, splits, splits, algorithm=algorithm)
    elif op == "broadcast":
        comm.broadcast(x, 0, algorithm=algorithm)
    else:  # sendrecv: ``splits`` is the receive buffer
        for w in comm.exchange([(x, (comm.rank + 1) % comm.size)], [(splits, (comm.rank - 1) % comm.size)]):
            w.wait()


def _input(op: str, size: int, n: int, dtype, device):
    """The local input of ``op`` for a ``size``-byte point (element counts rounded to fit)."""
    esize = torch.empty((), dtype=dtype).element_size()
    count = max(1, size // esize)
    if op in ("all_gather",):
        count = max(1, count // n)
    if op in ("reduce_scatter", "all_to_all"):
        count = max(n, count // n * n)
    x = torch.ones(count, dtype=dtype, device=device)
    return x, (torch.empty_like(x) if op == "sendrecv" else [count // n] * n)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _worker(ctx, s):
    import torch.distributed as dist

    from ..distributed.collectives import Comm
    from ..distributed.ledger import Ledger
    from ..distributed.shm import SharedComm
    from ..distributed.tiers import Link, tiered

    n, dtype = ctx.world_size, getattr(torch, s["dtype"])
    ledger = Ledger()
    comm = Comm("world", dist.group.WORLD, list(range(n)), ctx.rank, ledger)
    comms = {"process_group": comm}
    for t in s["shared"]:  # shared_sync: the first CUDA version (stream drained at each barrier)
        comms[t] = SharedComm("world", dist.group.WORLD, list(range(n)), ctx.rank, ledger, device=ctx.device,
                              cuda_streams=t != "shared_sync", one_shot_ranks=0 if t == "shared_2phase" else None)
        if t == "shared_naps":
            comms[t].spin_s = 0.0
    per_node = n // s["nodes"]
    comms = {k: tiered(c, lambda r: r // per_node, Link(*s["link"])) for k, c in comms.items()}
    prof = None
    if s["profile"]:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else []))
        prof.__enter__()
    rows = []
    for op in s["ops"]:
        for size in s["sizes"]:
            x, splits = _input(op, size, n, dtype, ctx.device)
            iters = max(3, min(s["iters"], (256 << 20) // max(1, size)))
            algos = columns(op, s["algorithms"], s["sizes"]) + s["shared"]
            sent, inter = {}, {}
            for algo in algos:
                for _ in range(s["warmup"]):
                    _call(comms, op, x, algo, splits)
                before = ledger.snapshot()
                _call(comms, op, x, algo, splits)
                sent[algo] = sum(e.bytes_sent for e in ledger.since(before).values())
                inter[algo] = sum(e.inter_sent for e in ledger.since(before).values())
            # Algorithms interleaved sample by sample, each sample (``burst`` calls back to back)
            # timed alone after a barrier, so that the load of a shared machine drifts over all
            # columns alike.
            times = torch.zeros(len(algos), iters, dtype=torch.float64)
            burst = s.get("burst", 1)
            for i in range(iters):
                for a, algo in enumerate(algos):
                    x.fill_(1)  # keep values bounded across repeated in-place reductions
                    dist.barrier()
                    _sync(ctx.device)
                    t0 = time.perf_counter()
                    for _ in range(burst):
                        _call(comms, op, x, algo, splits)
                    _sync(ctx.device)
                    times[a, i] = (time.perf_counter() - t0) / burst
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per call: the slowest rank
            most = torch.tensor([inter[a] for a in algos], dtype=torch.float64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)  # slow-tier bytes: the busiest rank's
            for a, algo in enumerate(algos):
                rows.append(dict(op=op, size=size, count=x.numel(), algorithm=algo,
                                 seconds=times[a].median().item(), mean_seconds=times[a].mean().item(),
                                 min_seconds=times[a].min().item(), iters=iters, burst=burst, sent_per_rank=sent[algo],
                                 inter_per_rank=int(most[a])))
    if prof is not None:
        prof.__exit__(None, None, None)
        import os
        os.makedirs(s["profile"], exist_ok=True)
        prof.export_chrome_trace(os.path.join(s["profile"], f"rank{ctx.rank}.json"))
    return rows


def table(rows: list[dict], n: int, nodes: int = 1) -> str:
    """nccl-tests style: one block per op, one line per size, the algorithms side by side; with
    ``nodes`` > 1 each column adds the slow-tier KiB one rank sends per call (the busiest rank)."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = {(r["size"], r["algorithm"]): r for r in rows if r["op"] == op}
        algorithms = [a for a in dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op)]
        sizes = sorted({r["size"] for r in rows if r["op"] == op})
        xbk = {a: a != "backend" and "backend" in algorithms for a in algorithms}
        tier = f"{'inter KiB':>10}" if nodes > 1 else ""
        head1 = f"{'':>8}{'':>10} |" + "".join(f"{label(op, a):^{27 + 6 * xbk[a] + len(tier)}}|" for a in algorithms)
        head2 = f"{'size':>8}{'count':>10} |" + "".join(
            f"{'time us':>9}{'algbw':>9}{'busbw':>9}" + (f"{'x bk':>6}" if xbk[a] else "") + tier + "|"
            for a in algorithms)
        where = f", {nodes} simulated nodes of {n // nodes}" if nodes > 1 else ""
        out += [f"# {op}  N={n}{where}  (time: median per call of the slowest rank; algbw, busbw: GB/s)", head1, head2]
        for size in sizes:
            line = f"{human(size):>8}{pts[(size, algorithms[0])]['count']:>10} |"
            bk = pts.get((size, "backend"))
            for a in algorithms:
                r = pts[(size, a)]
                algbw = size / r["seconds"] / 1e9
                busbw = algbw * BUS[op](n)
                line += f"{r['seconds'] * 1e6:>9.1f}{algbw:>9.3f}{busbw:>9.3f}"
                if xbk[a] and bk:
                    line += f"{bk['seconds'] / r['seconds']:>6.2f}"
                if nodes > 1:
                    line += f"{r.get('inter_per_rank', 0) / 1024:>10.1f}"
                line += "|"
            out.append(line)
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], n: int, path: str):
    """Per op: busbw against size (top) and time per call against size (bottom, log-log: where
    the latency-bound algorithms cross the bandwidth-bound ones)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(2, len(ops), figsize=(5 * len(ops), 7.5), squeeze=False)
    for col, op in enumerate(ops):
        for algo in dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op):
            pts = sorted((r["size"], r["seconds"]) for r in rows if r["op"] == op and r["algorithm"] == algo)
            sizes = [p[0] for p in pts]
            axes[0][col].plot(sizes, [sz / t / 1e9 * BUS[op](n) for sz, t in pts], marker="o", label=label(op, algo))
            axes[1][col].plot(sizes, [t * 1e3 for _, t in pts], marker="o", label=label(op, algo))
        for row, ylabel in ((0, "busbw (GB/s)"), (1, "time per call (ms)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            if row == 1:
                ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op}, N={n}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    from ..launch import run

    try:
        s = _settings(args)
    except ValueError as e:
        print(f"shardlab bench comm: {e}", file=sys.stderr)
        return 2
    output_file(args.json, "--json", ".json")
    output_file(args.plot, "--plot")
    t0 = time.perf_counter()
    rows = run(_worker, args.nproc, s, device=args.device, timeout_s=600)[0]
    print(table(rows, args.nproc, args.nodes))
    link = f", slow tier {args.inter_gbps:g} GB/s + {args.inter_latency_us:g} us" if args.nodes > 1 and any(s["link"]) else ""
    timing = f"{s['burst']} calls back to back per sample" if s["burst"] > 1 else "each call timed alone"
    print(f"# {args.nproc} ranks, dtype {s['dtype']}, device {args.device}{link}, {timing}, "
          f"{time.perf_counter() - t0:.1f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(nproc=args.nproc, dtype=s["dtype"], device=args.device, nodes=args.nodes,
                           link=s["link"], rows=rows), f, indent=1)
    if args.plot:
        plot(rows, args.nproc, args.plot)
    return 0
