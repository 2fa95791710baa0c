"""``parallel.compile``: every block and, without tensor parallel, the loss module compiled in
place (``compile_scope = "blocks"``), or at one rank the whole model as one graph (``auto``);
either compiled step equals the eager one (fp32, one process)."""
from __future__ import annotations

import pytest
import torch

from shardlab import launch
from shardlab.config import from_dict
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.models import build_model, get_spec
from shardlab.parallelize import parallelize

CFG = {"model": {"vocab_size": 512, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16},
       "train": {"seq_len": 16, "global_batch": 2}}


def _worker(ctx):
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0)).to(ctx.device)
    out = {}
    for compiled, scope in ((False, "auto"), (True, "blocks"), (True, "auto")):
        cfg = from_dict({**CFG, "parallel": {"compile": compiled, "compile_scope": scope}})
        mesh = Mesh.build(Topology(), ctx.device)
        engine = parallelize(build_model(cfg.model, seed=1, device=ctx.device), mesh, cfg)
        model = engine.model
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        flags = [getattr(m, "_compiled_call_impl", None) is not None
                 for m in [model, model.criterion, *get_spec(cfg.model).blocks(model).values()]]
        out[compiled, scope] = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}, flags)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_compile_wraps_blocks_and_loss_and_equals_eager(device):
    out = launch.run(_worker, 1, device=device, timeout_s=300)[0]
    (l0, g0, f0), (l1, g1, f1), (l2, g2, f2) = out[False, "auto"], out[True, "blocks"], out[True, "auto"]
    assert not any(f0)                                   # eager: nothing compiled
    assert f1 == [False] + [True] * (len(f1) - 1)        # blocks: the loss and every block
    assert f2 == [True] + [False] * (len(f2) - 1)        # auto at one rank: the whole model, one graph
    for loss, grads in ((l1, g1), (l2, g2)):
        assert abs(l0.item() - loss.item()) <= 1e-5 * abs(l0.item())
        for name, g in g0.items():
            assert (g - grads[name]).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), name


def test_compile_scope_model_needs_one_rank(tmp_path):
    """``compile_scope = "model"`` where a parallel module hooks into the blocks: one line, exit 2."""
    import subprocess
    import sys
    cfg = tmp_path / "c.toml"
    cfg.write_text("[parallel]\ncompile = true\ncompile_scope = \"model\"\ndp_shard = 2\nzero_stage = 3\n")
    r = subprocess.run([sys.executable, "-m", "shardlab.cli", "config", "show", str(cfg), "--nproc", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "parallel.compile_scope" in r.stderr and "Traceback" not in r.stderr


def test_vocab_parallel_loss_stays_eager():
    """Under tensor parallel the criterion is the vocabulary-parallel one (collectives inside):
    ``parallel.compile`` leaves it eager."""
    from types import SimpleNamespace

    from shardlab.parallelize import _compile_loss
    model = torch.nn.Module()
    model.criterion = torch.nn.CrossEntropyLoss()
    _compile_loss(model, SimpleNamespace(tp=2))
    assert getattr(model.criterion, "_compiled_call_impl", None) is None
    _compile_loss(model, SimpleNamespace(tp=1))
    assert model.criterion._compiled_call_impl is not None


def _collectives_worker(ctx, cfg, batches):
    from shardlab.train.optim import build_adamw
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    engine = parallelize(build_model(cfg.model, cfg.train.seed, dtype=torch.float64), mesh, cfg)
    opt = engine.make_optimizer(build_adamw(cfg.train, mesh.device))
    losses, per = [], cfg.train.global_batch // mesh.size("dp")
    for x, y in batches:
        r = mesh.local_rank("dp")
        local = engine.forward_backward([(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])])
        engine.clip_grads(cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(engine.global_loss(local))
    compiled = [getattr(b, "_compiled_call_impl", None) is not None for b in get_spec(cfg.model).blocks(engine.model).values()]
    return losses, engine.full_state(opt, everywhere=True), compiled


MOE = dict(n_experts=4, moe_top_k=2, moe_capacity_factor=0.0, ffn_hidden=96)  # dropless: one process's routing


@pytest.mark.parametrize("parallel,model", [(dict(dp_shard=2, zero_stage=3), {}), (dict(cp=2, cp_impl="ulysses"), {}),
                                            (dict(dp_shard=2, ep=2), MOE)], ids=["zero3", "ulysses", "ep2"])
def test_compiled_blocks_with_collectives_inside_equal_one_process(parallel, model):
    """``parallel.compile`` (each block's call compiled) where communication runs inside the block's
    call: ZeRO-3's gather / free hooks, Ulysses' and expert parallel's all-to-alls (dropless MoE).
    N = 2 against plain torch on one process (float64, 3 AdamW steps). Before 2026-12-07 dynamo
    traced into the shared-memory transport and failed where a message grew its arena (messages
    over 64 KiB, as configs/tiny.toml's), and ZeRO-3's hooks recompiled per block index."""
    from shardlab.analysis.verify import plain_run
    from shardlab.config import Config
    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.max_seq_len = 256, 128, 2, 4, 64
    cfg.train.global_batch, cfg.train.seq_len, cfg.train.lr, cfg.train.grad_clip = 4, 64, 1e-2, 0.5
    cfg.train.precision = "fp64"
    cfg.parallel.compile = True
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    for k, v in model.items():
        setattr(cfg.model, k, v)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 256, (4, 65), generator=g) for _ in range(3)]
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    ref_losses, _, ref_state = plain_run(cfg, batches)
    for losses, state, compiled in launch.run(_collectives_worker, 2, cfg, batches, timeout_s=600, threads=1):
        assert compiled == [True, True]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-10, (losses, ref_losses)
        for k, v in ref_state.items():
            assert (state[k].to(v.dtype) - v).abs().max().item() <= 1e-10, k
