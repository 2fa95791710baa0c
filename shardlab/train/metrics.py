"""FLOPs, MFU, peak FLOP/s table, and the metrics writers (JSONL + TensorBoard). FLOPs per trained
token come from the architecture's ModelSpec (the formulas, LoRA's too: docs/training.md, MFU)."""
from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch


# Dense peak FLOP/s, no sparsity (vendor datasheets; docs/training.md). Keys are matched against the device name.
PEAK_FLOPS = [  # (name fragment, {precision: flops})
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),  # fp32 means TF32 tensor cores
    ("L4", {"bf16": 121e12, "fp16": 121e12}),
]


def flops_per_token(cfg, seq_len: int, train=None) -> float:
    """Training FLOPs per token the step computes: the architecture's ModelSpec count (``6 N +``
    attention, every weight trained). With LoRA (``train.lora_rank``) the frozen base weights get
    no weight gradient: their matmuls cost ``4 N`` (forward + input gradient), and each adapter
    ``6 r (in + out)``; ``N`` is the spec's matmul count (its count at seq_len 0, over 6)."""
    from ..models.spec import get_spec
    spec = get_spec(cfg)
    full = spec.flops_per_token(cfg, seq_len)
    if train is None or not getattr(train, "lora_rank", 0):
        return full
    from ..models.spec import add_adapters, meta_model
    model = meta_model(cfg)
    add_adapters(model, train)
    adapters = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B")))
    return full - 2.0 * spec.flops_per_token(cfg, 0) / 6.0 + 6.0 * adapters


def recompute_flops_per_token(cfg) -> float | None:
    """Hardware FLOPs per token that activation recomputation adds (``parallel.activation_checkpointing``
    full / selective / op) on top of the model FLOPs: counted by torch's FlopCounterMode over a
    forward + backward of the meta model (shapes only, nothing computed) with and without the
    recomputation. 0 without recomputation; None where the meta model cannot run (MoE routing
    needs values, image models)."""
    p, t = cfg.parallel, cfg.train
    if p.activation_checkpointing == "none":
        return 0.0
    from torch.utils.flop_counter import FlopCounterMode

    from ..models.spec import add_adapters, get_spec, meta_model
    from ..parallel import recompute
    spec = get_spec(cfg.model)
    if spec.task != "lm" or cfg.model.n_experts:
        return None
    counted = []
    for mode in ("none", p.activation_checkpointing):
        model = meta_model(cfg.model)
        if t.lora_rank:
            add_adapters(model, t)
        recompute.apply(model, mode, spec)
        tokens = torch.zeros(1, t.seq_len, dtype=torch.long, device="meta")
        try:
            with FlopCounterMode(display=False) as fc:
                model(tokens, tokens).backward()
        except Exception:  # an operation meta tensors cannot run: no figure rather than a wrong one
            return None
        counted.append(fc.get_total_flops() / t.seq_len)
    return counted[1] - counted[0]


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, label). None with 'unknown device ...' rather than a wrong number."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, table in PEAK_FLOPS:
            if frag in name:
                p = table.get(precision)
                if p is None:
                    return None, f"unknown peak for {precision} on {name}"
                return p, f"{name} {precision} dense peak"
        return None, f"unknown device {name}"
    return None, "cpu (probe)"


PROBE_SIZES = (256, 512, 1024, 2048)
CACHE_DIR = Path.home() / ".cache" / "shardlab"
"""Where the measured CPU peak is cached (``cpu_peak.json``): once per machine, not per run."""
PROBE_LABEL = "cpu matmul probe (measured, not a datasheet peak)"


def matmul_rate(n: int, seconds: float, dtype=torch.float32) -> float:
    """FLOP/s of repeated n x n matmuls on this process's threads, timed for about ``seconds``."""
    g = torch.Generator().manual_seed(0)  # its own: the global RNG (train.seed's dropout) must not move
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    a @ b  # warm-up (allocations, kernel choice)
    reps, t0 = 0, time.perf_counter()
    while reps < 2 or time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def probe_threads() -> tuple[int, ...]:
    """Thread counts the probe tries: 1, half the cores, all of them, and the current setting."""
    n = os.cpu_count() or 1
    return tuple(sorted({1, max(1, n // 2), n, torch.get_num_threads()}))


def probe_key(dtype=torch.float32) -> str:
    """What a cached peak is valid for: the CPU model, the core count, torch's version, the dtype."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cores | torch {torch.__version__} | {str(dtype).removeprefix('torch.')}"


def _cache(cache_dir) -> tuple[Path | None, dict]:
    path = Path(cache_dir) / "cpu_peak.json" if cache_dir else None
    try:
        return path, json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return path, {}


def _store(cache_dir, key: str, flops: float, how: str) -> None:
    path, table = _cache(cache_dir)
    if path is None:
        return
    table[key] = {"flops": flops, "how": how}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only home: the peak is measured again next time
        pass


def cpu_probe_flops(seconds: float = 2.0, sizes=PROBE_SIZES, dtype=torch.float32, threads=None,
                    cache_dir=CACHE_DIR) -> tuple[float, str]:
    """(FLOP/s, how) of this machine's CPU 'peak' used for MFU, labelled as measured: the best
    matmul rate over several sizes and thread counts (a single small matmul ran slower than the
    training's own larger ones, so MFU could pass 100%), measured once per machine and cached in
    ``cache_dir`` under :func:`probe_key` (None: no cache). Call it from one rank per host while
    the others wait: ranks probing side by side would share the cores."""
    key = probe_key(dtype)
    hit = _cache(cache_dir)[1].get(key)
    if hit:
        return float(hit["flops"]), f"cached: {hit['how']}"
    threads = tuple(threads or probe_threads())
    before, best = torch.get_num_threads(), (0.0, 0, 0)
    try:
        for t in threads:
            torch.set_num_threads(t)
            best = max([best] + [(matmul_rate(n, seconds / len(sizes) / len(threads), dtype), n, t) for n in sizes])
    finally:
        torch.set_num_threads(before)
    how = f"{best[1]}x{best[1]} on {best[2]} thread(s), best of {len(sizes)} sizes x {len(threads)} thread counts"
    _store(cache_dir, key, best[0], how)
    return best[0], how


def raise_cached_peak(achieved: float, dtype=torch.float32, cache_dir=CACHE_DIR) -> None:
    """A run beat the cached peak (its FLOP/s per host ``achieved``): that rate becomes the peak."""
    if achieved > _cache(cache_dir)[1].get(probe_key(dtype), {}).get("flops", 0.0):
        _store(cache_dir, probe_key(dtype), achieved, "raised to a run's own rate, which beat the probe")


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def _hosts(mesh) -> list:
    return [h for h, _ in mesh.places] if mesh.places else [None] * mesh.world_size


def job_cpu_peak(mesh, precision: str, cache_dir=CACHE_DIR) -> tuple[float, str]:
    """(peak FLOP/s of a CPU job, label): the first rank of each host measures (or reads from the
    cache) its machine's peak while the host's other ranks wait in the sum over the world (ranks
    of one host share its cores: its peak counts once)."""
    hosts = _hosts(mesh)
    how = ""
    mine = 0.0
    if hosts.index(hosts[mesh.rank]) == mesh.rank:
        mine, how = cpu_probe_flops(dtype=_DTYPES.get(precision, torch.float32), cache_dir=cache_dir)
    total = float(mesh.comm("world").all_reduce(torch.tensor(mine, dtype=torch.float64)))
    return total, f"{PROBE_LABEL}; {how}" if how else PROBE_LABEL


def note_beaten_peak(mesh, achieved: float, precision: str, cache_dir=CACHE_DIR) -> None:
    """After :func:`bounded_mfu` raised a probed peak (the run's FLOP/s ``achieved`` beat it):
    rank 0 stores the run's rate per host as its machine's peak (one host: the whole rate)."""
    if mesh.rank == 0:
        raise_cached_peak(achieved / len(set(_hosts(mesh))), _DTYPES.get(precision, torch.float32), cache_dir)


def bounded_mfu(achieved: float, peak: float | None, label: str) -> tuple[float | None, str]:
    """(MFU, label) with a measured peak never below what the run itself achieved: a probe that
    the run beats was not the peak, so the run's own rate becomes the peak (MFU 100%) and the
    label says so. A configured or datasheet peak is kept as it is."""
    if not peak:
        return None, label
    if "probe" in label and achieved > peak:
        return 1.0, f"{label}; raised to the run's own rate, which beat it"
    return achieved / peak, label


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "process max RSS"


class MetricsWriter:
    """metrics.jsonl (one JSON object per record) and TensorBoard scalars. Rank 0 only."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        if self.file.tell():
            with self.path.open("rb") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":  # a record cut off by a kill: the next starts on a line of its own
                    self.file.write("\n")  # (read_metrics leaves the fragment out)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError:  # pragma: no cover - tensorboard is a dependency
                self.tb = None

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v == v:
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path, skipped: list | None = None) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``. A line that is no JSON object (the last record of a
    run killed while writing it) is left out, its line number appended to ``skipped``; a file
    whose lines are all unreadable is a ConfigError naming it."""
    from ..config import ConfigError
    path = Path(run_dir) / "metrics.jsonl"
    out, bad = [], []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            (out.append(rec) if isinstance(rec, dict) else bad.append(i))
    if bad and not out:
        raise ConfigError("RUN_DIR", f"{path} holds no metrics records (line {bad[0]} is not a JSON object); pass a "
                                     "directory written by `shardlab train`")
    if skipped is not None:
        skipped += bad
    return out
