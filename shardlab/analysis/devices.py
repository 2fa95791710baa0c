"""Device constants of the planner's time model, stated per kind (datasheet peaks, memory, HBM,
links; efficiencies not fitted per run; an unknown device is refused), and the CPU probe, cached
under ``.cache/shardlab`` (docs/planner.md, Time model)."""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..distributed.shm_host import X86
from ..errors import ConfigError


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float          # dense bf16 (GPU) / measured fp32 matmul (CPU) FLOP/s
    memory: float              # bytes usable by one rank
    hbm_bw: float              # bytes/s, elementwise (memory-bound) work
    mm_eff: float              # fraction of peak a large matmul reaches
    attn_eff: float            # fraction of peak of the attention kernels (fused, causal half counted)
    intra_bw: float            # bus bandwidth of a collective inside a node, bytes/s
    intra_alpha: float         # latency per collective step inside a node, s
    inter_bw: float            # bus bandwidth per GPU across nodes, bytes/s
    inter_alpha: float         # latency per collective step across nodes, s
    gpus_per_node: int = 8
    note: str = ""
    cores: int = 0             # CPU: cores shared by the ranks of one host (0: one device per rank)
    op_s: float = 0.0          # CPU: seconds of one small differentiable operator, forward + backward
    ew_bw: float = 0.0         # CPU: forward output bytes/s of elementwise operators, forward + backward
    comm_n: tuple = ()         # CPU: ((world size, alpha, bus bandwidth), ...) measured at that many ranks
    comm_curve: tuple = ()     # CPU: ((world, group size, ((bytes, seconds), ...)), ...): all-reduce between compute
    ckpt_s: tuple = ()         # CPU: ((recompute mode, seconds), ...): what a checkpointed block costs per operator
                               # beyond its recomputed forward (saved-tensor hooks, the op policy's dispatch modes)
    busy: float = 1.0          # CPU: compute time with every core running a rank over the time alone (shared
                               # caches and memory bandwidth), applied when a layout's ranks fill the cores
    comm_curves: tuple = ()    # CPU: ((transport, comm_curve), ...) per transport probed; comm_curve above is
                               # the one ``parallel.comm_transport = auto`` picks here (for_transport)
    peak_fp8: float = 0.0      # dense fp8 tensor-core FLOP/s (datasheet); 0: no fp8 (Float8 linears refused)
    sustain: float = 1.0       # GPU: share of the datasheet peaks the part reaches at its power limit (tdp_share);
                               # compute time only: MFU stays against ``peak_flops``
    attn_curve: tuple = ()     # GPU: ((sequence length, FLOP/s), ...) of the flash kernels forward + backward (FA2_*)
    hbm_eff: float = 1.0       # GPU: share of ``hbm_bw`` an elementwise kernel moves (HBM_EFF, measured)


def tdp_share(watts: float) -> float:
    """The share of H100 SXM's datasheet peak an H100 limited to ``watts`` is credited with: the
    dense bf16 peaks of the two parts that bracket it, H100 NVL (835.5 TFLOP/s, 1,671 "with
    sparsity", at its 400 W maximum) and H100 SXM (989.4 at 700 W), interpolated linearly in the
    power limit. torchtitan's paper states of its 500 W HBM2e parts that their peak "should be
    between SXM and NVL" (docs/planner.md, Time model)."""
    nvl, sxm = (400.0, 835.5e12), (700.0, 989.4e12)
    w = min(max(watts, nvl[0]), sxm[0])
    return (nvl[1] + (sxm[1] - nvl[1]) * (w - nvl[0]) / (sxm[0] - nvl[0])) / sxm[1]


GiB = 2**30
FA2_H100 = ((512, 163e12), (1024, 221e12), (2048, 265e12), (4096, 294e12), (8192, 308e12), (16384, 328e12))
FA2_A100 = ((512, 99e12), (1024, 131e12), (2048, 155e12), (4096, 182e12), (8192, 189e12), (16384, 189e12))
"""FlashAttention-2's forward + backward rate by sequence length, causal, head dimension 128, 16k
tokens per call (Dao, "FlashAttention-2", 2023, Figure 7(d) on an H100 SXM5, Figure 4(d) on an
A100 80GB SXM4; FLOPs counted as the planner counts them: causal half, backward 2.5 x forward).
``attn_eff`` is the longest length's share of the datasheet peak: 0.33 on H100 (the
FlashAttention-3 paper's own FlashAttention-2 figures give the same: 335 TFLOP/s causal forward,
322 backward at 16k), 0.61 on A100; plan_time.attention_eff reads the curve at the kernel's
length (docs/planner.md, Time model)."""
HBM_EFF = 0.87
"""The share of the datasheet HBM bandwidth a large elementwise kernel moves: an add of 2^28 bf16
elements (1.61 GB read and written) took 0.551 ms on the third lease's H100 SXM, 2.92 of 3.35
TB/s (``benchmarks/gpu_kernels.py --device cuda``, benchmarks/results/gpu_kernels_h100_2026-11-27.json;
docs/gpu.md). Measured on one part and stated for every GPU kind (as ``mm_eff`` is for matrix
products): the planner's elementwise, Float8-cast and optimizer terms run at ``hbm_bw * hbm_eff``.
Adopted 2026-11-27 from that measurement, not from a published run's error."""
HOPPER_FA2 = round(FA2_H100[-1][1] / 989e12, 2)
A100_FA2 = round(FA2_A100[-1][1] / 312e12, 2)
# Sources of the constants (datasheets; stated efficiencies, not fitted): docs/planner.md, Time model.
DEVICES = {
    "h100": Device("H100 SXM 80GB", 989e12, 80e9, 3.35e12, 0.70, HOPPER_FA2, 360e9, 10e-6, 45e9, 20e-6, 8,
                   "NVLink 4 (450 GB/s per direction), 400 Gb/s InfiniBand per GPU", peak_fp8=1979e12,
                   attn_curve=FA2_H100, hbm_eff=HBM_EFF),
    "h100-gt": Device("H100 96GB HBM2e, 500 W (Grand Teton)", 989e12, 96e9, 2.4e12, 0.70, HOPPER_FA2, 360e9, 10e-6,
                      45e9, 20e-6, 8, "torchtitan's benchmark platform: HBM2e 2.4 TB/s, 400 Gb/s RDMA per GPU, 500 W limit",
                      peak_fp8=1979e12, sustain=tdp_share(500.0), attn_curve=FA2_H100, hbm_eff=HBM_EFF),
    "h200": Device("H200 SXM 141GB", 989e12, 141e9, 4.8e12, 0.70, HOPPER_FA2, 360e9, 10e-6, 45e9, 20e-6, 8,
                   "H100's compute with HBM3e", peak_fp8=1979e12, attn_curve=FA2_H100, hbm_eff=HBM_EFF),
    "h800": Device("H800 SXM 80GB", 989e12, 80e9, 3.35e12, 0.70, HOPPER_FA2, 160e9, 10e-6, 45e9, 20e-6, 8,
                   "H100's compute and HBM3, NVLink cut to 400 GB/s (200 GB/s per direction), 400 Gb/s InfiniBand "
                   "per GPU (DeepSeek-V3's platform)", peak_fp8=1979e12, attn_curve=FA2_H100, hbm_eff=HBM_EFF),
    "a100": Device("A100 SXM 80GB", 312e12, 80e9, 2.0e12, 0.80, A100_FA2, 230e9, 10e-6, 22e9, 20e-6, 8,
                   "NVLink 3 (300 GB/s per direction), 200 Gb/s HDR InfiniBand per GPU", attn_curve=FA2_A100, hbm_eff=HBM_EFF),
}

FITTED_EFFICIENCY = 0.980
"""Not a device constant: the one global efficiency fitted to the fit set of published runs (never
the held-out set) by ``benchmarks/planner_validation.py``; used only by ``shardlab plan
--efficiency fitted`` (docs/planner.md)."""


def get_device(kind: str, probe: dict | None = None) -> Device:
    """The constants of ``kind`` (h100, h100-gt, h200, a100, cpu). ``cpu`` needs the probe's numbers
    (measured here when not given)."""
    if kind == "cpu":
        pr = probe or probe_cpu()
        return Device("CPU (probe)", pr["flops"], pr.get("memory", 16e9), pr.get("mem_bw", 5e9), pr.get("mm_eff", 1.0),
                      0.5 * pr.get("mm_eff", 1.0), pr["bw"], pr["alpha"], pr["bw"], pr["alpha"], 1 << 20,
                      "measured by probe_cpu", pr.get("cores", 0), pr.get("op_s", 0.0), pr.get("ew_bw", 0.0),
                      tuple(tuple(x) for x in pr.get("comm", ())), _curve(pr.get("comm_curve", ())),
                      tuple(sorted(pr.get("ckpt_s", {}).items())), pr.get("busy", 1.0),
                      tuple((tr, _curve(c)) for tr, c in sorted(pr.get("comm_curves", {}).items())))
    if kind not in DEVICES:
        raise ConfigError("--gpu", f"unknown device {kind!r}; known: {', '.join(sorted(DEVICES))}, cpu "
                                   "(the planner never guesses a device's peak)")
    return DEVICES[kind]


def gpu_kind(name: str) -> str | None:
    """The DEVICES key of a CUDA device name (``torch.cuda.get_device_name``), None when unknown:
    "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA A100-SXM4-80GB" -> a100."""
    for frag, kind in (("H200", "h200"), ("H100", "h100"), ("A100", "a100")):
        if frag in name and "PCIe" not in name:
            return kind
    return None


def _curve(entries) -> tuple:
    return tuple((w, n, tuple(tuple(pt) for pt in pts)) for w, n, pts in entries)


def for_transport(dev: Device, transport: str) -> Device:
    """``dev`` with ``comm_curve`` the probed curve of ``parallel.comm_transport`` (auto: the
    shared-memory transport on x86-64, where auto picks it for CPU ranks on one host; else the
    process group). Unchanged when that transport was not probed (GPUs, an older probe)."""
    if not getattr(dev, "comm_curves", ()):
        return dev
    want = {"auto": _AUTO}.get(transport, transport)
    curves = dict(dev.comm_curves)
    return replace(dev, comm_curve=curves[want]) if want in curves else dev


def with_nodes(dev: Device, gpus_per_node: int | None) -> Device:
    return dev if not gpus_per_node else replace(dev, gpus_per_node=gpus_per_node)


# -- CPU probe ---------------------------------------------------------------------------------------

PROBE_ROUNDS = 7
"""Alternating timing rounds of the matmul probes (each rate is the median of its rounds)."""
CURVE_BYTES = (4, 2**16, 2**18, 2**20, 2**22)
"""Message sizes of the probed all-reduce curve (the tiny models' collectives lie between)."""
BUSY_PAIRS = 5
"""Alone / busy timing pairs of the busy-cores probe (its figure is their median ratio)."""
_AUTO = "shared" if X86 else "process_group"
"""The CPU transport ``parallel.comm_transport = auto`` picks on one host (distributed.mesh)."""
CURVE_REPS, CURVE_TRIM = 100, 0.05
"""The curve's statistic: the mean of 100 compute + all-reduce rounds without the slowest 5%. Not
the median: on this shared 2-core machine a 4-byte all-reduce between ~1-13 ms of compute adds a
median 0.3-1.4 ms but a mean 1.0-2.2 ms (stalls of several ms, 2026-11-25), and a step pays the
sum of its collectives, i.e. their mean; the trim keeps a one-off stall out. 100 rounds: three
probes a minute apart gave 0.87-0.91 / 2.20-2.41 / 2.27-3.03 ms at 4 B / 256 KiB / 1 MiB with
200 rounds, where 15-round medians spread 0.77-0.86 / 1.70-4.73 / 2.66-2.88 ms. (Between runs
minutes apart the machine itself moves more: 4 B measured 0.2 ms in one calibration, 0.8 in
another.)"""


def probe_cpu(cache_dir: str = ".cache/shardlab", refresh: bool = False, nproc: int = 2,
              comm_sizes: tuple = (2, 4, 8), reps: int = 15) -> dict:
    """This CPU's constants, measured: {flops, mm_eff, cores, alpha, bw, mem_bw, op_s, ew_bw, ckpt_s,
    busy, comm, comm_curve, comm_curves}; what each times, and why the all-reduce curve is timed
    between compute: docs/planner.md, Time model ("CPU"). Cached in ``cache_dir/cpu_probe.json``."""
    path = Path(cache_dir) / "cpu_probe.json"
    if path.exists() and not refresh:
        return json.loads(path.read_text())
    import torch
    from ..train.metrics import matmul_rate
    import os
    torch.set_num_threads(1)
    # a transformer-shaped matmul, forward and backward: its rate over the square probe's is mm_eff.
    # Both rates in alternating rounds, each the median of its rounds: a single timing window moved
    # the linear rate by up to 14% between runs on this shared machine (and every matmul with it)
    x = torch.randn(2048, 128, requires_grad=True)
    w = torch.randn(352, 128, requires_grad=True)
    for _ in range(2):
        torch.nn.functional.linear(x, w).sum().backward()
    squares, linears = [], []
    for _ in range(PROBE_ROUNDS):
        squares.append(matmul_rate(256, 0.6 / PROBE_ROUNDS))  # measured each round, never the cached peak
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.6 / PROBE_ROUNDS:
            torch.nn.functional.linear(x, w).sum().backward()
            reps += 1
        linears.append(3 * 2 * 2048 * 128 * 352 * reps / (time.perf_counter() - t0))
    flops = statistics.median(squares)
    mm_eff = min(1.0, statistics.median(linears) / flops)
    a = torch.empty(2**23)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    mem_bw = 2 * a.numel() * 4 * 5 / (time.perf_counter() - t0)
    op_s = _chain(16)
    ew_bw = 2**18 * 4 / max(_chain(2**18) - op_s, 1e-9)
    # the same chain checkpointed (recompute.py): the extra per operator beyond its recomputed forward
    ckpt_s = {mode: max(0.0, _chain(16, mode=mode) - op_s - op_s / 3) for mode in ("full", "op")}
    small, big = 4, 4 * 2**20
    comm, curves = [], {}
    cores = os.cpu_count() or 1
    work = _median_time(_work, reps)
    busy = 1.0
    try:
        from ..launch import run
        if cores > 1:  # the same block alone and in one process per core at once
            busy = max(1.0, run(_probe_busy, cores, threads=1, timeout_s=120)[0])
        times = run(_probe_comm, nproc, [small, big], reps, threads=1, timeout_s=60)[0][0]
        steps = 2 * (nproc - 1)
        alpha = times[0] / steps
        bw = 2 * big * (nproc - 1) / nproc / max(times[1] - times[0], 1e-9)
        for n in comm_sizes:
            res = run(_probe_comm, n, [small, big, *CURVE_BYTES], reps, threads=1, timeout_s=360)
            t = [statistics.median(r[0][i] for r in res) for i in range(2)]
            comm.append([n, t[0] / (2 * math.log2(n)), 2 * big * (n - 1) / n / max(t[1] - t[0], 1e-9)])
            share = max(1.0, n / cores) * work
            for tr in res[0][1]:
                for g in res[0][1][tr]:
                    it = [statistics.median(r[1][tr][g][i] for r in res) for i in range(len(CURVE_BYTES))]
                    curves.setdefault(tr, []).append(
                        [n, g, [[b, max(1e-6, x - share)] for b, x in zip(CURVE_BYTES, it)]])
    except Exception:  # no processes can be started: DESIGN's measured gloo figures (N=2)
        alpha, bw = 0.3e-3 / 2, 2 * big * 0.5 / 4.7e-3
    out = {"flops": flops, "mm_eff": mm_eff, "cores": os.cpu_count() or 1, "alpha": alpha, "bw": bw,
           "mem_bw": mem_bw, "nproc": nproc, "op_s": op_s, "ew_bw": ew_bw, "ckpt_s": ckpt_s, "busy": busy, "comm": comm,
           "comm_curve": curves.get(_AUTO, []), "comm_curves": curves,
           "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def _chain(n: int, k: int = 100, reps: int = 5, mode: str = "none") -> float:
    """Seconds per operator of a chain of ``k`` SiLUs on ``n`` elements, forward and backward (best
    of reps); ``mode`` full / op: the chain is one block checkpointed as parallel/recompute.py does."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from ..parallel.recompute import op_contexts

    def chain(y):
        for _ in range(k):
            y = torch.nn.functional.silu(y)
        return y
    extra = {"context_fn": op_contexts} if mode == "op" else {}
    x = torch.randn(n, requires_grad=True)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        y = chain(x) if mode == "none" else checkpoint(chain, x, use_reentrant=False, **extra)
        y.sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best / k


_WORK = []


def _block_time(rounds: int = 7, seconds: float = 0.1) -> float:
    """Median seconds of one small transformer-shaped block forward + backward (RMSNorm, a
    128 -> 352 -> 128 SiLU MLP on 1,024 rows: matmuls and elementwise work), over ``rounds``
    windows of ``seconds``, on one thread."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 128, generator=g, requires_grad=True)
    w1 = torch.randn(352, 128, generator=g, requires_grad=True)
    w2 = torch.randn(128, 352, generator=g, requires_grad=True)
    scale = torch.ones(128, requires_grad=True)

    def block():
        y = F.linear(F.silu(F.linear(F.rms_norm(x, (128,), scale), w1)), w2)
        (y * y).mean().backward()
    for _ in range(3):
        block()
    out = []
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            block()
            n += 1
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def _probe_busy(ctx, pairs: int = BUSY_PAIRS) -> float:
    """The busy-cores probe, one process per core: ``pairs`` times, rank 0 times
    :func:`_block_time` alone (the others wait in a barrier), then every rank times it at once;
    returns (rank 0) the median over the pairs of the ranks' mean busy time over rank 0's alone
    time. Alternating in the same processes: one alone / busy pair moved 1.04-1.18 over six
    trials, mostly with the alone time."""
    import torch
    from ..distributed.mesh import Mesh
    from ..distributed.topology import Topology
    world = Mesh.build(Topology(dp_shard=ctx.world_size)).comm("world")
    ratios = []
    for _ in range(pairs):
        world.barrier()
        alone = _block_time(3) if ctx.rank == 0 else 0.0
        world.barrier()
        busy = float(world.all_reduce(torch.tensor([_block_time(3)], dtype=torch.float64))[0]) / ctx.world_size
        ratios.append(busy / alone if ctx.rank == 0 else 0.0)
    return statistics.median(ratios)


def _work():
    """A fixed piece of single-thread compute (~1 ms): four 256 x 256 matmuls."""
    import torch
    if not _WORK:
        _WORK.extend([torch.randn(256, 256), torch.randn(256, 256)])
    a, b = _WORK
    for _ in range(4):
        a @ b


def _times(fn, reps: int) -> list:
    """Seconds of each of ``reps`` calls of ``fn``, after one untimed call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def _median_time(fn, reps: int) -> float:
    return statistics.median(_times(fn, reps))


def _upper_trimmed_mean_time(fn, reps: int, trim: float = CURVE_TRIM) -> float:
    """Mean seconds of ``fn`` over ``reps`` calls, the slowest ``trim`` of them left out."""
    ts = sorted(_times(fn, reps))
    return statistics.mean(ts[:max(1, round(len(ts) * (1 - trim)))])


def _probe_comm(ctx, sizes, reps: int = 15):
    """(median seconds of one all-reduce back to back over all ranks, for the first two sizes, on
    the transport auto picks) and {transport: {group size: [mean seconds (CURVE_REPS calls,
    upper-trimmed) of compute + one all-reduce in groups of that size, for the sizes after
    them]}}: groups of 2 (``tp``), world / 2 (``dp_shard``) and the world, every rank busy; for
    the process group and, on x86-64, the shared-memory transport (one host)."""
    import torch
    from ..distributed.mesh import Mesh
    from ..distributed.topology import Topology
    w = ctx.world_size
    topo = Topology(tp=2, dp_shard=w // 2) if w >= 4 else Topology(dp_shard=w)
    sync, mixed = [], {}
    for transport in (("shared", "process_group") if X86 else ("process_group",)):
        mesh = Mesh.build(topo, transport=transport)
        world = mesh.comm("world")
        if transport == _AUTO:
            for n in sizes[:2]:
                x = torch.zeros(max(1, n // 4))
                world.all_reduce(x)
                sync.append(_median_time(lambda: world.all_reduce(x), reps))
        groups = {w: world} if w < 4 else {2: mesh.comm("tp"), w // 2: mesh.comm("dp_shard"), w: world}
        mixed[transport] = {}
        for g, comm in groups.items():
            mixed[transport][g] = []
            for n in sizes[2:]:
                x = torch.zeros(max(1, n // 4))
                comm.all_reduce(x)
                mixed[transport][g].append(_upper_trimmed_mean_time(lambda: (_work(), comm.all_reduce(x)), CURVE_REPS))
    return sync, mixed


def describe(dev: Device) -> dict:
    return asdict(dev)
