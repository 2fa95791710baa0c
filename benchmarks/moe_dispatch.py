"""MoE dispatch over two tiers, measured side by side on one CPU host (docs/expert-parallel.md,
"Two tiers"): 4 ranks as 2 simulated nodes x 2, ep = 4, the slow tier between the nodes
throttled by distributed/tiers.py.

For each slow-tier speed (``--slow-factors``: the fast tier's measured all-to-all bandwidth
divided by each factor; 0 = not throttled) and each variant of one MoE layer's forward+backward:

  flat          the all-to-all over the ep group (``ep_dispatch = exact``)
  hierarchical  once per token and destination node over the slow tier, forwarded inside
  M = 1 / 2     node-limited routing: each token's experts on at most M of the 2 nodes (2 = all)
  overlap n     the tokens in n chunks, one chunk's all-to-all beside another's experts (flat:
                async all-to-alls in one thread; hierarchical: the chunks as lanes,
                distributed/lanes.py)
  F&B           DualPipe's pair: the forward of one micro-batch and the backward of the previous
                one as two lanes (the same work as one micro-batch's forward+backward)

it reports the step time (median over rounds of the slowest rank; variants interleaved round by
round) and the bytes one rank sends over the slow tier per step (ledger, mean over ranks; all
collectives of the layer: dispatch, combine, count exchanges, the auxiliary statistics' all-reduce).
Then, for overlap off / 2 / 4 chunks / F&B, the exposed communication per step read from a profiler
trace (union of the ``tier:*`` collective spans, ``ep:all_to_all`` synchronous exchanges, ``ep:wait``
waits and ``shm:*`` spans, analysis/overlap.py's interval arithmetic; with lanes, of every thread:
only the lane holding the baton runs, so a wait in any lane is a wait of the rank) and the share
of the all-to-all time hidden:
1 - exposed(on) / exposed(off).

``--bytes-top-k``: first, for each top-k, one step of flat and hierarchical (M = all): the slow-tier
bytes and the ratio against what deduplication per destination node can reach at best (remote
(node, token) pairs / remote assignments of the step's routing, and its closed form for uniform
routing, N (1 - C(E - E/N, k) / C(E, k)) / k with N nodes).

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
from shardlab.distributed.lanes import Lanes
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.tiers import Link, TieredComm
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel import expert

VARIANTS = {  # name -> (ep_dispatch, overlap chunks or "fb", moe_max_nodes)
    "flat M=2": ("exact", 0, 0), "hierarchical M=2": ("hierarchical", 0, 0),
    "flat M=1": ("exact", 0, 1), "hierarchical M=1": ("hierarchical", 0, 1),
    "flat M=2 overlap 2": ("exact", 2, 0), "flat M=2 overlap 4": ("exact", 4, 0), "flat M=2 F&B": ("exact", "fb", 0),
    "hierarchical M=2 overlap 2": ("hierarchical", 2, 0), "hierarchical M=2 overlap 4": ("hierarchical", 4, 0),
    "hierarchical M=2 F&B": ("hierarchical", "fb", 0),
}

OVERLAP = {"flat M=2": ("flat M=2 overlap 2", "flat M=2 overlap 4", "flat M=2 F&B"),
           "hierarchical M=2": ("hierarchical M=2 overlap 2", "hierarchical M=2 overlap 4", "hierarchical M=2 F&B")}


def _layer(mesh, a, dispatch, overlap, m, top_k):
    cfg = ModelConfig(vocab_size=64, d_model=a.d_model, n_layers=1, n_heads=4, ffn_hidden=a.ffn,
                      n_experts=a.experts, moe_top_k=top_k, moe_node_groups=2 if m else 0, moe_max_nodes=m)
    ref = build_model(cfg, seed=4).layers["0"].feed_forward
    with torch.no_grad():
        ref.router.weight.normal_(0, 1e-3, generator=torch.Generator().manual_seed(1))
    layer = expert.ExpertParallelMoE(ref, mesh, cfg, "layers.0.feed_forward", dispatch,
                                     overlap if isinstance(overlap, int) else 0)
    layer.fb = overlap == "fb"
    layer.pending = None  # F&B: the previous micro-batch's loss, whose backward runs beside the next forward
    return layer


def _layers(mesh, a):
    return {name: _layer(mesh, a, dispatch, overlap, m, a.top_k) for name, (dispatch, overlap, m) in VARIANTS.items()}


def _step(layer, x, w):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    if not layer.fb:
        (layer(x) * w).sum().backward()
        return
    if layer.pending is None:
        layer.pending = (layer(x) * w).sum()
    prev, out = layer.pending, {}
    Lanes().run(lambda: out.update(loss=(layer(x) * w).sum()), prev.backward)
    layer.pending = out["loss"]


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


COMM = ("tier:", "shm:", "ep:wait", "ep:start", "ep:all_to_all")


def _comm_trace(layer, x, w, steps=3) -> tuple[list, float]:
    """The communication spans of ``steps`` steps from a Chrome trace: [name, start, end, thread]
    in microseconds of the host's clock (``baseTimeNanoseconds`` added, so the ranks' traces line
    up), the outermost per thread; and the experts' compute per step in ms (the ``_Experts``
    autograd function forward and backward: what the transfers can hide behind). Variants with lanes are traced on all threads; the others on
    the loop's thread, where all their communication runs (a trace of all threads would lose the
    shared-memory transport's ``shm:`` spans: it opens them only where ``_profiler_enabled()``,
    which such a trace does not set)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile
    lanes = layer.fb or layer.hier_chunks > 1
    with profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=lanes)) as prof:
        for _ in range(steps):
            _step(layer, x, w)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not lanes:
        tid = statistics.mode(e.get("tid") for e in events if e.get("cat") == "cpu_op")
        events = [e for e in events if e.get("tid") == tid]
    spans = sorted((e["ts"] + base, e["ts"] + base + e["dur"], e["name"], e.get("tid")) for e in events
                   if e["name"].startswith(COMM))
    out, last = [], {}
    for a, b, name, tid in spans:
        if tid in last and b <= last[tid]:
            continue  # inside an outer communication span (a tier: span around its shm: call)
        last[tid] = b
        out.append([name, a, b, tid])
    experts = sum(e["dur"] for e in events if e["name"] in ("_Experts", "_ExpertsBackward")) / 1e3 / steps
    return out, experts


def _a2a(name: str) -> bool:
    """Whether a communication span is an all-to-all's (the waits are all of all-to-alls)."""
    return name.startswith("ep:") or name.endswith(":all_to_all")


def _exposure(traces: list, steps=3) -> list[tuple[float, float | None]]:
    """Per rank, ms per step: (exposed, of it the transfer). Exposed: the union of the collective
    spans and the waits. Transfer: the same without the time before the collective's last rank
    issued it (waiting for a slower rank is imbalance, not the all-to-all): collectives are
    numbered in issue order, the same on every rank (synchronous spans and ``ep:start``); a wait
    belongs to the oldest unwaited start of its thread. None where the ranks' counts differ. Only
    all-to-alls count (the dispatch, combine and count exchanges; the routing statistics'
    all-reduce, the same with overlap on and off, is left out): the share hidden is of the
    all-to-all time."""
    issues = [[e for e in t if not e[0].startswith("ep:wait")] for t in traces]
    last = [max(col) for col in zip(*[[e[1] for e in iss] for iss in issues])]
    same = len({len(i) for i in issues}) == 1
    out = []
    for t, iss in zip(traces, issues):
        exposed = [(a, b) for name, a, b, _ in t if name != "ep:start" and _a2a(name)]
        moved, queues, n = [], {}, 0
        for name, a, b, tid in t:
            if name == "ep:wait":
                k = queues[tid].pop(0)
                moved.append((max(a, last[k]), b))
            else:
                if name == "ep:start":
                    queues.setdefault(tid, []).append(n)
                elif _a2a(name):
                    moved.append((max(a, last[n]), b))
                n += 1
        total = sum(b - a for a, b in merge(exposed)) / 1e3 / steps
        transfer = sum(b - a for a, b in merge([(a, b) for a, b in moved if b > a])) / 1e3 / steps
        out.append((total, transfer if same else None))
    return out


def _bytes(mesh, a, x, w) -> dict:
    """Per top-k: slow-tier bytes of one step, flat and hierarchical, and the routing's remote
    (node, token) pairs and remote assignments (module doc)."""
    out = {}
    for k in a.bytes_top_k:
        row = {}
        for name, dispatch in (("flat", "exact"), ("hier", "hierarchical")):
            layer = _layer(mesh, a, dispatch, 0, 0, k)
            snap = mesh.ledger.snapshot()
            _step(layer, x, w)
            row[name] = sum(e.inter_sent for e in mesh.ledger.since(snap).values())
        r, h = layer.last_routing, layer.hier
        node = h.exp_node[r.expert]
        remote = r.keep & (node != mesh.node_of(mesh.rank))
        row["assignments"] = int(remote.sum())
        row["pairs"] = len(set(zip(node[remote].tolist(), r.token[remote].tolist())))
        out[k] = row
    return out


def worker(ctx, a):
    mesh = Mesh.build(Topology(dp_shard=4, ep=4, nodes=2), transport=a.transport)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    x, w = torch.randn(a.tokens, a.d_model, generator=g), torch.randn(a.tokens, a.d_model, generator=g)
    x.requires_grad_()  # as inside a model: the dispatch's backward runs too
    out = {"bytes": _bytes(mesh, a, x, w) if a.bytes_top_k else {}}
    if not a.slow_factors:
        return out
    layers = _layers(mesh, a)
    fast = _fast_gbps(mesh)
    out.update({"fast_gbps": fast, "settings": {}})
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
        if factor in _profiled(a):
            for n in [n for off, ons in OVERLAP.items() for n in (off,) + ons]:
                row[n]["trace"], row[n]["experts_ms"] = _comm_trace(layers[n], x, w, a.trace_steps)
        out["settings"][factor] = {"gbps": link.gbps, "rows": row}
    return out


def _print_bytes(res, a):
    from math import comb
    N, E = 2, a.experts
    print(f"\nSlow-tier bytes per rank per step (fwd+bwd), hierarchical vs flat, M = all: 4 ranks = 2 simulated "
          f"nodes x 2, {E} experts, {a.tokens} tokens per rank, d {a.d_model}, fp32, uniform routing (mean over ranks)")
    print("| top-k | flat (KiB) | hierarchical (KiB) | hierarchical / flat | remote (node, token) pairs / remote "
          "assignments | closed form N(1 - C(E-E/N,k)/C(E,k))/k | target 1/(ranks per node) |")
    print("|---|---|---|---|---|---|---|")
    for k in a.bytes_top_k:
        rows = [r["bytes"][k] for r in res]
        flat, hier = (statistics.mean(r[n] for r in rows) / 1024 for n in ("flat", "hier"))
        ideal = sum(r["pairs"] for r in rows) / max(1, sum(r["assignments"] for r in rows))
        form = N * (1 - comb(E - E // N, k) / comb(E, k)) / k
        print(f"| {k} | {flat:.0f} | {hier:.0f} | {hier / flat:.3f} | {ideal:.3f} | {form:.3f} | 0.5 |")


def _print_steps(res, a):
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
    profiled = [f for f in a.slow_factors if f in _profiled(a)]
    if not profiled:
        return
    print("\nOverlap: all-to-all time per step from the profiler traces, mean over ranks: exposed (collective spans "
          "and waits), of it transfer (without the wait for the collective's last rank to issue it: imbalance), "
          "and the share hidden against overlap off; the experts' compute per step (forward + backward) and, for "
          "overlap off, the most that can hide behind it: min(1, experts / transfer)")
    print("| slow tier | dispatch | overlap | step (ms) | exposed (ms) | waiting for a slower rank (ms) | "
          "transfer exposed (ms) | hidden: exposed | hidden: transfer | experts (ms) | at most hidden |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for factor in profiled:
        for off, ons in OVERLAP.items():
            rows = {n: [r["settings"][factor]["rows"][n] for r in res] for n in (off,) + ons}
            ex = {n: _exposure([r["trace"] for r in rr], a.trace_steps) for n, rr in rows.items()}
            mean = {n: (statistics.mean(e for e, _ in v), None if any(t is None for _, t in v)
                        else statistics.mean(t for _, t in v)) for n, v in ex.items()}
            (e0, t0) = mean[off]
            for n, (e, t) in mean.items():
                how = "off" if n == off else n.removeprefix(off + " ")
                hid = "" if n == off else f"{1 - e / e0:.2f}"
                hid_t = "" if n == off or t is None or t0 is None else f"{1 - t / t0:.2f}"
                c = statistics.mean(r["experts_ms"] for r in rows[n])
                bound = f"{min(1.0, c / t):.2f}" if n == off and t else ""
                print(f"| fast / {factor:g} | {off.split()[0]} | {how} | {rows[n][0]['step_ms']:.1f} | {e:.1f} | "
                      f"{'' if t is None else f'{e - t:.1f}'} | {'' if t is None else f'{t:.1f}'} | {hid} | {hid_t} | "
                      f"{c:.1f} | {bound} |")


def _profiled(a) -> list[float]:
    """The slow-tier settings whose overlap is profiled: ``--profile-factors``, default every throttled one."""
    return a.profile_factors if a.profile_factors is not None else [f for f in a.slow_factors if f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--slow-factors", type=float, nargs="*", default=[0, 4, 16],
                    help="slow tier = measured fast-tier bandwidth / factor (0: not throttled)")
    ap.add_argument("--latency-us", type=float, default=20.0, help="slow-tier latency per message")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile-factors", type=float, nargs="*", default=None,
                    help="the slow-tier settings whose overlap is profiled (default: every throttled one)")
    ap.add_argument("--transport", default="auto", choices=["auto", "process_group"],
                    help="the collectives' transport (parallel.comm_transport): auto = shared memory on x86-64 for "
                         "the synchronous ones; process_group = gloo for all, as the overlap's asynchronous ones")
    ap.add_argument("--trace-steps", type=int, default=3,
                    help="steps per profiled trace (the exposure is their mean: more steps, less of the 2-core "
                         "machine's scheduling noise)")
    ap.add_argument("--json", default="")
    ap.add_argument("--bytes-top-k", type=int, nargs="*", default=[],
                    help="first: slow-tier bytes of flat vs hierarchical for each of these top-k (module doc)")
    a = ap.parse_args()
    res = run(worker, 4, a, timeout_s=1800)
    if a.bytes_top_k:
        _print_bytes(res, a)
    if a.slow_factors:
        _print_steps(res, a)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
