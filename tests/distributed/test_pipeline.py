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
from shardlab.models import build_model, get_spec
from shardlab.parallel.pipeline import apply
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

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
    return float(loss.detach()), grads, float(norm)


def pipeline_step(mesh, cfg, dp, dp_rank):
    """One step of the pipeline engine on this rank's share of the global batch."""
    model = build_model(cfg.model, SEED, dtype=torch.float64)
    engine = apply(model, mesh, cfg, get_spec(cfg.model))
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


def _worker(ctx, topo_list, combos, n_layers, split="balanced"):
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
            p.pp_split = split
            cfg.train.global_batch = m * dp
            cfg.validate(ctx.world_size)
            ref_loss, ref_grads, ref_norm = reference(cfg, cfg.train.global_batch)
            engine, loss, grads, norm = pipeline_step(mesh, cfg, dp, mesh.coords["dp_shard"])
            err = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
            out.append(dict(topo=topo.describe(), sched=sched, m=m, v=v, names=sorted(grads),
                            loss_err=abs(loss - ref_loss), grad_err=err, norm_err=abs(norm - ref_norm),
                            sent=mesh.ledger.total_sent("pp", "send"),
                            ranges=[(r.start, r.stop) for r in engine.ranges],
                            timeline=[len(tl) for tl in engine.gather_timeline()]))
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
            if "timeline" in r:  # F and B (and W) of every micro-batch at every stage, timed
                per_mb = 3 if r["sched"] == "zb-h1" else 2
                assert sum(r["timeline"]) == per_mb * r["m"] * len(r["timeline"]) * r["v"], r
    for combo, names in by_combo.items():
        assert names == all_names, combo  # the stages together hold every parameter
    return by_combo


def test_pipeline_parity_pp2():
    combos = [(s, m, v) for s, v in SCHEDS for m in (2, 4)]
    results = run(_worker_pp2, 2, combos, timeout_s=180)
    for ckpt in results[0][-1], results[1][-1]:
        assert ckpt["keys_missing"] == [] and ckpt["param_err"] <= ATOL and ckpt["reload_err"] == 0.0, ckpt
    results = [r[:-1] for r in results]
    by_combo = _check(results, 4)
    assert len(by_combo) == 8
    # bytes: each micro-batch crosses each of the 2v - 1 stage boundaries once forward (activation)
    # and once backward (its gradient); nothing else goes over the pp group
    act = 1 * 16 * 32 * 8  # micro-batch x seq x d_model x float64
    for r0, r1 in zip(*results):
        assert r0["sent"] + r1["sent"] == act * r0["m"] * (2 * r0["v"] - 1) * 2, r0


def _worker_pp2(ctx, combos):
    return _worker(ctx, [dict(pp=2)], combos, 4) + [_checkpoint_case()]


def _checkpoint_case():
    """AdamW step on pp=2 equals the reference step; full_state has every global tensor; it
    reloads into a fresh pp=2 engine and into a single-process model."""
    from shardlab.parallelize import Engine
    mesh = Mesh.build(Topology(pp=2))
    cfg = tiny_cfg(4)
    cfg.parallel.pp, cfg.parallel.microbatches, cfg.train.global_batch = 2, 2, 2
    make_opt = lambda groups: torch.optim.AdamW(groups, lr=1e-2)  # noqa: E731
    ref = Engine(build_model(cfg.model, SEED, dtype=torch.float64), Mesh.single(), cfg)
    ref_opt = ref.make_optimizer(make_opt)
    x, y = batch(cfg, 2)
    ref.model(x, y).backward()
    ref_opt.step()
    engine, _, _, _ = pipeline_step(mesh, cfg, 1, 0)
    opt = engine.make_optimizer(make_opt)
    opt.step()
    state = engine.full_state(opt, everywhere=True)
    want = ref.full_state(ref_opt)
    err = max((state[k] - want[k]).abs().max().item() for k in want if k in state)
    again = apply(build_model(cfg.model, SEED + 1, dtype=torch.float64), mesh, cfg, get_spec(cfg.model))
    opt2 = again.make_optimizer(make_opt)
    again.load_full_state(state, opt2)
    reload_err = max((p - state[f"model.{n}"]).abs().max().item() for n, p in again.named_parameters())
    single = Engine(build_model(cfg.model, SEED + 1, dtype=torch.float64), Mesh.single(), cfg)
    single.load_full_state(state, single.make_optimizer(make_opt))
    reload_err = max(reload_err, max((p - state[f"model.{n}"]).abs().max().item()
                                     for n, p in single.named_parameters()))
    return dict(keys_missing=sorted(set(want) ^ set(state)), param_err=err, reload_err=reload_err)


def test_pipeline_parity_pp4_and_pp2_dp2():
    combos = [(s, m, v) for s, v in SCHEDS for m in (4, 8)]
    pp2dp2 = [("1f1b", 2, 1), ("zb-h1", 4, 1), ("interleaved", 4, 2)]
    results = run(_worker_two, 4, combos, pp2dp2, timeout_s=240)
    cp = [[r for r in rank if r["topo"] == "pp2cp2"] for rank in results]
    for r in sum(cp, []):  # pp x cp (ring attention) = 2 x 2
        assert r["loss_err"] <= ATOL and r["grad_err"] <= ATOL and r["norm_err"] <= ATOL, r
    by_combo = _check([[r for r in rank if r["topo"] != "pp2cp2"] for rank in results], 8)
    assert len(by_combo) == 8 + 3 and len(cp[0]) == 2


def _worker_two(ctx, combos, pp2dp2):
    cp = _worker_3d(ctx, [("1f1b", 2, 1, False), ("zb-h1", 2, 1, False)], dict(pp=2, cp=2))
    return (_worker(ctx, [dict(pp=4)], combos, 8) + _worker(ctx, [dict(pp=2, dp_shard=2)], pp2dp2, 8)
            + [dict(r, topo="pp2cp2") for r in cp])


def test_pipeline_parity_ends_split():
    """Llama 3's split (parallel.pp_split = ends): the first stage holds only the embedding, the
    last only the norm, head and loss; loss and every gradient equal the single process's, the
    stages together hold every parameter, and the extra boundaries carry their activations."""
    pp2 = [("interleaved", 2, 2), ("interleaved", 4, 2)]
    pp4 = [("1f1b", 4, 1), ("zb-h1", 8, 1), ("interleaved", 4, 2)]
    results = run(_worker_ends, 4, pp2, pp4, timeout_s=240)
    by_combo = _check(results, 8)
    assert len(by_combo) == 5
    for r in results[0]:  # the ends hold no layer; the 8 layers fill the stages between
        stages = r["ranges"]
        assert stages[0] == (0, 0) and stages[-1] == (8, 8), r
        assert [a for a, _ in stages[1:-1]] == [0] + [b for _, b in stages[1:-2]] and stages[-2][1] == 8, r
    # bytes: every micro-batch crosses each of the pp*v - 1 boundaries once each way (the ends'
    # boundaries included), in each of the data-parallel replicas
    act = 1 * 16 * 32 * 8  # micro-batch x seq x d_model x float64, as test_pipeline_parity_pp2
    sent = {}
    for rank in results:
        for r in rank:
            sent[(r["topo"], r["sched"], r["m"], r["v"])] = sent.get((r["topo"], r["sched"], r["m"], r["v"]), 0) + r["sent"]
    for (topo, sched, m, v), total in sent.items():
        pp, replicas = (2, 2) if "dp_shard=2" in topo else (4, 1)
        assert total == act * m * (pp * v - 1) * 2 * replicas, (topo, sched, m, total)


def _worker_ends(ctx, pp2, pp4):
    """pp 2 x dp 2 (interleaved: 4 stages, 2 of them the ends) and pp 4 on the same 4 ranks."""
    return (_worker(ctx, [dict(pp=2, dp_shard=2)], pp2, 8, split="ends")
            + _worker(ctx, [dict(pp=4)], pp4, 8, split="ends"))


def test_ends_split_refused_where_it_cannot_cut():
    from shardlab.errors import ConfigError
    cfg = tiny_cfg(4)
    cfg.parallel.pp, cfg.parallel.microbatches, cfg.parallel.pp_split = 2, 2, "ends"
    with pytest.raises(ConfigError, match="pp_split.*pp\\*pp_virtual >= 3"):
        cfg.validate(2)
    cfg = tiny_cfg(1)
    cfg.parallel.pp, cfg.parallel.microbatches, cfg.parallel.pp_split = 4, 4, "ends"
    with pytest.raises(ConfigError, match="1 layers cannot fill the 2 stages between the ends"):
        cfg.validate(4)
    cfg = tiny_cfg(4)
    cfg.parallel.pp_split = "ends"
    with pytest.raises(ConfigError, match="use it with pp > 1"):
        cfg.validate(1)


def test_schedule_refused_before_running():
    from shardlab.parallel.pipeline.schedule import ScheduleError
    cfg = tiny_cfg(4)
    cfg.parallel.pp, cfg.parallel.microbatches = 4, 2
    with pytest.raises(ScheduleError, match="microbatches=2 < pp=4"):
        apply(build_model(cfg.model, SEED), copy.copy(Mesh.single()), cfg, get_spec(cfg.model))


# -- 3D: pp x tp x dp = 2 x 2 x 2 through parallelize() (TP first, then PP, dp on top) ---------------

def _worker_3d(ctx, combos, topo_kw=None):
    """pp composed with tp / cp / dp through parallelize(); sharded grads compared by placement."""
    from shardlab.distributed.placement import get_placement
    from shardlab.parallelize import parallelize
    topo = Topology(**(topo_kw or dict(pp=2, tp=2, dp_replicate=2)))
    mesh = Mesh.build(topo)
    dp = topo.dp_replicate
    out = []
    for sched, m, v, sp in combos:
        cfg = tiny_cfg(4)
        cfg.model.vocab_size = 67  # not divisible by tp: padded vocab shards
        p = cfg.parallel
        p.pp, p.tp, p.cp, p.dp_replicate, p.pp_schedule, p.microbatches, p.pp_virtual = \
            topo.pp, topo.tp, topo.cp, dp, sched, m, v
        p.sequence_parallel = sp
        cfg.train.global_batch = dp * m
        cfg.validate(ctx.world_size)
        ref_loss, ref_grads, ref_norm = reference(cfg, cfg.train.global_batch)
        engine = parallelize(build_model(cfg.model, SEED, dtype=torch.float64), mesh, cfg)
        d = mesh.coords["dp_replicate"]
        x, y = batch(cfg, cfg.train.global_batch)
        x, y = x[d * m:(d + 1) * m], y[d * m:(d + 1) * m]
        mbs = list(zip(x.chunk(m), y.chunk(m)))  # full sequences: the engine keeps this rank's cp shard
        loss = engine.global_loss(engine.forward_backward(mbs))
        err, names = 0.0, set()
        for name, prm in engine.named_parameters():
            pl = get_placement(prm, name)
            want = ref_grads[pl.name]
            if pl.dim is not None:
                want = want.narrow(pl.dim, pl.start, pl.length)
            err = max(err, (pl.valid(prm.grad) - want).abs().max().item())
            names.add(pl.name)
        out.append(dict(topo="3d", sched=sched, m=m, v=v, sp=sp, names=sorted(names), loss_err=abs(loss - ref_loss),
                        grad_err=err, norm_err=abs(float(engine.grad_norm()) - ref_norm)))
    return out


def test_pipeline_tensor_data_3d():
    combos = [("1f1b", 2, 1, False), ("zb-h1", 4, 1, True), ("interleaved", 2, 2, False)]
    results = run(_worker_3d, 8, combos, timeout_s=300)
    cfg = tiny_cfg(4)
    cfg.model.vocab_size = 67
    all_names = set(build_model(cfg.model, SEED).state_dict())
    by_combo = {}
    for rank_results in results:
        for r in rank_results:
            assert r["loss_err"] <= ATOL and r["grad_err"] <= ATOL and r["norm_err"] <= ATOL, r
            by_combo.setdefault((r["sched"], r["m"]), set()).update(r["names"])
    assert len(by_combo) == 3 and all(names == all_names for names in by_combo.values())
