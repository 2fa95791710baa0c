"""``shardlab memory CONFIG --nproc N``: the configured layout's per-rank memory as the planner
predicts it (analysis/predict.py: model state, activations, buffers, transient; TP, PP, CP and EP
honoured), the ZeRO formula by stage, and what a real run holds (analysis/memory.measure_run)."""
from __future__ import annotations

import argparse

from ..analysis.memory import STAGES, formula, measure_run


def configure(p: argparse.ArgumentParser):
    p.add_argument("config", nargs="?", help="TOML/JSON config (DeepSpeed JSON accepted)")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (if the config sets no degrees)")
    p.add_argument("--no-run", action="store_true", help="prediction and formula only: do not start ranks")
    p.add_argument("--device", default="cpu", help="activations as on this device kind: cpu or a GPU kind "
                                                  "(h100, h200, a100); bf16/fp16 runs follow that device's "
                                                  "autocast rules (docs/planner.md)")


def resolve(config_path, overrides, nproc: int):
    from ..config import load
    cfg = load(config_path, overrides)
    if cfg.parallel.world_size == 1 and nproc > 1:  # a single-process config: shard over N ranks
        cfg.parallel.dp_shard = nproc
    return cfg.validate(world_size=nproc)


def main(args) -> int:
    from ..analysis.predict import memory_per_rank
    from ..distributed.topology import Topology
    from ..models import count_params, meta_model
    from ..models.spec import add_adapters, get_spec

    cfg = resolve(args.config, args.overrides, args.nproc)
    model = meta_model(cfg.model)
    if cfg.train.lora_rank:
        add_adapters(model, cfg.train)
    psi = count_params(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    p = cfg.parallel
    n = p.dp_shard * p.cp if p.zero_stage == 3 else p.dp * p.cp
    stage = p.zero_stage
    mib = 2**20
    layout = Topology.from_config(p).describe()
    print(f"model: {psi:,} parameters ({trainable:,} trainable: gradients and optimizer state); layout "
          f"{layout}; {n} data-parallel ranks sharding state; configured: {STAGES[stage]}")
    print("ZeRO formula (whole model over the data-parallel ranks; TP/PP not applied):")
    print(f"{'stage':<8}{'formula':<10}{'params MiB':>12}{'grads MiB':>12}{'optim MiB':>12}{'total MiB':>12}")
    for s in STAGES:
        for prec in ("mixed", "fp32"):
            f = formula(psi, n, s, prec, trainable)
            mark = " <" if s == stage else ""
            print(f"{STAGES[s]:<8}{prec:<10}{f.params / mib:>12.3f}{f.grads / mib:>12.3f}{f.optim / mib:>12.3f}"
                  f"{f.total / mib:>12.3f}{mark}")
    pred = memory_per_rank(cfg, args.device)
    b = max(1, cfg.train.global_batch // p.dp // p.microbatches)
    lm = get_spec(cfg.model).task == "lm"
    print(f"predicted per rank (analysis/predict.py; micro-batch {b} x {cfg.train.seq_len // p.cp} tokens, "
          f"{p.microbatches} micro-batches{', schedule ' + p.pp_schedule if p.pp > 1 else ''}), MiB:")
    print(f"{'rank':>5}{'stage':>6}{'params':>10}{'grads':>10}{'optim':>10}{'activ.':>10}{'W stash':>10}"
          f"{'buffers':>10}{'transient':>10}{'total':>10}")
    for r in pred:
        print(f"{r.rank:>5}{r.stage:>6}" + "".join(f"{v / mib:>10.3f}" for v in (
            r.params, r.grads, r.optim, r.activations, r.wgrad, r.buffers, r.transient, r.total)))
    if not lm:
        print(f"activations: no estimate for model.arch={cfg.model.arch} (the trace covers token models)")
    if args.no_run:
        return 0
    print(f"measured after one AdamW step with {args.nproc} ranks ({STAGES[stage]}, precision "
          f"{cfg.train.precision}, param_dtype {cfg.train.param_dtype or 'fp32'}):")
    for r, got in enumerate(measure_run(cfg, args.nproc)):
        want = pred[r]
        print(f"  rank {r}: params {got.params / mib:.3f}  grads {got.grads / mib:.3f}  optim {got.optim / mib:.3f}"
              f"  total {got.total / mib:.3f} MiB  (predicted {want.params / mib:.3f} + {want.grads / mib:.3f} + "
              f"{want.optim / mib:.3f} = {want.model_state / mib:.3f}, ratio {got.total / want.model_state:.3f})")
    return 0
