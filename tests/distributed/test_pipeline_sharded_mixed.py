"""Mixed precision inside pipeline stages (``train.param_dtype = bf16``, ZeRO-1/3 x pp = 2 x dp = 2,
CPU gloo, N = 4) against an independent one-process computation of FSDP2's rule as
torch.distributed.pipelining drives it (docs/pipeline.md, "Sharding inside stages"):

  the fp32 weights cast to bf16; per dp rank d and micro-batch j, forward + backward in bf16 on
  that rank's micro-batch (loss / m), giving a bf16 gradient g_dj; the gradients accumulated over
  the micro-batches in the reduce dtype (fp32 by default: each g_dj cast and added; bf16: added in
  bf16), summed over the dp ranks in the reduce dtype, cast to fp32, divided by dp; one AdamW step
  on the fp32 masters.

Tolerance. The bf16 gradients g_dj are computed by the same kernels on the same inputs (stage
boundaries carry bf16 activations and activation gradients, as one process's bf16 graph does), so
what may differ is only the order of the fp32 sums (micro-batches, then ranks). Recursive summation
of n terms in a floating type with unit roundoff u errs by at most (n - 1) u sum|terms| (Higham,
Accuracy and Stability of Numerical Algorithms, 4.2): with fp32 (u = 2^-24) and n = m * dp terms
that is the bound checked elementwise, ``(n - 1) 2^-24 sum_dj |g_dj| / dp``. With the bf16 reduce
dtype the bf16 sum over the two ranks may round on either side: half a bf16 ulp (2^-9 relative),
2^-8 here. A reduction in bf16 where fp32 is asked for errs by up to 2^-9 relative per addition, a
gather in fp32 where bf16 is asked for changes every g_dj: both far outside these bounds.
The updated masters are checked against the reference AdamW step taken from the gradient bounds'
two ends (Adam's update is monotone in the gradient), widened by 2 eps_fp32 (|p| + lr): AdamW's own
arithmetic rounds differently on a flat slice than on a whole tensor (vectorised kernels; measured
up to 3 ulps of p where p - lr nearly cancels), and its operands are p and an update of about lr."""
import copy

import torch

from shardlab.analysis.plan_memory import _recv_bytes, model_state
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models.spec import init_weights, meta_model
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

from test_pipeline_sharded import SEED, batch, local_mbs, tiny_cfg

LR = 1e-2
LOW = {"bf16": torch.bfloat16, "": torch.float32, "fp32": torch.float32}


def reference(cfg, dp: int, m: int):
    """{name: (fp32 gradient, elementwise bound)} and {name: (lowest, highest) updated master}."""
    acc_dtype = LOW[cfg.train.reduce_dtype]
    master = init_weights(meta_model(cfg.model, torch.float32), cfg.model, SEED)
    low = copy.deepcopy(master).to(torch.bfloat16)
    x, y = batch(cfg, cfg.train.global_batch, 123)
    parts = [local_mbs(x, y, dp, d, m) for d in range(dp)]
    names = [n for n, _ in low.named_parameters()]
    per_rank, magnitude = [], {n: torch.zeros_like(p, dtype=torch.float32) for n, p in low.named_parameters()}
    for d in range(dp):
        acc = {n: torch.zeros_like(p, dtype=acc_dtype) for n, p in low.named_parameters()}
        for j in range(m):
            (low(*parts[d][j]) * (1.0 / m)).backward()
            for n, p in low.named_parameters():
                acc[n] += p.grad.to(acc_dtype)
                magnitude[n] += p.grad.float().abs()
                p.grad = None
        per_rank.append(acc)
    grads, bounds = {}, {}
    for n in names:
        total = per_rank[0][n]
        for acc in per_rank[1:]:
            total = total + acc[n]
        grads[n] = total.float() / dp
        bounds[n] = (m * dp - 1) * 2.0**-24 * magnitude[n] / dp
        if acc_dtype == torch.bfloat16:
            bounds[n] = bounds[n] + 2.0**-8 * sum(a[n].float().abs() for a in per_rank) / dp
    ends = []
    for sign in (-1, 1):  # the AdamW step from each end of the gradient interval
        model = copy.deepcopy(master)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        for n, p in model.named_parameters():
            p.grad = grads[n] + sign * bounds[n]
        opt.step()
        ends.append({n: p.detach().clone() for n, p in model.named_parameters()})
    # AdamW's own arithmetic on a flat slice and on a whole tensor may round differently (vectorised
    # kernels): a few roundings of its operands, the parameter and an update of about lr
    slack = {n: 2 * torch.finfo(torch.float32).eps * (q.detach().abs() + LR) for n, q in master.named_parameters()}
    steps = {n: (torch.minimum(ends[0][n], ends[1][n]) - slack[n], torch.maximum(ends[0][n], ends[1][n]) + slack[n])
             for n in names}
    return {n: (grads[n], bounds[n]) for n in names}, steps


def _worker(ctx, cases):
    from shardlab.parallelize import parallelize
    out = []
    for par, train in cases:
        rep = par.pop("dp_replicate", 1)  # hybrid: gradient shards all-reduced over the replicas
        topo = Topology(pp=2, dp_shard=2 // rep, dp_replicate=rep)
        mesh = Mesh.build(topo)
        cfg = tiny_cfg()
        cfg.train.precision, cfg.train.param_dtype = "fp32", "bf16"
        for k, v in train.items():
            setattr(cfg.train, k, v)
        m, dp = par.get("microbatches", 4), 2
        p = cfg.parallel
        p.pp, p.dp_shard, p.dp_replicate, p.microbatches = 2, 2 // rep, rep, m
        for k, v in par.items():
            setattr(p, k, v)
        cfg.train.global_batch = m * dp
        cfg.validate(ctx.world_size)
        ref_grads, ref_steps = reference(cfg, dp, m)
        engine = parallelize(meta_model(cfg.model, torch.float32), mesh, cfg)
        opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=LR))
        x, y = batch(cfg, cfg.train.global_batch, 123)
        d = mesh.coords["dp_replicate"] * topo.dp_shard + mesh.coords["dp_shard"]
        engine.global_loss(engine.forward_backward(local_mbs(x, y, dp, d, m)))
        row = dict(case=f"{par} rep={rep} {train}", names=set(), over=0.0, err=0.0)
        for name, (lo, hi, g) in engine.full_grads().items():
            want, bound = (t.reshape(-1)[lo:hi] for t in ref_grads[name])
            diff = (g - want).abs()
            row["over"] = max(row["over"], (diff - bound).max().item())  # > 0: outside the bound
            row["err"] = max(row["err"], diff.max().item())
            row["names"].add(name)
        acc_el = 2 if cfg.train.reduce_dtype == "bf16" else 4
        row["full_dtypes"] = {str(f.full.dtype) for f in engine.flats}
        row["param_dtypes"] = {str(q.dtype) for q in engine.model.parameters() if q.requires_grad}
        row["master_dtypes"] = {str(f.shard.dtype) for f in engine.flats}
        row["peak"] = engine.peak_buffer_bytes
        row["want_peak"] = sum(f.padded * (2 + acc_el) for f in engine.flats)
        row["fp32_peak"] = sum(f.padded * (4 + 4) for f in engine.flats)  # the same stage gathered in fp32
        # the planner's stage buffers for this rank (plan_memory: flat gradients + receives, + the
        # gathered stage under ZeRO-3; ZeRO-1/2 keep it between steps: their parameters' bytes)
        plan = model_state(cfg, mesh.coords["pp"])
        row["planned"] = plan["buffers"] - _recv_bytes(cfg) + (plan["params"] if p.zero_stage != 3 else 0)
        opt.step()
        opt.zero_grad()
        state = engine.full_state(opt, everywhere=True)
        row["param_over"] = max(((state[f"model.{n}"] - hi).clamp(min=0) + (lo - state[f"model.{n}"]).clamp(min=0))
                                .max().item() for n, (lo, hi) in ref_steps.items())  # > 0: outside
        row["n_names"] = len(ref_steps)
        out.append(row)
    return out


def test_bf16_stages_follow_fsdp2_rule():
    """ZeRO-3 under 1f1b (fp32 reduce, the default, and bf16 reduce), under zb-h1 (split
    backward) and hybrid (pp=2 x dp_replicate=2), ZeRO-1 under gpipe: gradients and updated masters within the stated bounds; the
    gathered stage and the modules' parameters bf16, the masters fp32; the stage buffers' peak
    bytes are 2 (bf16 stage) + 4 (fp32 gradient) per element, not fp32's 4 + 4, and are what the
    planner plans for the rank."""
    cases = [(dict(zero_stage=3, pp_schedule="1f1b"), {}),
             (dict(zero_stage=3, pp_schedule="1f1b"), {"reduce_dtype": "bf16"}),
             (dict(zero_stage=3, pp_schedule="zb-h1"), {"reduce_dtype": "fp32"}),
             (dict(zero_stage=3, pp_schedule="1f1b", dp_replicate=2), {}),
             (dict(zero_stage=1, pp_schedule="gpipe", microbatches=2), {})]
    results = run(_worker, 4, cases, timeout_s=180)
    for rows in zip(*results):
        names = set().union(*(r["names"] for r in rows))
        assert len(names) == rows[0]["n_names"], (rows[0]["case"], sorted(names))  # every parameter checked
        for r in rows:
            assert r["over"] <= 0.0, r  # every gradient element within the summation-order bound
            assert r["param_over"] <= 0.0, r
            assert r["full_dtypes"] == r["param_dtypes"] == {"torch.bfloat16"}, r
            assert r["master_dtypes"] == {"torch.float32"}, r
            assert r["peak"] == r["want_peak"] == r["planned"] < r["fp32_peak"], r
