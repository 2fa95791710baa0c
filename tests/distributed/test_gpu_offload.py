"""FSDP CPU offload on a GPU run (``make test-gpu``; skipped without CUDA): the shards live in
pinned host memory, are copied to the device without blocking, and training equals the same run
without offload (float64, one rank on the GPU)."""
import pytest
import torch

from shardlab.config import Config
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallelize import parallelize
from shardlab.train.optim import build_adamw

STEPS = 3


def _cfg(offload: bool) -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers = 64, 32, 2
    cfg.model.n_heads, cfg.model.max_seq_len = 4, 16
    cfg.train.global_batch, cfg.train.seq_len, cfg.train.lr, cfg.train.precision = 4, 16, 1e-2, "fp64"
    cfg.parallel.zero_stage, cfg.parallel.offload = 3, offload
    return cfg


def _worker(ctx, offload):
    cfg = _cfg(offload)
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    engine = parallelize(build_model(cfg.model, 0, dtype=torch.float64), mesh, cfg)
    opt = engine.make_optimizer(build_adamw(cfg.train, mesh.device))
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        t = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=g)
        losses.append(float(engine.forward_backward([(t[:, :-1].to(mesh.device), t[:, 1:].to(mesh.device))])))
        opt.step()
        opt.zero_grad(set_to_none=False)
    homes = {f.shard.device.type for f in engine.flats}
    pinned = all(f.shard.is_pinned() for f in engine.flats)
    state = {k: v.detach().cpu() for k, v in engine.full_state(opt, everywhere=True).items()}
    return losses, state, homes, pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp_offload_on_cuda_is_pinned_and_equals_no_offload():
    (l_off, s_off, homes, pinned), = run(_worker, 1, True, device="cuda", timeout_s=120)
    (l_dev, s_dev, _, _), = run(_worker, 1, False, device="cuda", timeout_s=120)
    assert homes == {"cpu"} and pinned
    assert max(abs(a - b) for a, b in zip(l_off, l_dev)) <= 1e-10
    for k, v in s_dev.items():
        assert (s_off[k].to(v.dtype) - v).abs().max() <= 1e-10, k
