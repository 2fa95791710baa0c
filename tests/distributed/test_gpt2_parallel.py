"""GPT-2 under every parallelism: losses and parameters after 2 AdamW steps equal an independent
single-process run (analysis/verify.reference: the plain model, torch AdamW) to 1e-10 in float64;
and, under tensor + sequence parallel, every gradient (the replicated row-parallel biases, the
LayerNorms, the split column biases, the position embedding seen S/tp rows per rank) equals the
single-process gradient."""
import pytest
import torch

from shardlab import launch
from shardlab.analysis import verify
from shardlab.config import Config, ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.placement import get_placement
from shardlab.distributed.topology import Topology
from shardlab.models import build_model, meta_model
from shardlab.parallelize import parallelize
from shardlab.train.data import prepare
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

TOL = 1e-10
STEPS = 2
TINY = {"model": {"max_seq_len": 16}, "train": {"seq_len": 16}}   # d 32, 4 layers, 4 heads, V 256 (verify.BASE)
LAYOUTS = {2: ["tp2", "tp2-sp", "pp2-1f1b", "cp2", "fsdp", "dp", "zero2"],
           4: ["tp2-sp", "tp2-sp-pp2", "cp2-tp2"]}   # at 4 ranks: dp2 x tp2 sp, tp2 sp x pp2, cp2 x tp2


@pytest.fixture(scope="module")
def data_dir():
    return str(prepare(verify.layout_config("dp", 1, STEPS, "gpt2", TINY).data))


@pytest.mark.parametrize("nproc", [2, 4])
def test_gpt2_layouts_match_single_process(data_dir, nproc):
    rows = verify.run_layouts(LAYOUTS[nproc], nproc, data_dir, STEPS, {}, "gpt2", TINY)
    assert [r["layout"] for r in rows] == LAYOUTS[nproc]
    for r in rows:
        assert r["ok"] and r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r


def test_gpt2_math_attention_layouts_match_single_process(data_dir):
    """``model.attention = "math"`` (scores materialised; tests/unit/test_attention_kernel.py holds
    it equal to the fused kernel) under tensor + sequence parallel (a head shard per rank),
    Ulysses (all heads' shards gathered around the core) and a pipeline: each equals one process."""
    extra = {**TINY, "model": {**TINY["model"], "attention": "math"}}
    layouts = ["tp2-sp", "cp2-ulysses", "pp2-1f1b"]
    rows = verify.run_layouts(layouts, 2, data_dir, STEPS, {}, "gpt2", extra)
    assert [r["layout"] for r in rows] == layouts
    for r in rows:
        assert r["ok"] and r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r


def _grad_case(ctx, tie):
    cfg = Config()
    cfg.model = ModelConfig(arch="gpt2", vocab_size=67, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                            tie_embeddings=tie)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, True
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed = 12, 2, 5
    cfg.validate(2)
    g = torch.Generator().manual_seed(11)
    t = torch.randint(0, 67, (2, 13), generator=g)
    x, y, pos = t[:, :-1], t[:, 1:], torch.arange(3, 15)   # positions offset: rows 3..14 of wpe

    ref = build_model(cfg.model, 5, dtype=torch.float64)
    ref(x, y, positions=pos).backward()
    ref_p = dict(ref.named_parameters())

    mesh = Mesh.build(Topology(tp=2))
    engine = parallelize(meta_model(cfg.model, torch.float64), mesh, cfg)
    model = engine.model
    loss = model(x, y, positions=pos)
    loss.backward()
    errs, kinds = {}, {}
    for name, p in model.named_parameters():
        pl = get_placement(p, name)
        want = ref_p[pl.name].grad
        got = p.grad
        if pl.dim is not None:
            want, got = want.narrow(pl.dim, pl.start, pl.length), pl.valid(got)
        errs[pl.name] = float((got - want).abs().max())
        kinds[pl.name] = pl.dim
    return errs, kinds


@pytest.mark.parametrize("tie", [False, True])
def test_tp_sp_gradients_of_biases_norms_and_positions(tie):
    out = launch.run(_grad_case, 2, tie, timeout_s=120)
    for rank, (errs, kinds) in enumerate(out):
        for name, e in errs.items():
            assert e <= TOL, f"rank {rank}: {name} gradient error {e}"
        # what the plan did: row biases and position table replicated, column biases split
        assert kinds["layers.1.attn.c_proj.bias"] is None and kinds["layers.0.mlp.c_proj.bias"] is None
        assert kinds["wpe.weight"] is None and kinds["layers.0.ln_2.bias"] is None
        assert kinds["layers.0.attn.c_q.bias"] == 0 and kinds["layers.1.mlp.c_fc.bias"] == 0
        assert ("lm_head.weight" in errs) != tie
