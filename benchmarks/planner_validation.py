"""Planner vs published runs, in two sets printed apart: the fit set (the 13 rows below, the runs
the model was shaped against: its error is in-sample) and the held-out set
(benchmarks/planner_heldout.toml: 31 runs written down and committed before any prediction was
made on them; the figure to quote). Each row: predicted and published tokens/s/GPU, TFLOP/s per
GPU or MFU, its error; held-out rows that use a feature the planner does not model are refused by
name. Every row's layout is printed in ``shardlab plan --layout`` syntax.

    PYTHONPATH=. python benchmarks/planner_validation.py [--fit-only]

Published figures (not measured here):
  torchtitan, docs/performance.md (Llama 3.1, bf16, seq 8192, H100 96GB HBM2e at 500 W):
    8B FSDP on 8 GPUs, local batch 2, selective AC: 5,762 tok/s/GPU (eager)
    8B FSDP on 128 GPUs, local batch 2, selective AC: 5,605 (eager)
    ("selective" there is torchtitan's per-operator policy, ``selective_ac_option = 'op'`` in its
    Llama-3 8B config: modelled as ``parallel.activation_checkpointing = "op"``)
    70B FSDP 32 x TP 8 on 256 GPUs, local batch 16, full AC: 829 (with torch.compile and Float8)
  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1 (GPT, seq 2048, vocabulary 51,200, A100 80GB, full recomputation):
    TFLOP/s per GPU by their count 96 B s l h^2 (1 + s/6h + V/16lh) (recomputation included).
    Rows: 1.7B, 3.6B, 7.5B, 18.4B, 39.1B, 76.1B, 145.6B (batch 2304), 310.1B, 529.6B, 1T.
The device constants are those of analysis/devices.py (docs/planner.md), the same for all rows.
Assumed where the publications do not say: Megatron micro-batch 1, the interleaved schedule
(section 5.1 says Table 1 ran it) with the fewest virtual stages > 1 that divide a stage's
layers, DDP, sequence parallel
off (2021), its fused kernels modelled as ``parallel.compile``, its data-parallel all-reduce after
the backward (Megatron-LM's DDP of that time: ``overlap_comm`` off); torchtitan TP with sequence
parallel. The 70B row ran with torch.compile and Float8 matmuls: predicted with Float8 priced
(analysis/plan_features.py) since it is modelled; refused by name before, and compared with a bf16
prediction before 2026-11-26. Since 2026-11-27 the torchtitan rows are priced with FSDP2's copies
(``fsdp2``: its all-gather copy-out and reduce-scatter copy-in on the compute stream) and the 70B
row's compile as torchtitan applies it, to each block only (``compile_blocks``): both read from
PyTorch's and torchtitan's code (analysis/plan_features.py), as for the held-out torchtitan rows;
and with torchtitan's optimizer (``foreach_adamw``: torch.optim.AdamW with foreach and
clip_grad_norm_, one pass per foreach op), read from its code in the same way. Since 6354896 (2026-11-27)
the Megatron-LM rows store their weights in 16 bits (``half_params``: Megatron-LM's
Float16Module converts the model with ``module.half()`` / ``module.bfloat16()`` and its optimizer keeps
fp32 main weights), so no per-micro-batch weight copies are saved or moved, as for the two held-out
Megatron-LM rows.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from shardlab.analysis.devices import FITTED_EFFICIENCY
from shardlab.analysis.plan_search import layout_label
from shardlab.analysis.predict import predict, scaled_step
from shardlab.config import Config
import shardlab.train.checks  # noqa: F401  (registers every config check validate runs)

sys.path.insert(0, str(Path(__file__).parent))
import planner_heldout  # noqa: E402

LLAMA = {"8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336),
         "70b": dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672)}
TITAN = [  # (label, model, gpus, dp_shard, tp, local batch, AC, published tok/s/GPU, note)
    ("torchtitan Llama-3.1-8B FSDP 8", "8b", 8, 8, 1, 2, "op", 5762, "eager"),
    ("torchtitan Llama-3.1-8B FSDP 128", "8b", 128, 128, 1, 2, "op", 5605, "eager"),
    ("torchtitan Llama-3.1-70B FSDP 32 x TP 8", "70b", 256, 32, 8, 16, "full", 829, "compile + Float8"),
]
MEGATRON = [  # (params, hidden, heads, layers, tp, pp, gpus, batch, published TFLOP/s per GPU)
    ("1.7B", 2304, 24, 24, 1, 1, 32, 512, 137),
    ("3.6B", 3072, 32, 30, 2, 1, 64, 512, 138),
    ("7.5B", 4096, 32, 36, 4, 1, 128, 512, 142),
    ("18.4B", 6144, 48, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 8192, 64, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 10240, 80, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 12288, 96, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 16384, 128, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 20480, 128, 105, 8, 35, 2520, 2520, 163),
    ("1T", 25600, 160, 128, 8, 64, 3072, 3072, 163),
]


def titan_cfg(model, gpus, dp_shard, tp, local, ac, compiled=False):
    cfg = Config()
    for k, v in LLAMA[model].items():
        setattr(cfg.model, k, v)
    cfg.model.max_seq_len = cfg.train.seq_len = 8192
    cfg.model.rope_theta = 500000.0
    cfg.train.precision, cfg.train.global_batch = "bf16", local * dp_shard
    p = cfg.parallel
    p.dp_shard, p.tp, p.zero_stage, p.activation_checkpointing = dp_shard, tp, 3, ac
    p.sequence_parallel, p.compile = tp > 1, compiled
    return cfg.validate(gpus)


def megatron_cfg(h, heads, layers, tp, pp, gpus, batch):
    cfg = Config()
    m = cfg.model
    m.arch, m.vocab_size, m.d_model, m.n_heads, m.n_layers = "gpt2", 51200, h, heads, layers
    m.max_seq_len = cfg.train.seq_len = 2048
    m.attention, m.dropout = "math", 0.1  # 2021: scores materialised (no flash kernels yet), dropout 0.1
    cfg.train.precision, cfg.train.global_batch = "bf16", batch
    p = cfg.parallel
    p.tp, p.pp, p.dp_shard = tp, pp, gpus // (tp * pp)
    p.microbatches = batch // p.dp_shard  # micro-batch of 1 sequence
    p.activation_checkpointing = "full"
    p.compile = True  # Megatron's fused kernels (bias-GeLU, scaled masked softmax, fused LayerNorm)
    p.overlap_comm = False  # Megatron-LM (2021): its DDP all-reduces the gradient buffer after the backward
    if pp > 1:  # section 5.1: "we use the interleaved pipeline schedule"; virtual stages not stated:
        per_stage = layers // pp  # the fewest > 1 that divide the layers of a stage (Megatron needs it)
        p.pp_schedule, p.pp_virtual = "interleaved", next(v for v in range(2, per_stage + 1) if per_stage % v == 0)
    return cfg.validate(gpus)


def megatron_flops(b, s, layers, h, vocab=51200):
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def rows():
    out = []
    for label, model, gpus, dp, tp, local, ac, pub, note in TITAN:
        cfg = titan_cfg(model, gpus, dp, tp, local, ac, "compile" in note)
        # torchtitan runs FSDP2 (its copies priced: fsdp2), compiles the blocks only (compile_blocks) and
        # steps torch's foreach AdamW after clip_grad_norm_ (foreach_adamw)
        feats = ("fsdp2", "foreach_adamw") + (("compile_blocks",) if "compile" in note else ()) \
            + (("float8",) if "Float8" in note else ())
        pr = predict(cfg, "h100-gt", per_rank=False, features=feats)
        got = pr.tokens_per_s / gpus
        out.append((label, f"{gpus} H100", "tok/s/GPU", got, pub, pr.mfu, note, pr.breakdown, layout_label(cfg)))
    for name, h, heads, layers, tp, pp, gpus, batch, pub in MEGATRON:
        cfg = megatron_cfg(h, heads, layers, tp, pp, gpus, batch)
        # Megatron-LM keeps the model in 16 bits (Float16Module) with fp32 main weights in its optimizer
        pr = predict(cfg, "a100", per_rank=False, features=("half_params",))
        tflops = megatron_flops(batch, 2048, layers, h) / pr.step_time_s / gpus / 1e12
        out.append((f"Megatron-LM GPT {name} tp{tp} pp{pp}", f"{gpus} A100", "TFLOP/s/GPU", tflops, pub, pr.mfu,
                    "recompute counted", pr.breakdown, layout_label(cfg)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit-only", action="store_true", help="the fit set only (no held-out rows)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    table = rows()
    # One global efficiency constant eta (all devices, all rows) scaling the compute-bound time:
    # step(eta) = (step - exposed communication - optimizer) / eta + the rest. Fitted to minimise
    # the median absolute error; leave-one-out: each row predicted with eta fitted on the others.
    def scaled(row, eta):
        return row[3] * row[7]["step_s"] / scaled_step(row[7], eta)

    def fit(subset):
        grid = [0.40 + 0.005 * i for i in range(161)]
        return min(grid, key=lambda e: statistics.median(abs(scaled(r, e) - r[4]) / r[4] for r in subset))

    table, refused = [r for r in table if r[3] is not None], [r for r in table if r[3] is None]
    eta = fit(table)
    print("Fit set (the rows the model was shaped against: in-sample)\n")
    print("| run | GPUs | layout | unit | published | predicted | error | predicted MFU | leave-one-out calibrated | error | note |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    errs, loo_errs = [], []
    for i, row in enumerate(table):
        label, gpus, unit, got, pub, mfu, note, _, layout = row
        err = (got - pub) / pub
        loo = scaled(row, fit(table[:i] + table[i + 1:]))
        lerr = (loo - pub) / pub
        errs.append(abs(err))
        loo_errs.append(abs(lerr))
        print(f"| {label} | {gpus} | {layout} | {unit} | {pub:,} | {got:,.0f} | {100 * err:+.1f}% | "
              f"{'' if mfu is None else f'{100 * mfu:.1f}%'} | {loo:,.0f} | {100 * lerr:+.1f}% | {note} |")
    for label, gpus, unit, _, pub, _, note, _, layout in refused:
        print(f"| {label} | {gpus} | {layout} | {unit} | {pub:,} | refused | not modelled | | | | {note} |")
    print(f"\nfit set: median absolute error, stated device constants: {100 * statistics.median(errs):.1f}% over "
          f"{len(errs)} rows ({len(refused)} refused)")
    print(f"one global efficiency constant fitted over all rows: eta = {eta:.3f} (compute time / eta); "
          f"leave-one-out median absolute error {100 * statistics.median(loo_errs):.1f}% "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"shardlab plan --efficiency fitted uses devices.FITTED_EFFICIENCY = {FITTED_EFFICIENCY:.3f}"
          + ("" if abs(FITTED_EFFICIENCY - eta) < 1e-9 else f" (differs from this fit: update it to {eta:.3f})"))
    if args.fit_only:
        return 0
    print("\nHeld-out set (benchmarks/planner_heldout.toml, committed before any prediction on it)\n")
    held = planner_heldout.rows()
    herrs = planner_heldout.print_table(held)
    print("\n" + planner_heldout.summary(herrs, held))
    print(planner_heldout.memory_summary(held))
    print(f"\nfit median {100 * statistics.median(errs):.1f}% ({len(errs)} rows, in-sample) | held-out median "
          f"{100 * statistics.median(herrs):.1f}%, max {100 * max(herrs):.1f}% ({len(herrs)} modelled rows) "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
