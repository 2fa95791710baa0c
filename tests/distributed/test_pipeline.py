"""Pipeline parallel parity: float64 on CPU gloo, every schedule, m in {p, 2p}, pp = 2 and 4
(and pp x dp = 2 x 2): loss, every gradient and the global gradient norm equal an independent
single-process computation (the plain model on the whole global batch) to <= 1e-10."""
import copy

import pytest
import torch

from shardlab.config import Config
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models.llama import build_model
from shardlab.parallel.pipeline import apply

ATOL = 1e-10
SEED = 7


def tiny_cfg(n_layers: int) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len = 64, 32, n_layers, 4, 16
    cfg.train.seq_len = 16
    return cfg


def batch(cfg, n):
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, cfg.model.vocab_size, (n, cfg.train.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(cfg, n):
    model = build_model(cfg.model, SEED, dtype=torch.float64)
    x, y = batch(cfg, n)
    loss = model(x, y)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    return float(loss), grads, float(norm)


def pipeline_step(mesh, cfg, dp, dp_rank):
    """One step of the pipeline engine on this rank's share of the global batch."""
    model = build_model(cfg.model, SEED, dtype=torch.float64)
    engine = apply(model, mesh, cfg)
    m = cfg.parallel.microbatches
    per_dp = cfg.train.global_batch // dp
    x, y = batch(cfg, cfg.train.global_batch)
    x, y = x[dp_rank * per_dp:(dp_rank + 1) * per_dp], y[dp_rank * per_dp:(dp_rank + 1) * per_dp]
    mbs = list(zip(x.chunk(m), y.chunk(m)))
    local = engine.forward_backward(mbs)
    loss = engine.global_loss(local)
    norm = float(engine.grad_norm())
    grads = {n: p.grad.clone() for n, p in engine.named_parameters()}
    return engine, loss, grads, norm


def _worker(ctx, topo_list, combos, n_layers):
    out = []
    for topo_kw in topo_list:
        topo = Topology(**topo_kw)
        mesh = Mesh.build(topo)
        dp = topo.dp_replicate * topo.dp_shard
        for sched, m, v in combos:
            if m < topo.pp or (sched == "interleaved" and m % topo.pp):
                continue
            cfg = tiny_cfg(n_layers)
            p = cfg.parallel
            p.pp, p.dp_shard, p.pp_schedule, p.microbatches, p.pp_virtual = topo.pp, dp, sched, m, v
            cfg.train.global_batch = m * dp
            cfg.validate(ctx.world_size)
            ref_loss, ref_grads, ref_norm = reference(cfg, cfg.train.global_batch)
            engine, loss, grads, norm = pipeline_step(mesh, cfg, dp, mesh.coords["dp_shard"])
            err = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
            out.append(dict(topo=topo.describe(), sched=sched, m=m, v=v, names=sorted(grads),
                            loss_err=abs(loss - ref_loss), grad_err=err, norm_err=abs(norm - ref_norm),
                            sent=mesh.ledger.total_sent("pp", "send"),
                            timeline=len(engine.last_timeline)))
            mesh.ledger.reset()
    return out


SCHEDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def _check(results, n_layers):
    all_names = set(build_model(tiny_cfg(n_layers).model, SEED).state_dict())
    by_combo = {}
    for rank_results in results:
        for r in rank_results:
            assert r["loss_err"] <= ATOL, r
            assert r["grad_err"] <= ATOL, r
            assert r["norm_err"] <= ATOL, r
            by_combo.setdefault((r["topo"], r["sched"], r["m"]), set()).update(r["names"])
    for combo, names in by_combo.items():
        assert names == all_names, combo  # the stages together hold every parameter
    return by_combo


def test_pipeline_parity_pp2():
    combos = [(s, m, v) for s, v in SCHEDS for m in (2, 4)]
    results = run(_worker, 2, [dict(pp=2)], combos, 4, timeout_s=120)
    by_combo = _check(results, 4)
    assert len(by_combo) == 8
    # bytes: each micro-batch crosses each of the 2v - 1 stage boundaries once forward (activation)
    # and once backward (its gradient); nothing else goes over the pp group
    act = 1 * 16 * 32 * 8  # micro-batch x seq x d_model x float64
    for r0, r1 in zip(*results):
        assert r0["sent"] + r1["sent"] == act * r0["m"] * (2 * r0["v"] - 1) * 2, r0


def test_pipeline_parity_pp4_and_pp2_dp2():
    combos = [(s, m, v) for s, v in SCHEDS for m in (4, 8)]
    pp2dp2 = [("1f1b", 2, 1), ("zb-h1", 4, 1), ("interleaved", 4, 2)]
    results = run(_worker_two, 4, combos, pp2dp2, timeout_s=240)
    by_combo = _check(results, 8)
    assert len(by_combo) == 8 + 3


def _worker_two(ctx, combos, pp2dp2):
    return _worker(ctx, [dict(pp=4)], combos, 8) + _worker(ctx, [dict(pp=2, dp_shard=2)], pp2dp2, 8)


def test_schedule_refused_before_running():
    from shardlab.parallel.pipeline.schedule import ScheduleError
    cfg = tiny_cfg(4)
    cfg.parallel.pp, cfg.parallel.microbatches = 4, 2
    with pytest.raises(ScheduleError, match="microbatches=2 < pp=4"):
        apply(build_model(cfg.model, SEED), copy.copy(Mesh.single()), cfg)
