"""The CNN under DDP, ZeRO-1, ZeRO-2 and ZeRO-3/FSDP (wrap policies by class and by size) equals
one process on the whole batch (float64): losses, gradient norms, final parameters and Adam
states. The reference is plain torch: ``build_model`` + torch.optim.AdamW + clip_grad_norm_."""
from __future__ import annotations

import pytest
import torch

from shardlab.analysis.verify import plain_run
from shardlab.config import Config
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallelize import parallelize
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

ATOL = 1e-10
STEPS, GLOBAL_BATCH, MICRO = 3, 8, 2


def make_cfg(n: int, **parallel) -> Config:
    cfg = Config()
    cfg.model.arch, cfg.model.d_model, cfg.model.dropout, cfg.data.dataset = "cnn", 16, 0.0, "fashion-mnist"
    cfg.train.global_batch, cfg.train.lr, cfg.train.grad_clip, cfg.train.precision = GLOBAL_BATCH, 1e-2, 0.5, "fp64"
    cfg.parallel.microbatches = MICRO
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    cfg.parallel.dp_shard = n
    return cfg.validate(n)


def batches():
    g = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        yield (torch.randn(GLOBAL_BATCH, 1, 28, 28, generator=g, dtype=torch.float64),
               torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))


def reference(cfg: Config):
    """One process, the whole batch, plain torch: losses, norms, final params and Adam state."""
    return plain_run(cfg, batches())


def _variant(cfg: Config, ref) -> float:
    mesh = Mesh.build(Topology.from_config(cfg.parallel))
    engine = parallelize(build_model(cfg.model, cfg.train.seed, dtype=torch.float64), mesh, cfg)
    t = cfg.train
    opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps))
    dp, r = mesh.size("dp"), mesh.local_rank("dp")
    losses, norms = [], []
    for x, y in batches():
        per = x.shape[0] // dp
        xs, ys = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        local = engine.forward_backward(list(zip(xs.chunk(MICRO), ys.chunk(MICRO))))
        norms.append(engine.clip_grads(t.grad_clip))
        opt.step()
        opt.zero_grad()
        losses.append(engine.global_loss(local))
    ref_losses, ref_norms, ref_state = ref
    err = max(abs(a - b) for a, b in zip(losses + norms, ref_losses + ref_norms))
    state = engine.full_state(opt, everywhere=True)
    for k, v in ref_state.items():
        err = max(err, float((state[k].to(v.dtype) - v).abs().max()))
    return err


def _worker(ctx, n, variants, ref):
    return [_variant(make_cfg(n, **v), ref) for v in variants]


VARIANTS = [
    dict(zero_stage=0),
    dict(zero_stage=1, bucket_cap_mb=0.01),
    dict(zero_stage=2, bucket_cap_mb=0.01),
    dict(zero_stage=3, wrap_policy="class:Conv2d,Linear"),
    dict(zero_stage=3, wrap_policy="size:1000"),  # conv2 and fc1 are units; conv1 and fc2 stay in the root
    dict(zero_stage=3, wrap_policy="blocks"),     # every layer a unit: the root holds no parameter
]


@pytest.mark.parametrize("n,variants", [(2, VARIANTS), (4, [VARIANTS[0], VARIANTS[3]])])
def test_cnn_parity(n, variants):
    torch.set_num_threads(1)
    ref = reference(make_cfg(n))
    errs = run(_worker, n, n, variants, ref, timeout_s=120, threads=1)
    for rank_errs in errs:
        for v, e in zip(variants, rank_errs):
            assert e <= ATOL, f"N={n} {v}: max error {e:.3e}"
