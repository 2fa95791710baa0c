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
