"""DualPipe's F&B pairs run as lanes (parallel/pipeline/pairs.py, distributed/lanes.py): the
paired schedules stay deadlock-free and issue-order matched, and a step of an MoE model with
expert parallel inside the stages (pp = 2 x dp_shard = 2 x ep = 2, float64) equals the plain
model on the whole global batch and the same engine without the overlap, while each pair's
forward and backward ran interleaved (baton passed at the all-to-alls, spans overlapping)."""
import torch

from shardlab.config import Config
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel.pipeline.pairs import count_pairs, pair
from shardlab.parallel.pipeline.schedule import build
from shardlab.parallel.pipeline.simulate import simulate
from shardlab.parallel.pipeline.stage import check_p2p_order
from shardlab.parallelize import parallelize
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)
from tests.distributed.test_pipeline import ATOL, SEED, batch


def test_pairs_keep_the_schedule_valid():
    for name, p, m in [("dualpipe", 2, 4), ("dualpipe", 4, 8), ("dualpipe", 4, 16), ("dualpipev", 2, 4),
                       ("dualpipev", 4, 8)]:
        s = build(name, p, m)
        q = pair(s)
        assert simulate(q).ok and count_pairs(s) == [0] * p, (name, p, m)
        check_p2p_order(q)  # raises if a receive would match another message
        assert all(sorted(a) == sorted(b) for a, b in zip(s.ranks, q.ranks))  # the same actions, moved
        assert min(count_pairs(q)) >= m // 2 - 1, (name, p, m, count_pairs(q))  # DeepSeek's F&B steps


def _cfg(overlap: bool) -> Config:
    cfg = Config()
    m, p, t = cfg.model, cfg.parallel, cfg.train
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len = 64, 32, 4, 4, 16
    m.n_experts, m.moe_top_k, m.moe_capacity_factor, m.tie_embeddings = 4, 2, 0.0, False
    m.moe_aux_loss_coef = m.moe_z_loss_coef = 0.0
    p.pp, p.dp_shard, p.ep, p.pp_schedule, p.microbatches, p.pp_overlap = 2, 2, 2, "dualpipe", 4, overlap
    t.seq_len, t.global_batch, t.precision = 16, 8, "fp64"
    cfg.validate(4)
    return cfg


def _worker(ctx):
    mesh = Mesh.build(Topology(pp=2, dp_shard=2, ep=2))
    out = {}
    for overlap in (False, True):
        cfg = _cfg(overlap)
        engine = parallelize(build_model(cfg.model, SEED, dtype=torch.float64), mesh, cfg)
        x, y = batch(cfg, 8)
        d = mesh.coords["dp_shard"]
        x, y = x[4 * d:4 * d + 4], y[4 * d:4 * d + 4]
        loss = engine.global_loss(engine.forward_backward(list(zip(x.chunk(4), y.chunk(4)))))
        spans = {(a.kind, a.mb, a.stage): (t0, t1) for a, t0, t1 in engine.last_timeline}
        pairs = [(f, b, n, max(spans[("F", f.mb, f.stage)][0], spans[("B", b.mb, b.stage)][0])
                  < min(spans[("F", f.mb, f.stage)][1], spans[("B", b.mb, b.stage)][1]))
                 for f, b, n in engine.last_pairs]
        out[overlap] = dict(loss=loss, pairs=pairs,
                            grads={n: q.grad.clone() for n, q in engine.named_parameters()})
    return out


def test_dualpipe_pairs_overlap_and_equal_the_reference():
    cfg = _cfg(False)
    model = build_model(cfg.model, SEED, dtype=torch.float64)
    x, y = batch(cfg, 8)
    ref_loss = float(model(x, y).detach())
    for r in run(_worker, 4, timeout_s=240):
        assert not r[False]["pairs"] and len(r[True]["pairs"]) == 2, r[True]["pairs"]  # F0 B1, F1 B0
        for f, b, switches, overlapped in r[True]["pairs"]:
            assert (f.mb, f.stage) != (b.mb, b.stage) and switches >= 4 and overlapped, (f, b, switches)
        for ov in (False, True):
            assert abs(r[ov]["loss"] - ref_loss) <= ATOL, (ov, r[ov]["loss"], ref_loss)
        for n, g in r[True]["grads"].items():
            assert (g - r[False]["grads"][n]).abs().max().item() <= ATOL, n
