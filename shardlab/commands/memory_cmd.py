"""``shardlab memory CONFIG --nproc N``: the configured layout's per-rank memory as the planner
predicts it (analysis/predict.py: model state, activations, buffers, transient; TP, PP, CP and EP
honoured), the ZeRO formula by stage, and what a real run holds (analysis/memory.measure_run)."""
from __future__ import annotations

import argparse

from ..analysis.measured_memory import STAGES, formula, measure_run


def configure(p: argparse.ArgumentParser):
    p.add_argument("config", nargs="?", help="TOML/JSON config (DeepSpeed JSON accepted)")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (if the config sets no degrees)")
    p.add_argument("--no-run", action="store_true", help="prediction and formula only: do not start ranks")
    p.add_argument("--timeline", metavar="PNG", help="draw memory per rank over the measured steps (phases "
                                                     "shaded, model state stacked) into this PNG")
    p.add_argument("--categories", action="store_true", help="profile the last measured step's allocations "
                                                                "(torch.profiler) and print the bytes of each "
                                                                "category at its peak (slower)")
    p.add_argument("--cuda-snapshot", metavar="PATH", default="", help="CUDA: write each rank's allocation "
                                                                      "history for pytorch.org/memory_viz "
                                                                      "(RANK in PATH is the rank)")
    p.add_argument("--steps", type=int, default=2, help="measured training steps (>= 2: the second holds "
                                                          "the optimizer states the first created)")
    p.add_argument("--device", default="cpu", help="activations as on this device kind: cpu or a GPU kind "
                                                  "(h100, h200, a100); bf16/fp16 runs follow that device's "
                                                  "autocast rules (docs/planner.md)")


def resolve(config_path, overrides, nproc: int):
    from ..errors import at_least
    from ..train.finetune import load_resolved
    at_least(nproc, 1, "--nproc")
    return load_resolved(config_path, overrides, nproc)  # as train runs it


def main(args) -> int:
    from ..analysis.predict import memory_per_rank
    from ..distributed.topology import Topology
    from ..models import count_params, meta_model
    from ..models.spec import add_adapters, get_spec
    from ..train.images import EVAL_BATCH

    if args.timeline:
        from ..errors import ConfigError, output_file
        output_file(args.timeline, "--timeline")
        if args.no_run:
            raise ConfigError("--timeline", "the timeline is drawn from a measured run; drop --no-run")
    if args.steps < 1:
        from ..errors import ConfigError
        raise ConfigError("--steps", f"{args.steps}: measure at least one step (2 holds the optimizer states)")
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
    micro = f"{b} x {cfg.train.seq_len // p.cp} tokens" if lm else f"{b} images"
    data = any(r.data for r in pred)
    print(f"predicted per rank at the peak of a step (analysis/predict.py; micro-batch {micro}, "
          f"{p.microbatches} micro-batches{', schedule ' + p.pp_schedule if p.pp > 1 else ''}), MiB:")
    print(f"{'rank':>5}{'stage':>6}{'params':>10}{'grads':>10}{'optim':>10}{'activ.':>10}{'W stash':>10}"
          f"{'buffers':>10}{'transient':>10}{'bwd grad':>10}{'optim tmp':>10}{'empty':>8}"
          + (f"{'data':>8}" if data else "") + f"{'peak':>10}")
    for r in pred:
        print(f"{r.rank:>5}{r.stage:>6}" + "".join(f"{v / mib:>10.1f}" for v in (
            r.params, r.grads, r.optim, r.activations, r.wgrad, r.buffers, r.transient, r.bwd_transient,
            r.opt_transient)) + f"{r.fixed / mib:>8.0f}" + (f"{r.data / mib:>8.1f}" if data else "")
            + f"{r.total / mib:>10.1f}")
    print("  peak = empty rank + " + ("data + " if data else "") + "params + grads + optim + max(activ. + W stash + "
          "buffers + transient + bwd grad, optim tmp); empty = an empty rank's RSS (CPU; 0 on CUDA: allocated bytes "
          "exclude the context)" + ("; data = the dataset each rank holds in memory (both splits)" if data else ""))
    if any(r.evaluation for r in pred):
        r = max(pred, key=lambda r: r.run_peak)
        when = f"every {cfg.train.eval_every} steps and after the last" if cfg.train.eval_every else "after the last step"
        print(f"evaluation ({when}; {EVAL_BATCH}-image batches, no gradients): {r.evaluation / mib:,.1f} MiB alive at "
              f"once beside the model state and buffers, so a run peaks at {r.run_peak / mib:,.1f} MiB per rank"
              + ("" if args.no_run else " (the measured run below makes steps only)"))
    if args.no_run:
        return 0
    check_measurable(cfg, pred)
    print(f"measured over {args.steps} AdamW steps with {args.nproc} ranks ({STAGES[stage]}, precision "
          f"{cfg.train.precision}, param_dtype {cfg.train.param_dtype or 'fp32'}):")
    results = measure_run(cfg, args.nproc, args.steps, args.cuda_snapshot, args.categories)
    for r, (got, trace) in enumerate(results):
        want = pred[r]
        print(f"  rank {r}: params {got.params / mib:.3f}  grads {got.grads / mib:.3f}  optim {got.optim / mib:.3f}"
              f"  total {got.total / mib:.3f} MiB  (predicted {want.params / mib:.3f} + {want.grads / mib:.3f} + "
              f"{want.optim / mib:.3f} = {want.model_state / mib:.3f}, ratio {got.total / want.model_state:.3f})")
    kind = "peak RSS (VmHWM)" if results[0][1].device == "cpu" else "max_memory_allocated"
    print(f"peak per rank: predicted (with the measured empty rank) vs measured {kind}, MiB:")
    from ..analysis.memtrace import SPLIT
    from ..analysis.predict import RESERVED_PER_ALLOCATED, reserved
    peaks = []
    for r, (_, trace) in enumerate(results):
        want = pred[r].total - pred[r].fixed + trace.baseline
        peaks.append(want)
        extra = (f"  reserved {trace.reserved / mib:,.1f} (stated {reserved(want, trace.device) / mib:,.1f}: "
                 f"{RESERVED_PER_ALLOCATED:.2f}x predicted, docs/planner.md)" if trace.reserved else
                 "  (heap {:,.0f}, libraries {:,.0f}, shared arena {:,.0f}; since the empty rank "
                 "{:+,.1f} / {:+,.1f} / {:+,.1f})".format(
                     *(trace.split.get(k, 0) / mib for k in SPLIT),
                     *((trace.split.get(k, 0) - trace.baseline_split.get(k, 0)) / mib for k in SPLIT)))
        print(f"  rank {r}: predicted {want / mib:,.1f}  measured {trace.peak / mib:,.1f}  ratio "
              f"{trace.peak / want:.3f}  empty rank {trace.baseline / mib:,.1f}{extra}")
    if args.categories:
        _print_categories(results)
    if args.timeline:
        from ..analysis.memtrace import draw
        draw([t for _, t in results], args.timeline, f"{layout}, {STAGES[stage]}: memory per rank", peaks)
        print(f"timeline: {args.timeline}")
    return 0


def check_measurable(cfg, pred) -> None:
    """Before the measured run: refuse (exit 2; the prediction above stands) what would fail in its
    ranks: train.device = cuda without a visible GPU, or CPU ranks whose predicted peaks together
    exceed this machine's available memory (they would be OOM-killed mid-step)."""
    from ..errors import ConfigError
    from .doctor_cmd import meminfo
    from ..launch import check_device
    check_device(cfg.train.device, "--train.device=cpu (--device sets the predicted activations' kind)")
    avail = meminfo().get("MemAvailable", 0)
    need = sum(r.total for r in pred)
    if cfg.train.device in ("auto", "cpu") and avail and need > avail:
        raise ConfigError("measured run", f"{len(pred)} CPU ranks need about {need / 2**30:,.1f} GiB together (the "
                                          f"predicted peaks above), more than the {avail / 2**30:,.1f} GiB available "
                                          "here; the prediction stands: pass --no-run, or measure a smaller config")


def _print_categories(results):
    """Where the peak goes: torch.profiler's categories at the last step's allocation peak, the
    empty rank, and the rest of the measured peak (shared-memory arena, allocator slack, libraries
    loaded later, Python objects)."""
    from ..analysis.memtrace import CATEGORIES
    mib = 2**20
    print("at the last step's allocation peak (torch.profiler memory categories), MiB; the profiler's own "
          "event buffers are in 'rest' and this run's peak: read peaks from a run without --categories")
    print(f"{'rank':>5}" + "".join(f"{c[:11]:>12}" for c in CATEGORIES) + f"{'allocated':>11}{'empty rank':>11}"
          f"{'rest':>8}{'peak':>9}")
    for r, (_, tr) in enumerate(results):
        c = tr.categories
        rest = tr.peak - tr.baseline - c["allocated"]
        print(f"{r:>5}" + "".join(f"{c[k] / mib:>12.1f}" for k in CATEGORIES) + f"{c['allocated'] / mib:>11.1f}"
              f"{tr.baseline / mib:>11.1f}{rest / mib:>8.1f}{tr.peak / mib:>9.1f}")
