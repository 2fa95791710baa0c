"""Per-rank peak memory of building a model: meta build + streamed init vs the old full build.

    PYTHONPATH=. python benchmarks/init_memory.py --config configs/llama-350m.toml --nproc 4 \\
        --layouts fsdp tp pp --seq 64 --out benchmarks/results/init_memory.md

For each layout (fsdp: dp_shard=N, zero_stage=3; tp: tp=N; pp: pp=N, 4 micro-batches) and each
path ("meta": ``meta_model`` + ``parallelize``, each rank materialises only what it owns;
"full-build": ``build_model`` materialises the whole model on every rank, then ``parallelize``
slices it), N fresh spawned ranks (one launch per row) measure their peak RSS after
construction (model + parallelize + optimizer) and after the first step (forward/backward of
micro-batch 1 x ``--seq`` tokens per micro-batch + AdamW step). Peak RSS = ``VmHWM`` of the
rank's process image, the quantity ``ru_maxrss`` reports without the spawning parent's peak
(see benchmarks/_ranks.py); the table gives the max over ranks, in MiB.

Bounds: construction <= fixed + owned parameters and the gradient buffers the engine allocates
when built (FSDP/ZeRO shards); step <= fixed + owned state after the step
(parameters + Adam m, v measured from the rank's tensors, gradients counted as large as the
parameters; max over ranks) + FSDP's peak gathered parameters + activations. "fixed" = the measured peak RSS of a rank that imports
torch + shardlab, builds the mesh and a 1-layer tiny model (d 64, vocab 256, FSDP over N) and
runs one step. Activations = ``analysis.measured_memory.activation_estimate(cfg, 1, 4)``: one micro-batch
of the whole model in fp32 (no TP reduction; a pp stage holds layers/pp for up to pp micro-batches
in flight: the same amount). An estimate, not a measurement. "full" = 4 bytes x
parameters (the fp32 model alone).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _ranks  # noqa: E402
from shardlab.config import load  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check validate runs)
from shardlab.launch import run  # noqa: E402
from shardlab.models import count_params, meta_model  # noqa: E402

LAYOUTS = {"fsdp": dict(dp_shard=None, zero_stage=3), "tp": dict(tp=None), "pp": dict(pp=None, microbatches=4)}
MiB = _ranks.MiB


def layout_cfg(base_path, overrides, layout: str, n: int, seq: int):
    cfg = load(base_path, overrides)
    for k, v in LAYOUTS[layout].items():
        setattr(cfg.parallel, k, n if v is None else v)
    cfg.train.seq_len = seq
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq)
    cfg.train.global_batch = cfg.parallel.dp * cfg.parallel.microbatches  # micro-batch 1
    return cfg.validate(world_size=n)


def fixed_cfg(n: int, seq: int):
    cfg = load(None, {"model": dict(vocab_size=256, d_model=64, n_layers=1, n_heads=4, max_seq_len=seq),
                      "parallel": dict(dp_shard=n, zero_stage=3), "train": dict(seq_len=seq, global_batch=n)})
    return cfg.validate(world_size=n)


def _worker(ctx, cfg, path: str, seq: int) -> dict:
    from shardlab.analysis.measured_memory import measure
    out = {"start": _ranks.peak_mib()}
    mesh, engine, opt = _ranks.build_engine(cfg, ctx.device, path)
    built = measure(engine, opt)
    out["owned_params"] = (built.params + built.grads) / MiB  # FSDP/ZeRO allocate gradient shards at build
    out["construct"] = _ranks.peak_mib()
    _ranks.train_step(cfg, mesh, engine, opt, 1, seq)
    out["step"] = _ranks.peak_mib()
    st = measure(engine, opt)  # after zero_grad: gradient buffers an engine keeps still count
    out["owned_state"] = (st.params + max(st.grads, st.params) + st.optim) / MiB
    out["gathered"] = getattr(engine, "peak_gathered_bytes", 0) / MiB
    out["ru_maxrss"] = _ranks.ru_maxrss_mib()
    return out


def _max(rows, key):
    return max(r[key] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-350m.toml")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--paths", nargs="+", default=["meta", "full-build"], choices=["meta", "full-build"])
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence of the one training step")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per launch, seconds")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    ap.add_argument("overrides", nargs="*", help="--section.key=value config overrides")
    args, extra = ap.parse_known_args()
    overrides = args.overrides + extra
    from shardlab.analysis.measured_memory import activation_estimate

    n, seq = args.nproc, args.seq
    base = load(args.config, overrides)
    psi = count_params(meta_model(base.model))
    full = 4 * psi / MiB
    head = (f"model: {args.config} {' '.join(overrides)}: {psi:,} parameters, fp32 = {full:.0f} MiB; "
            f"N = {n} ranks; step: micro-batch 1 x {seq} tokens, AdamW; parent peak RSS "
            f"{_ranks.peak_mib():.0f} MiB (ru_maxrss of a spawned rank includes it; VmHWM used)")
    print(head, flush=True)

    fx = run(_worker, n, fixed_cfg(n, seq), "meta", seq, threads=1, timeout_s=args.timeout)
    fixed = _max(fx, "step")
    fixed_line = (f"fixed overhead: {fixed:.0f} MiB = peak RSS (max over {n} ranks) of a rank that imports "
                  f"torch + shardlab, builds the mesh and a 1-layer tiny model (FSDP over {n}) and runs one "
                  f"step; at start (imports + process group) {_max(fx, 'start'):.0f} MiB")
    print(fixed_line, flush=True)

    rows = []
    for layout in args.layouts:
        cfg = layout_cfg(args.config, overrides, layout, n, seq)
        act = activation_estimate(cfg, 1, 4) / MiB  # pp: layers/pp per stage x up to pp micro-batches
        for path in args.paths:
            res = run(_worker, n, cfg, path, seq, threads=1, timeout_s=args.timeout)
            b_con = fixed + _max(res, "owned_params")
            b_step = fixed + _max(res, "owned_state") + _max(res, "gathered") + act
            rows.append((layout, path, _max(res, "construct"), b_con, _max(res, "step"), b_step, act,
                         _max(res, "ru_maxrss")))
            print(f"  {layout:5s} {path:10s} construct {rows[-1][2]:8.0f} MiB  step {rows[-1][4]:8.0f} MiB",
                  flush=True)

    lines = ["| layout | path | full fp32 MiB | peak after construction MiB | bound construction MiB | "
             "peak after step 1 MiB | bound step MiB (act. MiB) | construction / full | step / full | "
             "ru_maxrss MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for layout, path, con, b_con, step, b_step, act, ru in rows:
        lines.append(f"| {layout} (N={n}) | {path} | {full:.0f} | {con:.0f} | {b_con:.0f} | {step:.0f} | "
                     f"{b_step:.0f} ({act:.0f}) | {con / full:.2f} | {step / full:.2f} | {ru:.0f} |")
    table = "\n".join(lines)
    print()
    print(table)
    _ranks.write_table(args.out, head, fixed_line, table)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
