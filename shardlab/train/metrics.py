"""FLOPs, MFU, peak FLOP/s table, and the metrics writers (JSONL + TensorBoard).

FLOPs per trained token come from the architecture's ModelSpec (transformers: ``6 * N + 12 *
n_layers * d_model * seq_len``, docs/training.md); with LoRA the frozen weights' gradients are not
counted (``4 N`` + the adapters).
"""
from __future__ import annotations

import json
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


def _matmul_rate(n: int, seconds: float, dtype=torch.float32) -> float:
    """FLOP/s of repeated n x n matmuls on this process's threads, timed for about ``seconds``."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up (allocations, kernel choice)
    reps, t0 = 0, time.perf_counter()
    while reps < 2 or time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def cpu_probe_flops(seconds: float = 0.6, sizes=PROBE_SIZES, dtype=torch.float32) -> float:
    """The CPU 'peak' used for MFU, labelled as measured: the best matmul FLOP/s of this process's
    threads over several sizes (a single small matmul ran slower than the training's own larger
    ones, so MFU could pass 100%)."""
    return max(_matmul_rate(n, seconds / len(sizes), dtype) for n in sizes)


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


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
