"""Pipeline x ZeRO/FSDP (stage-local sharding) and pipeline x MoE (aux losses of every stage):
float64 on CPU gloo at N = 4, through ``parallelize`` from a meta model. Loss, every gradient
element and the global gradient norm equal an independent single-process computation (plain
model, plain torch autograd and AdamW) to <= 1e-10."""
import torch

from shardlab.config import Config
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.placement import get_placement
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models.spec import init_weights, meta_model
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

ATOL = 1e-10
SEED = 7


def tiny_cfg(moe: bool = False) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len, m.tie_embeddings = 64, 32, 4, 4, 16, False
    if moe:  # large aux weights: a lost or mis-scaled aux term would show far above 1e-10
        m.n_experts, m.moe_top_k, m.moe_capacity_factor, m.moe_aux_loss_coef, m.moe_z_loss_coef = 4, 2, 0.0, 0.5, 0.1
    cfg.train.seq_len, cfg.train.seed, cfg.train.precision, cfg.train.weight_decay = 16, SEED, "fp64", 0.0
    return cfg


def batch(cfg, n, seed=123):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (n, cfg.train.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_mbs(x, y, dp, d, m):
    per = x.shape[0] // dp
    return list(zip(x[d * per:(d + 1) * per].chunk(m), y[d * per:(d + 1) * per].chunk(m)))


def reference(cfg, dp, m, steps=1):
    """One process, plain torch. Micro-batch j of the step is the concatenation of every dp rank's
    micro-batch j; the loss is the mean over the m micro-batches (MoE aux losses are per
    micro-batch, as with gradient accumulation on one process). Returns per step (loss, grads, norm)
    and the parameters after ``steps`` AdamW steps."""
    model = init_weights(meta_model(cfg.model, torch.float64), cfg.model, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    out = []
    for step in range(steps):
        x, y = batch(cfg, cfg.train.global_batch, 123 + step)
        parts = [local_mbs(x, y, dp, d, m) for d in range(dp)]
        total = 0.0
        for j in range(m):
            xs = torch.cat([parts[d][j][0] for d in range(dp)])
            ys = torch.cat([parts[d][j][1] for d in range(dp)])
            loss = model(xs, ys) / m
            loss.backward()
            total += float(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.append((total, grads, float(torch.sqrt(sum(g.pow(2).sum() for g in grads.values())))))
        opt.step()
        opt.zero_grad()
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


def grad_errors(engine, ref_grads):
    """(max error, names covered) of this rank's gradients against the reference."""
    err, names = 0.0, set()
    if hasattr(engine, "full_grads"):  # sharded: this rank's slice of every flat buffer
        for name, (lo, hi, g) in engine.full_grads().items():
            err = max(err, (g - ref_grads[name].reshape(-1)[lo:hi]).abs().max().item())
            names.add(name)
        return err, names
    for name, prm in engine.named_parameters():
        pl = get_placement(prm, name)
        want = ref_grads[pl.name]
        if pl.dim is not None:
            want = want.narrow(pl.dim, pl.start, pl.length)
        err = max(err, (pl.valid(prm.grad) - want).abs().max().item())
        names.add(pl.name)
    return err, names


def _worker(ctx, cases):
    from shardlab.parallelize import parallelize
    out = []
    for topo_kw, par, moe, steps in cases:
        topo = Topology(**topo_kw)
        mesh = Mesh.build(topo, transport=par.get("comm_transport", "auto"))
        cfg = tiny_cfg(moe)
        dp = topo.dp_replicate * topo.dp_shard
        m = par.get("microbatches", 4)
        p = cfg.parallel
        p.pp, p.dp_shard, p.dp_replicate, p.ep, p.microbatches = topo.pp, topo.dp_shard, topo.dp_replicate, topo.ep, m
        for k, v in par.items():
            setattr(p, k, v)
        cfg.train.global_batch = m * dp
        cfg.validate(ctx.world_size)
        ref_steps, ref_params = reference(cfg, dp, m, steps)
        engine = parallelize(meta_model(cfg.model, torch.float64), mesh, cfg)
        opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=1e-2))
        d = mesh.coords["dp_replicate"] * topo.dp_shard + mesh.coords["dp_shard"]
        row = dict(case=f"{topo.describe()} {par} moe={moe}", loss_err=0.0, grad_err=0.0, norm_err=0.0, names=set())
        for step, (ref_loss, ref_grads, ref_norm) in enumerate(ref_steps):
            x, y = batch(cfg, cfg.train.global_batch, 123 + step)
            loss = engine.global_loss(engine.forward_backward(local_mbs(x, y, dp, d, m)))
            err, names = grad_errors(engine, ref_grads)
            row["names"] |= names
            row["grad_err"] = max(row["grad_err"], err)
            row["loss_err"] = max(row["loss_err"], abs(loss - ref_loss))
            row["norm_err"] = max(row["norm_err"], abs(float(engine.grad_norm()) - ref_norm))
            opt.step()
            opt.zero_grad()
        state = engine.full_state(opt, everywhere=True)
        row["param_err"] = max((state[f"model.{n}"] - v).abs().max().item() for n, v in ref_params.items())
        row["n_names"] = len(ref_params)
        if hasattr(engine, "peak_in_flight"):  # reduce-scatters in flight at most, and the flats
            row["in_flight"] = (engine.peak_in_flight, len(engine.flats))
        if p.zero_stage:  # the shards (parameters and Adam states) reload into a fresh engine
            again = parallelize(meta_model(cfg.model, torch.float64), mesh, cfg, init=False)
            opt2 = again.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=1e-2))
            again.load_full_state(state, opt2)
            back = again.full_state(opt2, everywhere=True)
            row["reload_err"] = max((back[k] - v).abs().max().item() for k, v in state.items())
            row["reload_keys"] = sorted(set(back) ^ set(state))
        out.append(row)
    return out


def _check(results):
    for rows in zip(*results):
        names = set().union(*(r["names"] for r in rows))
        for r in rows:
            assert r["loss_err"] <= ATOL and r["grad_err"] <= ATOL and r["norm_err"] <= ATOL, r
            assert r["param_err"] <= ATOL, r  # AdamW steps on the shards equal the reference's
            assert r.get("reload_err", 0.0) == 0.0 and not r.get("reload_keys"), r
        assert len(names) == rows[0]["n_names"], (rows[0]["case"], sorted(names))  # every parameter checked
        for r in rows:  # at most two buckets' reduce-scatters in flight (gloo copies each one)
            if "in_flight" in r:
                peak, flats = r["in_flight"]
                assert peak == min(2, flats), r


def test_fsdp_and_zero_inside_pipeline_stages():
    """pp=2 x dp_shard=2: ZeRO-3 under 1f1b (two optimizer steps) and zb-h1 (split backward),
    ZeRO-1 under gpipe; ZeRO-1 and ZeRO-2 over gloo with 8 KiB buckets (a flat per parameter: the
    reduce-scatters two at a time)."""
    pp2dp2 = dict(pp=2, dp_shard=2)
    small = dict(comm_transport="process_group", bucket_cap_mb=8 / 1024)
    cases = [(pp2dp2, dict(zero_stage=3, pp_schedule="1f1b"), False, 2),
             (pp2dp2, dict(zero_stage=3, pp_schedule="zb-h1"), False, 1),
             (pp2dp2, dict(zero_stage=1, pp_schedule="gpipe", microbatches=2), False, 1),
             (pp2dp2, dict(zero_stage=1, pp_schedule="1f1b", **small), False, 2),
             (pp2dp2, dict(zero_stage=2, pp_schedule="1f1b", **small), False, 1)]
    results = run(_worker, 4, cases, timeout_s=180)
    _check(results)
    assert all(r["in_flight"][1] > 2 for r in results[0][3:]), [r["in_flight"] for r in results[0]]


def test_moe_inside_pipeline_stages():
    """MoE at pp=2 (x dp_shard=2, batch-wide aux statistics), under 1f1b and zb-h1, and
    pp=2 x ep=2 (experts over the dp ranks of each stage)."""
    cases = [(dict(pp=2, dp_shard=2), dict(pp_schedule="1f1b"), True, 1),
             (dict(pp=2, dp_shard=2), dict(pp_schedule="zb-h1"), True, 1),
             (dict(pp=2, dp_shard=2, ep=2), dict(pp_schedule="1f1b"), True, 2)]
    _check(run(_worker, 4, cases, timeout_s=180))
