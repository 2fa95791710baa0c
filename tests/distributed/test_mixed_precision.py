"""bf16 and fp16 (dynamic loss scaling) in every engine, against one process in the same precision.

Each layout (DDP, ZeRO-1, ZeRO-2, ZeRO-3, TP+SP, PP, CP, EP) trains ``STEPS`` steps through
``Trainer.train_step`` on 2 gloo ranks, in bf16 and in fp16. The reference is independent: the
plain ``build_model`` model in one process on the whole global batch, under the same autocast,
with the loss-scaling arithmetic written out below (scale the loss, divide the gradients, skip
and halve on inf/nan, double after ``WINDOW`` clean steps), gradient clipping and torch AdamW.

Low precision rounds differently when the batch is split over ranks (each rank's gradient is
rounded to bf16/fp16 before it is reduced; TP/CP split matmuls), so losses and gradient norms
agree to a tolerance, not to float64's 1e-10: ``TOL`` (absolute on losses near 5.5, relative on
gradient norms). The skip decisions and the loss scale must agree exactly.

A forced overflow (initial scale 1e30 in fp16) must make every rank of every engine skip every
step, back the scale off by 2 per step and leave finite, unchanged parameters.
"""
from __future__ import annotations

import math

import pytest
import torch

from shardlab.analysis.verify import reference_adamw
from shardlab import config as C
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.train.data import Loader, TokenData, prepare
from shardlab.train.optim import lr_at
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

STEPS, WINDOW, OVERFLOW_STEPS = 20, 5, 4
INIT_SCALE = 2.0**8  # grows to 2**12 in 20 steps: far from fp16 overflow on a split or whole batch
# Measured max |loss diff| / max relative grad-norm diff over the layouts: see docs/training.md.
TOL = {"bf16": (4e-3, 2e-2), "fp16": (1e-3, 4e-3)}
MOE = {"n_experts": 4, "moe_top_k": 2}
LAYOUTS = {
    "ddp": ({"dp_replicate": 2}, {}),
    "zero1": ({"dp_shard": 2, "zero_stage": 1, "bucket_cap_mb": 0.01}, {}),
    "zero2": ({"dp_shard": 2, "zero_stage": 2, "bucket_cap_mb": 0.01}, {}),
    "zero3": ({"dp_shard": 2, "zero_stage": 3}, {}),
    "tp-sp": ({"tp": 2, "sequence_parallel": True}, {}),
    "pp": ({"pp": 2, "microbatches": 2}, {}),
    "cp": ({"cp": 2}, {}),
    "ep": ({"ep": 2, "dp_shard": 2}, MOE),
    # low-precision storage: parameters/gradients (ZeRO-1/2) or gather + reduce-scatter (FSDP)
    # in the run's precision, fp32 master slices
    "ddp-low": ({"dp_replicate": 2}, {}),
    "zero1-low": ({"dp_shard": 2, "zero_stage": 1, "bucket_cap_mb": 0.01}, {}),
    "zero2-low": ({"dp_shard": 2, "zero_stage": 2, "bucket_cap_mb": 0.01}, {}),
    "zero3-low": ({"dp_shard": 2, "zero_stage": 3}, {}),
}


def make_cfg(cache: str, parallel: dict, model: dict, precision: str, init_scale: float = INIT_SCALE,
             low: bool = False) -> C.Config:
    stage = parallel.get("zero_stage", 0)
    storage = {**({"param_dtype": precision} if stage else {}), **({"reduce_dtype": precision} if stage in (0, 3) else {})}
    cfg = C.from_dict({
        "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 16, **model},
        "train": {"seq_len": 16, "global_batch": 8, "lr": 3e-3, "warmup_steps": 2, "steps": STEPS,
                  "grad_clip": 1.0, "precision": precision, "loss_scale_init": init_scale,
                  "loss_scale_window": WINDOW, "device": "cpu", **(storage if low else {})},
        "data": {"cache_dir": cache},
        "parallel": dict(parallel)})
    return cfg.validate(2 if parallel else 1)


def reference(cfg: C.Config, data_dir: str, steps: int):
    """One process, whole global batch, plain model, the loss-scaling arithmetic spelled out.
    Returns per step (loss, grad norm or nan, skipped, scale after the step) and the parameters."""
    t = cfg.train
    model = build_model(cfg.model, t.seed, dtype=torch.float32)
    opt = reference_adamw(model, t)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
    fp16 = t.precision == "fp16"
    scale, clean = (t.loss_scale_init if fp16 else 1.0), 0
    loader = Loader(TokenData(data_dir), t.seq_len, t.global_batch, 1, 0, 1, t.seed)
    rows = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        (x, y), = loader.next_batch()
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x, y)
        (loss * scale).backward()
        skipped, norm = False, math.nan
        if fp16:
            for p in model.parameters():
                p.grad.div_(scale)
            skipped = not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        if skipped:
            scale, clean = scale / 2, 0
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip))
            opt.step()
            if fp16:
                clean += 1
                if clean == WINDOW:
                    scale, clean = scale * 2, 0
        opt.zero_grad(set_to_none=True)
        rows.append((loss.item(), norm, skipped, scale))
    return rows, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(cfg: C.Config, data_dir: str, steps: int, device):
    from shardlab.train.loop import Trainer
    mesh = Mesh.build(Topology.from_config(cfg.parallel), device)
    tr = Trainer(cfg, mesh, TokenData(data_dir))
    before = [p.detach().clone() for p in tr.engine.parameters()]
    rows = []
    for _ in range(steps):
        out = tr.train_step()
        rows.append((tr.engine.global_loss(out["local_loss"]), out["grad_norm"], out["skipped"], tr.scaler.scale))
    params = tr.engine.parameters()
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, params))
    return rows, finite, unchanged


def _worker(ctx, cfgs, data_dir):
    return [_train(cfg, data_dir, steps, ctx.device) for cfg, steps in cfgs]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("mixed") / "cache")
    return cache, str(prepare(make_cfg(cache, {}, {}, "bf16").data))


_REFS: dict = {}


def _reference(cache, data_dir, model: dict, precision: str, init_scale: float, steps: int):
    key = (tuple(sorted(model)), precision, init_scale, steps)
    if key not in _REFS:
        _REFS[key] = reference(make_cfg(cache, {}, model, precision, init_scale), data_dir, steps)[0]
    return _REFS[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_precision_matches_single_process(layout, data_dir):
    cache, data = data_dir
    parallel, model = LAYOUTS[layout]
    low = layout.endswith("-low")
    runs = [(make_cfg(cache, parallel, model, "bf16", low=low), STEPS),
            (make_cfg(cache, parallel, model, "fp16", low=low), STEPS),
            (make_cfg(cache, parallel, model, "fp16", 1e30, low=low), OVERFLOW_STEPS)]
    torch.set_num_threads(1)
    out = run(_worker, 2, runs, data, timeout_s=180, threads=1)
    for precision, i in (("bf16", 0), ("fp16", 1)):
        ref = _reference(cache, data, model, precision, INIT_SCALE, STEPS)
        loss_tol, norm_tol = TOL[precision]
        for rank, per_rank in enumerate(out):
            rows, finite, _ = per_rank[i]
            assert finite, f"{layout} {precision} rank {rank}: non-finite parameters"
            loss_err = max(abs(a[0] - b[0]) for a, b in zip(rows, ref))
            norm_err = max(abs(a[1] - b[1]) / b[1] for a, b in zip(rows, ref))
            print(f"{layout} {precision} rank {rank}: max |loss diff| {loss_err:.2e}, "
                  f"max rel grad-norm diff {norm_err:.2e}")
            assert [r[2] for r in rows] == [r[2] for r in ref], f"{layout} {precision}: skipped steps differ"
            assert [r[3] for r in rows] == [r[3] for r in ref], f"{layout} {precision}: loss scales differ"
            assert loss_err <= loss_tol, f"{layout} {precision}: loss differs by {loss_err:.3e} > {loss_tol}"
            assert norm_err <= norm_tol, f"{layout} {precision}: grad norm differs by {norm_err:.3e} > {norm_tol}"
    ref = _reference(cache, data, model, "fp16", 1e30, OVERFLOW_STEPS)
    assert all(r[2] for r in ref)
    for rank, per_rank in enumerate(out):
        rows, finite, unchanged = per_rank[2]
        assert [r[2] for r in rows] == [True] * OVERFLOW_STEPS, f"{layout} rank {rank}: overflow not skipped"
        assert [r[3] for r in rows] == [r[3] for r in ref] == [1e30 * 0.5 ** (k + 1) for k in range(OVERFLOW_STEPS)]
        assert finite and unchanged, f"{layout} rank {rank}: parameters changed or non-finite after skipped steps"


def _measure(ctx, stages):
    from shardlab.analysis.measured_memory import _measure_worker
    out = []
    for stage in stages:
        cfg = make_cfg(".cache/shardlab", {"dp_shard": 2, "zero_stage": stage, "bucket_cap_mb": 0.05}, {}, "bf16", low=True)
        out.append(_measure_worker(ctx, cfg, 1)[0])
    return out


def test_low_precision_storage_is_the_mixed_formula():
    """ZeRO-1/2 with train.param_dtype = bf16 hold 2 (bf16 params) + 2 (bf16 grads, 1/N for ZeRO-2)
    + 12/N (fp32 master + Adam m, v) bytes per parameter: the ZeRO paper's mixed layout, within the
    padding of the flat buffers (2%). FSDP holds fp32 shards and fp32 gradient shards: 16/N in all.
    DDP with train.reduce_dtype = bf16: fp32 parameters (the master) 4 + bf16 buckets 2 + Adam 8."""
    from shardlab.analysis.measured_memory import formula
    from shardlab.models import count_params
    psi = count_params(build_model(make_cfg(".cache/shardlab", {}, {}, "bf16").model, 0))
    for rank, stages in enumerate(run(_measure, 2, [0, 1, 2, 3], threads=1, timeout_s=120)):
        for stage, (params, grads, optim) in zip([0, 1, 2, 3], stages):
            want = formula(psi, 2, stage, "mixed")
            if stage == 0:
                want = type(want)(4 * psi, 2 * psi, 8 * psi)
            if stage == 3:
                assert abs(params + grads + optim - want.total) <= 0.02 * want.total, (rank, stage)
                continue
            for what, got, exp in (("params", params, want.params), ("grads", grads, want.grads),
                                   ("optim", optim, want.optim)):
                assert abs(got - exp) <= 0.02 * exp, f"rank {rank} ZeRO-{stage} {what}: {got} vs {exp}"
