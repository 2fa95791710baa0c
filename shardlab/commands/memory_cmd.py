"""``shardlab memory CONFIG --nproc N``: model-state bytes per rank by ZeRO stage, the formula
next to a measured run (analysis/memory.py)."""
from __future__ import annotations

import argparse

from ..analysis.memory import STAGES, activation_estimate, formula, measure_run
from ..models.spec import get_spec


def configure(p: argparse.ArgumentParser):
    p.add_argument("config", nargs="?", help="TOML/JSON config (DeepSpeed JSON accepted)")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (if the config sets no degrees)")
    p.add_argument("--no-run", action="store_true", help="formula only: do not start ranks")


def resolve(config_path, overrides, nproc: int):
    from ..config import load
    cfg = load(config_path, overrides)
    if cfg.parallel.world_size == 1 and nproc > 1:  # a single-process config: shard over N ranks
        cfg.parallel.dp_shard = nproc
    return cfg.validate(world_size=nproc)


def main(args) -> int:
    from ..models import count_params, meta_model
    from ..models.spec import add_adapters

    cfg = resolve(args.config, args.overrides, args.nproc)
    model = meta_model(cfg.model)
    if cfg.train.lora_rank:
        add_adapters(model, cfg.train)
    psi = count_params(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n = cfg.parallel.dp_shard * cfg.parallel.cp if cfg.parallel.zero_stage == 3 else cfg.parallel.dp * cfg.parallel.cp
    stage = cfg.parallel.zero_stage
    mib = 2**20
    print(f"model: {psi:,} parameters ({trainable:,} trainable: gradients and optimizer state); {n} "
          f"data-parallel ranks sharding state; configured: {STAGES[stage]}")
    print(f"{'stage':<8}{'formula':<10}{'params MiB':>12}{'grads MiB':>12}{'optim MiB':>12}{'total MiB':>12}")
    for s in STAGES:
        for prec in ("mixed", "fp32"):
            f = formula(psi, n, s, prec, trainable)
            mark = " <" if s == stage else ""
            print(f"{STAGES[s]:<8}{prec:<10}{f.params / mib:>12.3f}{f.grads / mib:>12.3f}{f.optim / mib:>12.3f}"
                  f"{f.total / mib:>12.3f}{mark}")
    b = max(1, cfg.train.global_batch // cfg.parallel.dp // cfg.parallel.microbatches)
    if get_spec(cfg.model).task == "lm":  # the estimate is the transformer formula (analysis/memory.py)
        act = activation_estimate(cfg, b, 4)
        print(f"activations (estimate, fp32, micro-batch {b} x {cfg.train.seq_len}): {act / mib:.3f} MiB per rank")
    else:
        print(f"activations: no estimate for model.arch={cfg.model.arch} (the formula is the transformer's)")
    if args.no_run:
        return 0
    low = cfg.train.param_dtype in ("bf16", "fp16")
    prec = "mixed" if low else "fp32"
    print(f"measured after one AdamW step with {args.nproc} ranks ({STAGES[stage]}, precision "
          f"{cfg.train.precision}, param_dtype {cfg.train.param_dtype or 'fp32'}):")
    expect = formula(psi, n, stage, prec, trainable)
    for r, got in enumerate(measure_run(cfg, args.nproc)):
        print(f"  rank {r}: params {got.params / mib:.3f}  grads {got.grads / mib:.3f}  optim {got.optim / mib:.3f}"
              f"  total {got.total / mib:.3f} MiB  (formula {prec} {expect.params / mib:.3f} + "
              f"{expect.grads / mib:.3f} + {expect.optim / mib:.3f} = {expect.total / mib:.3f}, "
              f"ratio {got.total / expect.total:.3f})")
    return 0
