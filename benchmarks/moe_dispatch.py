"""MoE dispatch over two tiers, measured side by side on one CPU host (docs/expert-parallel.md,
"Two tiers"): 4 ranks as 2 simulated nodes x 2, ep = 4, the slow tier between the nodes
throttled by distributed/tiers.py.

For each slow-tier speed (``--slow-factors``: the fast tier's measured all-to-all bandwidth
divided by each factor; 0 = not throttled) and each variant of one MoE layer's forward+backward:

  flat          the all-to-all over the ep group (``ep_dispatch = exact``)
  hierarchical  once per token and destination node over the slow tier, forwarded inside
  M = 1 / 2     node-limited routing: each token's experts on at most M of the 2 nodes (2 = all)
  overlap n     flat, the tokens in n chunks, one chunk's all-to-all beside another's experts

it reports the step time (median over rounds of the slowest rank; variants interleaved round by
round) and the bytes one rank sends over the slow tier per step (ledger, mean over ranks; all
collectives of the layer: dispatch, combine, count exchanges, the auxiliary statistics' all-reduce).
Then, for overlap off / 2 / 4 chunks, the exposed communication per step read from a profiler trace
(union of the loop thread's ``tier:*`` collective spans, ``ep:wait`` waits and ``shm:*`` spans,
analysis/overlap.py's interval arithmetic) and the share of the all-to-all time hidden:
1 - exposed(on) / exposed(off).

    PYTHONPATH=. python benchmarks/moe_dispatch.py [--tokens 512 --top-k 8 --experts 16]

Uniform routing: the router's weights are drawn with a small std, so every expert is about as
likely; each token's k experts are its k largest of E nearly equal random logits.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from shardlab.analysis.overlap import merge
from shardlab.config import ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.tiers import Link, TieredComm
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel import expert

VARIANTS = {  # name -> (ep_dispatch, overlap, moe_max_nodes)
    "flat M=2": ("exact", False, 0), "hierarchical M=2": ("hierarchical", False, 0),
    "flat M=1": ("exact", False, 1), "hierarchical M=1": ("hierarchical", False, 1),
    "flat M=2 overlap 2": ("exact", 2, 0), "flat M=2 overlap 4": ("exact", 4, 0),
}

OVERLAP = ("flat M=2", "flat M=2 overlap 2", "flat M=2 overlap 4")


def _layers(mesh, a):
    out = {}
    for name, (dispatch, overlap, m) in VARIANTS.items():
        cfg = ModelConfig(vocab_size=64, d_model=a.d_model, n_layers=1, n_heads=4, ffn_hidden=a.ffn,
                          n_experts=a.experts, moe_top_k=a.top_k, moe_node_groups=2 if m else 0, moe_max_nodes=m)
        ref = build_model(cfg, seed=4).layers["0"].feed_forward
        with torch.no_grad():
            ref.router.weight.normal_(0, 1e-3, generator=torch.Generator().manual_seed(1))
        out[name] = expert.ExpertParallelMoE(ref, mesh, cfg, "layers.0.feed_forward", dispatch, overlap)
    return out


def _step(layer, x, w):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    (layer(x) * w).sum().backward()


def _set_link(mesh, link):
    for name in ("ep", "ep_inter", "dp_cp"):
        c = mesh.comm(name)
        if isinstance(c, TieredComm):
            c.link = link


def _fast_gbps(mesh, nbytes=1 << 21, iters=10) -> float:
    """All-to-all bandwidth inside a node (the ep_intra group, unthrottled): bytes one rank
    sends to the other over the median call time, the slowest rank's."""
    comm = mesh.comm("ep_intra")
    x = torch.ones(nbytes // 4)
    ts = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_to_all(x)
        ts.append(time.perf_counter() - t0)
    t = torch.tensor(statistics.median(ts))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return nbytes * (comm.size - 1) / comm.size / t.item() / 1e9


def _exposed_ms(layer, x, w, steps=3) -> float:
    """Exposed communication per step from a Chrome trace of ``steps`` steps (module doc)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _step(layer, x, w)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    tid = statistics.mode(e.get("tid") for e in ops)
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("tid") == tid
            and e["name"].startswith(("tier:", "ep:wait", "shm:"))]
    return sum(b - a for a, b in merge(comm)) / 1e3 / steps


def worker(ctx, a):
    mesh = Mesh.build(Topology(dp_shard=4, ep=4, nodes=2))
    layers = _layers(mesh, a)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    x, w = torch.randn(a.tokens, a.d_model, generator=g), torch.randn(a.tokens, a.d_model, generator=g)
    x.requires_grad_()  # as inside a model: the dispatch's backward runs too
    fast = _fast_gbps(mesh)
    out = {"fast_gbps": fast, "settings": {}}
    for factor in a.slow_factors:
        link = Link(fast / factor, a.latency_us) if factor else Link()
        _set_link(mesh, link)
        times = {n: [] for n in VARIANTS}
        inter = {}
        for rnd in range(a.rounds + 1):  # round 0: warm-up
            for name, layer in layers.items():
                dist.barrier()
                snap = mesh.ledger.snapshot()
                t0 = time.perf_counter()
                _step(layer, x, w)
                t = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rnd:
                    times[name].append(t.item())
                inter[name] = sum(e.inter_sent for e in mesh.ledger.since(snap).values())
        row = {n: {"step_ms": 1e3 * statistics.median(times[n]), "inter_KiB": inter[n] / 1024} for n in VARIANTS}
        if factor == a.profile_factor:
            for n in OVERLAP:
                row[n]["exposed_ms"] = _exposed_ms(layers[n], x, w)
        out["settings"][factor] = {"gbps": link.gbps, "rows": row}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--slow-factors", type=float, nargs="+", default=[0, 4, 16],
                    help="slow tier = measured fast-tier bandwidth / factor (0: not throttled)")
    ap.add_argument("--latency-us", type=float, default=20.0, help="slow-tier latency per message")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile-factor", type=float, default=16, help="the setting whose overlap is profiled")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    res = run(worker, 4, a, timeout_s=1200)
    fast = res[0]["fast_gbps"]
    print(f"\nMoE layer fwd+bwd, 4 ranks = 2 simulated nodes x 2, ep 4, {a.experts} experts top-{a.top_k}, "
          f"{a.tokens} tokens per rank, d {a.d_model}, ffn {a.ffn}, fp32, uniform routing; fast tier (measured "
          f"intra-node all-to-all): {fast:.3f} GB/s per rank; slow tier + {a.latency_us:g} us per message")
    print("| slow tier | variant | step (ms) | vs flat M=2 | slow-tier KiB sent per rank per step | vs flat M=2 |")
    print("|---|---|---|---|---|---|")
    for factor in a.slow_factors:
        rows = {n: {k: statistics.mean(r["settings"][factor]["rows"][n][k] for r in res)
                    for k in ("inter_KiB",)} | {"step_ms": res[0]["settings"][factor]["rows"][n]["step_ms"]}
                for n in VARIANTS}
        base = rows["flat M=2"]
        tier = f"fast / {factor:g} = {res[0]['settings'][factor]['gbps']:.3f} GB/s" if factor else "not throttled"
        for n, r in rows.items():
            print(f"| {tier} | {n} | {r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f} | "
                  f"{r['inter_KiB']:.0f} | {r['inter_KiB'] / base['inter_KiB']:.2f} |")
    if a.profile_factor in a.slow_factors:
        print(f"\nOverlap, slow tier fast / {a.profile_factor:g}: exposed communication per step from the profiler "
              "trace (mean over ranks)")
        print("| overlap chunks | step (ms) | exposed communication (ms) | hidden = 1 - exposed / exposed(off) |")
        print("|---|---|---|---|")
        rows = {n: [r["settings"][a.profile_factor]["rows"][n] for r in res] for n in OVERLAP}
        off = statistics.mean(r["exposed_ms"] for r in rows["flat M=2"])
        for n, rr in rows.items():
            e = statistics.mean(r["exposed_ms"] for r in rr)
            print(f"| {n.rpartition(' ')[2] if 'overlap' in n else 'off'} | {rr[0]['step_ms']:.1f} | {e:.1f} | "
                  f"{'' if n == 'flat M=2' else f'{1 - e / off:.2f}'} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
