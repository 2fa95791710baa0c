"""DDP vs ZeRO-3 (FSDP) on N ranks sharing one GPU: per rank, ``torch.cuda.max_memory_allocated``
next to the ZeRO formula and the planner's prediction, and the step time with the next unit's
parameters prefetched or not.

    python benchmarks/gpu_memory.py [--config configs/llama-1b.toml] [--nproc 2] [--gpu h200]

Questions it answers (docs/benchmarks.md, "GPU"): does ZeRO-3 save memory per rank, and does
prefetch cost memory and save time? Each variant runs in its own spawn of N ranks on the one GPU
(``shardlab.analysis.calibrate``: warm-up steps, then timed steps; the peak allocated bytes are
reset after the warm-up). Precision is the config's (bf16 autocast over fp32 master weights: the
formula's "fp32" row, 4 + 4 + 8 bytes per parameter). The ranks take turns on the GPU, so a step
is about N times one rank's compute; compare the variants with each other, not with one GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shardlab import config as C  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check validate runs)
from shardlab.analysis import calibrate as cal  # noqa: E402
from shardlab.analysis.measured_memory import formula  # noqa: E402
from shardlab.models import count_params, meta_model  # noqa: E402

VARIANTS = [  # (label, parallel options; N is filled into the data-parallel axis)
    ("DDP", {"zero_stage": 0}, "dp_replicate"),
    ("ZeRO-3, prefetch on", {"zero_stage": 3, "prefetch": True}, "dp_shard"),
    ("ZeRO-3, prefetch off", {"zero_stage": 3, "prefetch": False}, "dp_shard"),
]


def variant_config(path: str, overrides: list[str], nproc: int, options: dict, axis: str):
    cfg = C.load(path, overrides)
    cfg.train.device = "cuda"
    cfg.logging.progress = False
    for k, v in {**options, axis: nproc}.items():
        setattr(cfg.parallel, k, v)
    return cfg.validate(world_size=nproc)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama-1b.toml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gpu", default="", help="the planner's device kind (default: from the device's name)")
    a, overrides = ap.parse_known_args(argv)
    import torch
    from shardlab.analysis.devices import gpu_kind
    if not torch.cuda.is_available():
        ap.error("--device: this benchmark needs a CUDA GPU (the ranks share it)")
    name = torch.cuda.get_device_name(0)
    kind = a.gpu or gpu_kind(name)
    mib = 2**20
    print(f"{Path(a.config).name} {' '.join(overrides)} on {a.nproc} ranks sharing one {name}; "
          f"{a.warmup} warm-up + {a.steps} timed steps; planner device {kind or 'none'}")
    print("| variant | rank | max allocated MiB | model state MiB (measured) | ZeRO formula MiB | "
          "planner total MiB | step ms (slowest rank, median) |")
    print("|---|---|---|---|---|---|---|")
    psi = count_params(meta_model(C.load(a.config, overrides).model))  # the same model in every variant
    for label, options, axis in VARIANTS:
        cfg = variant_config(a.config, overrides, a.nproc, options, axis)
        f = formula(psi, a.nproc, cfg.parallel.zero_stage, "fp32")
        try:
            measured = cal.measure_layout(cfg, a.nproc, a.warmup, a.steps, "cuda", timeout_s=600)
        except Exception as e:  # noqa: BLE001 - one variant failing (out of memory) is a row, not the end
            print(f"| {label} | - | failed: {str(e).strip().splitlines()[0][:120]} | | | | |", flush=True)
            continue
        try:
            pred = cal._predict(cfg, kind, None) if kind else None
        except Exception:  # noqa: BLE001 - the measurement stays without a prediction
            pred = None
        step_ms = 1e3 * max(m.step_s for m in measured)
        for m in measured:
            p = pred.ranks[m.rank].total / mib if pred is not None else None
            print(f"| {label} | {m.rank} | {m.max_alloc / mib:,.0f} | {m.model_state / mib:,.0f} | "
                  f"{f.total / mib:,.0f} | {'n/a' if p is None else f'{p:,.0f}'} | {step_ms:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
