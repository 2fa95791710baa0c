"""Parity of DDP, ZeRO-1, ZeRO-2 and ZeRO-3/FSDP with one process on the whole batch (float64).

One spawn per world size runs every variant; each variant trains a few AdamW steps with
gradient accumulation and clipping, and its losses, gradient norms and final parameters and
optimizer states (gathered in global coordinates) are compared with an independent
single-process computation: the plain ``build_model`` model on the whole global batch.
"""
from __future__ import annotations

import pytest
import torch

from shardlab.analysis.verify import plain_run
from shardlab.config import Config
from shardlab.distributed.ledger import ring_bytes
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallelize import parallelize

ATOL = 1e-10
STEPS, GLOBAL_BATCH, SEQ, MICRO = 3, 12, 16, 2  # 12 sequences: divisible by N*micro for N=1,2,3


def make_cfg(n: int, **parallel) -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers = 64, 32, 2
    cfg.model.n_heads, cfg.model.max_seq_len = 4, SEQ
    cfg.train.global_batch, cfg.train.seq_len, cfg.train.lr = GLOBAL_BATCH, SEQ, 1e-2
    cfg.train.grad_clip, cfg.train.precision = 0.5, "fp64"  # the clip is active: checks grad_norm
    parallel.setdefault("microbatches", MICRO)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    if cfg.parallel.dp_replicate == 1:
        cfg.parallel.dp_shard = n
    return cfg


def batches(cfg: Config):
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        tok = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, SEQ + 1), generator=g)
        yield tok[:, :-1], tok[:, 1:]


def adamw(cfg):
    t = cfg.train
    return lambda groups: torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def reference(cfg: Config):
    """One process, the whole batch, plain torch: losses, norms, final params and Adam state."""
    return plain_run(cfg, batches(cfg))


def train(ctx, cfg: Config):
    mesh = Mesh.build(Topology.from_config(cfg.parallel), transport=cfg.parallel.comm_transport)
    model = build_model(cfg.model, cfg.train.seed, dtype=torch.float64)
    engine = parallelize(model, mesh, cfg)
    opt = engine.make_optimizer(adamw(cfg))
    dp, r = mesh.size("dp"), mesh.local_rank("dp")
    losses, norms = [], []
    for x, y in batches(cfg):
        per = x.shape[0] // dp
        xs, ys = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        m = cfg.parallel.microbatches
        micro = list(zip(xs.chunk(m), ys.chunk(m)))
        snap = mesh.ledger.snapshot()
        local = engine.forward_backward(micro)
        norms.append(engine.clip_grads(cfg.train.grad_clip))
        opt.step()
        opt.zero_grad()
        moved = {k: e for k, e in mesh.ledger.since(snap).items() if k[1] != "world"}
        assert all(e.source == "modelled" for e in moved.values()), moved  # backend: ring model
        step_bytes = sum(e.bytes_sent for e in moved.values())
        losses.append(engine.global_loss(local))
    assert step_bytes == modelled_ring_bytes(engine, cfg, mesh), (step_bytes, modelled_ring_bytes(engine, cfg, mesh))
    if cfg.parallel.zero_stage in (1, 2) and len(engine.flats) > 3:  # reduce-scatters in flight at once:
        # ZeRO-1 keeps two (gloo copies each at the call), ZeRO-2 one staging bucket
        assert engine.peak_in_flight == 3 - cfg.parallel.zero_stage, (cfg.parallel.zero_stage, engine.peak_in_flight)
    return engine, opt, losses, norms


def modelled_ring_bytes(engine, cfg, mesh) -> int:
    """What one step must send per rank (ring model, float64), from the engine's buffer sizes:
    DDP all-reduces every bucket once; ZeRO-1 reduce-scatters once, ZeRO-2 once per micro-batch,
    both all-gather once; ZeRO-3 all-gathers every unit in forward, the non-root units again in
    backward when resharding, reduce-scatters every unit, per micro-batch (+ hybrid all-reduce)."""
    p, m = cfg.parallel, cfg.parallel.microbatches
    if p.zero_stage == 0:
        n = mesh.size("dp_cp")
        return sum(ring_bytes("all_reduce", b.flat.numel() * 8, n) for b in engine.ddp.buckets) if n > 1 else 0
    n = engine.comm.size
    rs = lambda f: ring_bytes("reduce_scatter", f.padded * 8, n)
    ag = lambda f: ring_bytes("all_gather", f.padded * 8, n)
    if p.zero_stage in (1, 2):
        return sum(rs(f) * (m if p.zero_stage == 2 else 1) + ag(f) for f in engine.flats)
    root = set(map(id, engine.units[0].flats))
    per_micro = sum(ag(f) + rs(f) + (ag(f) if p.reshard_after_forward and id(f) not in root else 0)
                    for f in engine.flats)
    rep = mesh.size("dp_replicate")
    return m * per_micro + sum(ring_bytes("all_reduce", f.shard_size * 8, rep) for f in engine.flats)


def _compare(ctx, cfg, ref, reload_cfg=None):
    engine, opt, losses, norms = train(ctx, cfg)
    ref_losses, ref_norms, ref_state = ref
    state = engine.full_state(opt, everywhere=True)
    err = max(abs(a - b) for a, b in zip(losses + norms, ref_losses + ref_norms))
    for k, v in ref_state.items():
        err = max(err, float((state[k].to(v.dtype) - v).abs().max()))
    if reload_cfg is not None:  # checkpoints are global: load into another stage and read back
        mesh = Mesh.build(Topology.from_config(reload_cfg.parallel))
        other = parallelize(build_model(reload_cfg.model, 99, dtype=torch.float64), mesh, reload_cfg)
        other_opt = other.make_optimizer(adamw(reload_cfg))
        other.load_full_state(state, other_opt)
        back = other.full_state(other_opt, everywhere=True)
        for k, v in ref_state.items():
            err = max(err, float((back[k].to(v.dtype) - v).abs().max()))
    return err


VARIANTS = [
    dict(zero_stage=0),
    dict(zero_stage=0, overlap_comm=False, bucket_cap_mb=0.001),
    dict(zero_stage=1, bucket_cap_mb=0.01),
    dict(zero_stage=2, bucket_cap_mb=0.01),
    dict(zero_stage=3),
    dict(zero_stage=3, prefetch=False),
    dict(zero_stage=3, reshard_after_forward=False),
    dict(zero_stage=3, offload=True, prefetch=False, reshard_after_forward=False),
]
GLOO = [  # asynchronous collectives (gloo's own thread): the stages' buffers dropped while in flight
    dict(zero_stage=1, bucket_cap_mb=0.01, comm_transport="process_group"),
    dict(zero_stage=2, bucket_cap_mb=0.01, comm_transport="process_group"),
    dict(zero_stage=3, comm_transport="process_group"),
]


def _torch_style(ctx, n, ref):
    """A torch DDP training script with only the import changed: plain loop, no Engine."""
    from shardlab.parallel import DistributedDataParallel

    cfg = make_cfg(n)
    model = DistributedDataParallel(build_model(cfg.model, cfg.train.seed, dtype=torch.float64),
                                    device_ids=None, bucket_cap_mb=0.01)
    named = list(model.module.named_parameters())
    opt = adamw(cfg)([{"params": [p for k, p in named if p.ndim >= 2 and "norm" not in k],
                       "weight_decay": cfg.train.weight_decay},
                      {"params": [p for k, p in named if p.ndim < 2 or "norm" in k], "weight_decay": 0.0}])
    per = cfg.train.global_batch // n
    for x, y in batches(cfg):
        x, y = x[ctx.rank * per:(ctx.rank + 1) * per], y[ctx.rank * per:(ctx.rank + 1) * per]
        with model.no_sync():  # first half accumulates locally, second half synchronises
            (model(x[:per // 2], y[:per // 2]) / 2).backward()
        (model(x[per // 2:], y[per // 2:]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    # every bucket's all-reduce was launched from a gradient hook as soon as the bucket was
    # complete, while backward went on (none waited for the end-of-backward callback)
    assert len(model.buckets) > 2 and model.overlapped == STEPS * len(model.buckets), model.overlapped
    err = 0.0
    for k, p in named:
        err = max(err, float((p.detach() - ref[2][f"model.{k}"]).abs().max()))
    return err


def _worker(ctx, n, variants, refs):
    if n == 2:
        assert _torch_style(ctx, n, refs[0]) <= ATOL
    # each variant's checkpoint is also loaded into the next variant's engine (other stage)
    return [_compare(ctx, make_cfg(n, **v), refs[i], make_cfg(n, **variants[(i + 1) % len(variants)]))
            for i, v in enumerate(variants)]


def _run(n, variants):
    # One thread per process: on 2 shared cores, more threads spin in OpenMP and run 50x slower.
    torch.set_num_threads(1)
    ref = reference(make_cfg(n))  # the same for every variant: one process, whole batch
    refs = [ref] * len(variants)
    return run(_worker, n, n, variants, refs, timeout_s=120, threads=1)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parity_all_stages(n):
    variants = VARIANTS
    if n == 4:  # 12 sequences = 4 ranks x 3 micro-batches; plus hybrid sharding 2 x 2
        variants = [dict(v, microbatches=3) for v in VARIANTS]
        variants.append(dict(zero_stage=3, dp_replicate=2, dp_shard=2, microbatches=3))
    if n == 2:  # and ZeRO-3 under full recomputation: a checkpointed block recomputes its forward
        # without the engine's hooks, from the views its forward left (tests the re-attach in backward)
        variants = VARIANTS + GLOO + [dict(zero_stage=3, activation_checkpointing="full")]
    errs = _run(n, variants)
    for rank_errs in errs:
        for v, e in zip(variants, rank_errs):
            assert e <= ATOL, f"N={n} {v}: max error {e:.3e}"
