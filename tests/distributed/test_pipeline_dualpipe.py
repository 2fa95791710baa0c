"""DualPipeV (DeepSeek's V-shape pipeline) and the batched zero-bubble W, executed: float64 on
CPU gloo, loss, every gradient and the global gradient norm equal an independent
single-process computation (the plain model on the whole global batch) to <= 1e-10.
One spawn of 4 ranks: pp = 4 (8 layers cut into 8 stages) and pp = 2 x dp 2 (4 stages).
DualPipe (two parameter copies, tests at the end): a second spawn of 4 ranks, pp = 4 and pp = 2 x dp 2."""
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)
from tests.distributed.test_pipeline import ATOL, SEED, pipeline_step, reference, tiny_cfg


def _worker(ctx, cases):
    out = []
    for topo_kw, sched, m in cases:
        topo = Topology(**topo_kw)
        mesh = Mesh.build(topo)
        dp = topo.dp_shard
        cfg = tiny_cfg(8)
        p = cfg.parallel
        p.pp, p.dp_shard, p.pp_schedule, p.microbatches = topo.pp, dp, sched, m
        cfg.train.global_batch = m * dp
        cfg.validate(ctx.world_size)
        ref_loss, ref_grads, ref_norm = reference(cfg, cfg.train.global_batch)
        engine, loss, grads, norm = pipeline_step(mesh, cfg, dp, mesh.coords["dp_shard"])
        ev = engine.global_loss(engine.evaluate(list(zip(*(t.chunk(m) for t in _batch(cfg, dp, mesh))))))
        out.append(dict(case=(topo.describe(), sched, m), pp=topo.pp, pp_rank=mesh.local_rank("pp"),
                        stages=sorted(engine.chunks), names=sorted(grads),
                        loss_err=abs(loss - ref_loss), eval_err=abs(ev - ref_loss),
                        grad_err=max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
                        norm_err=abs(norm - ref_norm), held=engine.wgrad_peak_bytes,
                        timeline=sorted((a.kind, a.mb, a.stage) for tl in engine.gather_timeline() for a, _, _ in tl)))
    return out


def _batch(cfg, dp, mesh):
    from tests.distributed.test_pipeline import batch
    x, y = batch(cfg, cfg.train.global_batch)
    per, d = cfg.train.global_batch // dp, mesh.coords["dp_shard"]
    return x[d * per:(d + 1) * per], y[d * per:(d + 1) * per]


def test_dualpipev_and_batched_w_parity():
    cases = [(dict(pp=4), "dualpipev", 8), (dict(pp=4), "zb-h1", 4),
             (dict(pp=2, dp_shard=2), "dualpipev", 4), (dict(pp=2, dp_shard=2), "dualpipev", 6)]
    results = run(_worker, 4, cases, timeout_s=240)
    all_names = set(build_model(tiny_cfg(8).model, SEED).state_dict())
    by_case = {}
    for rank_results in results:
        for r in rank_results:
            assert r["loss_err"] <= ATOL and r["grad_err"] <= ATOL and r["norm_err"] <= ATOL, r
            assert r["eval_err"] <= ATOL, r
            assert r["held"] > 0, r  # the deferred W's inputs and output gradients were held
            by_case.setdefault(r["case"], set()).update(r["names"])
            _, sched, m = r["case"]
            pp, pr = r["pp"], r["pp_rank"]
            n_stages = 2 * pp if sched == "dualpipev" else pp
            # F, B and W of every micro-batch at every stage exactly once (gathered over pp)
            assert r["timeline"] == sorted((k, j, s) for k in "FBW" for j in range(m) for s in range(n_stages)), r
            if sched == "dualpipev":  # the V: rank r holds stages r and 2pp-1-r
                assert r["stages"] == [pr, 2 * pp - 1 - pr], r
    assert len(by_case) == 4 and all(names == all_names for names in by_case.values())


def _dual_worker(ctx, cases):
    import torch
    out = []
    for topo_kw, m in cases:
        topo = Topology(**topo_kw)
        mesh = Mesh.build(topo)
        dp = topo.dp_shard
        cfg = tiny_cfg(8)
        p = cfg.parallel
        p.pp, p.dp_shard, p.pp_schedule, p.microbatches = topo.pp, dp, "dualpipe", m
        cfg.train.global_batch = m * dp
        cfg.validate(ctx.world_size)
        ref_loss, ref_grads, ref_norm = reference(cfg, cfg.train.global_batch)
        engine, loss, grads, norm = pipeline_step(mesh, cfg, dp, mesh.coords["dp_shard"])
        ev = engine.global_loss(engine.evaluate(list(zip(*(t.chunk(m) for t in _batch(cfg, dp, mesh))))))
        init = engine.full_state(None, everywhere=True)  # each global parameter once
        opt = torch.optim.SGD(engine.parameters(), lr=0.5)
        engine.clip_grads(0.1)
        opt.step()
        after = {n: q.detach().clone() for n, q in engine.named_parameters()}
        engine.load_full_state(init, None)  # loading fills both copies
        reload_err = max((q - init[f"model.{n}"]).abs().max().item() for n, q in engine.named_parameters())
        out.append(dict(case=(topo.describe(), m), pp=topo.pp, pp_rank=mesh.local_rank("pp"),
                        dp_rank=mesh.coords["dp_shard"], stages=sorted(engine.chunks), names=sorted(grads),
                        loss_err=abs(loss - ref_loss), eval_err=abs(ev - ref_loss),
                        grad_err=max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
                        norm_err=abs(norm - ref_norm), init_names=sorted(init),
                        after=after, reload_err=reload_err,
                        timeline=sorted((a.kind, a.mb, a.stage) for tl in engine.gather_timeline() for a, _, _ in tl)))
    return out


def test_dualpipe_two_copies_parity():
    """DualPipe (bidirectional, rank r holds parts r and pp-1-r): loss, evaluation, every gradient
    (each copy holds the sum of both directions) and the norm (each element once) equal the
    reference; full_state has each parameter once; after clipping and a step both copies are
    bit-equal; loading the saved state restores both copies."""
    import torch
    cases = [(dict(pp=4), 8), (dict(pp=2, dp_shard=2), 4)]
    results = run(_dual_worker, 4, cases, timeout_s=240)
    all_names = set(build_model(tiny_cfg(8).model, SEED).state_dict())
    by_case, after = {}, {}
    for rank_results in results:
        for r in rank_results:
            assert r["loss_err"] <= ATOL and r["grad_err"] <= ATOL and r["norm_err"] <= ATOL, r
            assert r["eval_err"] <= ATOL and r["reload_err"] == 0, r
            assert set(r["init_names"]) == {f"model.{n}" for n in all_names}, r["init_names"]
            pp, pr, m = r["pp"], r["pp_rank"], r["case"][1]
            assert r["stages"] == sorted([pr, 2 * pp - 1 - pr]), r  # part pr down, part pp-1-pr up
            by_case.setdefault(r["case"], set()).update(r["names"])
            # every micro-batch runs F, B, W on its direction's stage ids only (gathered over pp)
            want = [(k, j, s) for k in "FBW" for j in range(m)
                    for s in (range(pp) if j < m // 2 else range(pp, 2 * pp))]
            assert r["timeline"] == sorted(want), r["case"]
            for n, t in r["after"].items():
                after.setdefault((r["case"], 4 // pp, n), []).append(t)
    assert len(by_case) == 2 and all(names == all_names for names in by_case.values())
    for key, copies in after.items():  # two pp copies x dp replicas: bit-equal after the step
        assert len(copies) == 2 * key[1], key
        assert all(torch.equal(copies[0], c) for c in copies[1:]), key
