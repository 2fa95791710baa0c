"""Two tiers: the hierarchical expert dispatch (parallel/expert_hier.py), the overlapped ones
(parallel/expert_overlap.py: flat in chunks, hierarchical in lanes) and node-limited routing over simulated nodes, against the single-process MoE layer on each rank's tokens (float64), and
the slow-tier bytes the tier wrapper (distributed/tiers.py) counts against what the routing
implies. Run with every point-to-point tag forced to 0 (NCCL's matching by issue order)."""
import time

import torch

from shardlab.distributed.mesh import Mesh
from shardlab.distributed.tiers import Link, TieredComm
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel import expert
from tests.distributed.test_context import equal_tags
from tests.distributed.test_expert import ATOL, make_cfg

D, T = 32, 24


def _layer_case(mesh, cfg, dispatch, seed=1, skew=False, chunks=2):
    """One rank's tokens through the ep layer vs the plain layer on the same tokens. Returns the
    error of outputs and gradients, the kept assignments' agreement, the slow-tier bytes sent
    (forward) and, per other node, the (node, token) pairs and the assignments sent there."""
    ref = build_model(cfg.model, seed=4, dtype=torch.float64).layers["0"].feed_forward
    with torch.no_grad():  # a peaked router: experts overflow under a capacity
        ref.router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    overlap = dispatch in ("overlap", "hier-overlap")
    base = {"overlap": "exact", "hier-overlap": "hierarchical"}.get(dispatch, dispatch)
    layer = expert.ExpertParallelMoE(ref, mesh, cfg.model, "layers.0.feed_forward", base, chunks if overlap else 0)
    gen = torch.Generator().manual_seed(10 + mesh.rank)
    x = torch.randn(T, D, dtype=torch.float64, generator=gen)
    if skew:  # column 0 large, the router's weight on it +/-: node 0's experts win every top-k
        x[:, 0] = 20.0
        with torch.no_grad():
            half = ref.n_experts // 2
            ref.router.weight[:half, 0], ref.router.weight[half:, 0] = 1.0, -1.0
    w = torch.randn(T, D, dtype=torch.float64, generator=gen)
    # the overlapped layers with a capacity: an input without gradient (the experts still get theirs)
    no_grad_in = overlap and cfg.model.moe_capacity_factor > 0
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_(not no_grad_in)
    y_ref = ref(xr)
    (y_ref * w).sum().backward()
    snap = mesh.ledger.snapshot()
    y = layer(xe)
    inter = sum(e.inter_sent for (op, _), e in mesh.ledger.since(snap).items() if op == "all_to_all")
    snap = mesh.ledger.snapshot()
    (y * w).sum().backward()
    inter_bwd = sum(e.inter_sent for (op, _), e in mesh.ledger.since(snap).items() if op == "all_to_all")
    err = max((y - y_ref).abs().max().item(), 0 if no_grad_in else (xe.grad - xr.grad).abs().max().item(),
              (layer.router.weight.grad - ref.router.weight.grad).abs().max().item())
    for name in ("w1", "w2", "w3"):
        full = mesh.comm("ep").all_reduce(getattr(ref.experts, name).grad.clone())
        err = max(err, (getattr(layer.experts, name).grad - full[layer.first:layer.first + layer.n_local]).abs().max().item())
    r, rr = layer.last_routing, ref.last_routing
    ep_ranks = mesh.ranks("ep")
    node = torch.tensor([mesh.node_of(ep_ranks[e // layer.n_local]) for e in range(layer.n_experts)])[r.expert]
    mine = mesh.node_of(mesh.rank)
    other = r.keep & (node != mine)
    pairs = {int(b): len(set(r.token[other & (node == b)].tolist())) for b in node[other].unique()}
    owner = torch.tensor(ep_ranks)[r.expert // layer.n_local]
    rows = {int(q): int((other & (owner == q)).sum()) for q in owner[other].unique()}
    return dict(err=err, same=torch.equal(r.keep, rr.keep) and torch.equal(r.expert, rr.expert),
                dropped=int((~r.keep).sum()), inter=inter, inter_bwd=inter_bwd, pairs=pairs, rows=rows, node=mine, rank=mesh.rank,
                local=mesh.local_rank("ep_intra"), experts=layer.n_experts,
                max_nodes=int(max(len(set(node[r.keep & (r.token == t)].tolist())) for t in range(T))))


def worker(ctx, nodes, topo):
    mesh = Mesh.build(Topology(**topo, nodes=nodes))
    out = {}
    with equal_tags(set()) as seen:
        for cap in (0.0, 1.0):
            for k in (1, 2):
                for m, g in ((0, 0), (1, nodes)):
                    cfg = make_cfg(topo, top_k=k, capacity=cap)
                    cfg.model.moe_node_groups, cfg.model.moe_max_nodes = g, m
                    for dispatch in ("hierarchical", "exact", "overlap", "hier-overlap"):
                        out[(cap, k, m, dispatch)] = _layer_case(mesh, cfg, dispatch)
    out["tags"] = seen
    return out


def _slow_bytes(case, dispatch, k, everyone, ep_nodes):
    """Forward slow-tier bytes of one rank: the count exchange, what it sends over, and the
    rows it returns to ranks of other nodes in the combine (``everyone``: their cases)."""
    if dispatch in ("exact", "overlap"):  # flat: one row per assignment on another node, each way
        back = sum(c["rows"].get(case["rank"], 0) for c in everyone)  # counts: n_local ints per rank (per half)
        return (sum(case["rows"].values()) + back) * D * 8 + ep_nodes * 8 * (2 if dispatch == "overlap" else 1)
    # hierarchical: row + k weights + k ids (float64 columns) per (node, token), to and from the same local index
    # and one count exchange: per other node and chunk, its pair count and the assignments per expert slot of
    # that node (1 + n_experts / nodes ints; overlapped: the same rows in 2 chunks of the tokens)
    back = sum(c["pairs"].get(case["node"], 0) for c in everyone if c["local"] == case["local"])
    counts = 8 * (ep_nodes - 1) * (1 + case["experts"] // ep_nodes) * (2 if dispatch == "hier-overlap" else 1)
    return sum(case["pairs"].values()) * (D + 2 * k) * 8 + back * D * 8 + counts


def _slow_bytes_backward(case, dispatch, k, everyone):
    """Backward slow-tier bytes: the transposes of the forward's row exchanges, no count exchange;
    the hierarchical dispatch's gradient rows carry the k weights' gradients, not the ids."""
    if dispatch in ("exact", "overlap"):
        return (sum(case["rows"].values()) + sum(c["rows"].get(case["rank"], 0) for c in everyone)) * D * 8
    back = sum(c["pairs"].get(case["node"], 0) for c in everyone if c["local"] == case["local"])
    return sum(case["pairs"].values()) * D * 8 + back * (D + k) * 8


def _check(res, nodes, n_local):
    assert all(r["tags"] <= {0} for r in res)
    assert sum(r[(1.0, 2, 0, "hierarchical")]["dropped"] for r in res) > 0  # the capacity drops
    for rank, r in enumerate(res):
        for key, c in r.items():
            if key == "tags":
                continue
            cap, k, m, dispatch = key
            assert c["same"] and c["err"] <= ATOL, (rank, key, c)
            if m:
                assert c["max_nodes"] <= m, (rank, key, c)
            everyone = [o[key] for o in res if o[key]["node"] != c["node"]]
            other_ranks = sum(1 for o in res if o[key]["node"] != c["node"])
            cross = nodes if dispatch.startswith("hier") else n_local * other_ranks
            assert c["inter"] == _slow_bytes(c, dispatch, k, everyone, cross), (rank, key, c)
            if not (cap and dispatch.endswith("overlap")):  # there the input needs no gradient
                assert c["inter_bwd"] == _slow_bytes_backward(c, dispatch, k, everyone), (rank, key, c)


def test_hierarchical_ep4_over_two_nodes_equals_the_plain_layer():
    """ep4 = 2 nodes x 2 ranks: the forwarding hop inside each node is exercised."""
    res = run(worker, 4, 2, dict(dp_shard=4, ep=4))
    _check(res, 2, 1)
    # uniform-ish routing, top 2 of 4 experts on 2 nodes: fewer slow-tier bytes than the flat dispatch
    for r in res:
        assert r[(0.0, 2, 0, "hierarchical")]["inter"] < r[(0.0, 2, 0, "exact")]["inter"]


def _skew_worker(ctx):
    mesh = Mesh.build(Topology(dp_shard=4, ep=4, nodes=2))
    return {d: _layer_case(mesh, make_cfg(dict(dp_shard=4, ep=4), top_k=2), d, skew=True)
            for d in ("hierarchical", "hier-overlap")}


def test_hierarchical_with_a_node_that_receives_nothing():
    """All tokens routed to node 0's experts: node 1's ranks receive no (node, token) pair, yet
    run every collective of the layer forward and backward; outputs and gradients exact."""
    res = run(_skew_worker, 4)
    for rank, cases in enumerate(res):
        for d, c in cases.items():
            assert c["err"] <= ATOL and c["same"], (rank, d, c["err"])
            assert c["max_nodes"] == 1, (rank, d)  # every token's experts on one node: node 0


def _chunks_worker(ctx):
    mesh = Mesh.build(Topology(dp_shard=4, ep=4, nodes=2))
    return {(d, n, cap): _layer_case(mesh, make_cfg(dict(dp_shard=4, ep=4), top_k=2, capacity=cap), d, chunks=n)
            for d in ("overlap", "hier-overlap") for n in (3, 4) for cap in (0.0, 1.0)}


def test_overlap_in_uneven_chunks_equals_the_plain_layer():
    """3 and 4 chunks, whose end chunks are half the others (models/moe.py ``chunk_bounds``: 24
    tokens as 6/12/6 and 4/8/8/4), flat and hierarchical, with and without a capacity."""
    for rank, cases in enumerate(run(_chunks_worker, 4)):
        for key, c in cases.items():
            assert c["err"] <= ATOL and c["same"], (rank, key, c["err"])


def test_hierarchical_on_one_node_is_the_fast_hop_alone():
    """One node: the slow hop is a group of one (nothing crosses), the forwarding hop is the ep group."""
    res = run(worker, 2, 1, dict(dp_shard=2, ep=2))
    _check(res, 1, 2)
    assert all(c["inter"] == 0 for r in res for k, c in r.items() if k != "tags")


def _throttle_worker(ctx):
    mesh = Mesh.build(Topology(dp_shard=2, ep=2, nodes=2, inter_node_gbps=0.01, inter_node_latency_us=2000))
    comm = mesh.comm("ep")
    x = torch.ones(25_000, dtype=torch.float64)  # 200 kB: 100 kB each way over 0.01 GB/s = 10 ms (+2 ms)
    comm.all_to_all(x)
    t0 = time.perf_counter()
    comm.all_to_all(x)
    a2a = time.perf_counter() - t0
    work = comm.isend(torch.ones(10), 1 - comm.rank) if comm.rank == 0 else comm.irecv(torch.empty(10), 0)
    work.wait()
    entries = mesh.ledger.entries
    return (isinstance(comm, TieredComm), a2a, entries[("all_to_all", "ep")].inter_sent,
            entries[("all_to_all", "ep")].bytes_sent, mesh.link == Link(0.01, 2000.0), comm.link.seconds(100_000))


def test_throttle_holds_a_cross_node_call_to_the_link_time():
    for tiered, a2a, inter, sent, link_ok, expect in run(_throttle_worker, 2):
        assert tiered and link_ok
        assert inter == sent == 2 * 100_000  # two calls, half of the 200 kB leaves for the other node
        assert abs(expect - 0.012) < 1e-12 and a2a >= expect


def _late_rank_worker(ctx):
    import torch.distributed as dist
    from shardlab.distributed.lanes import start_all_to_all
    mesh = Mesh.build(Topology(dp_shard=2, ep=2, nodes=2, inter_node_gbps=0.01, inter_node_latency_us=20_000))
    comm, x, out = mesh.comm("ep"), torch.ones(2), []
    comm.all_to_all(x)  # the first throttled call builds the issue table
    for call in (lambda: comm.all_to_all(x), lambda: start_all_to_all(comm, x, None, None)[0].wait()):
        dist.barrier()
        if mesh.rank == 1:
            time.sleep(0.08)
        issued = time.perf_counter()  # the host's monotonic clock: comparable between the ranks
        call()
        out.append((issued, time.perf_counter()))
    return out


def test_a_transfer_starts_when_the_last_rank_issues_it():
    """Rank 1 issues 80 ms after rank 0, over a link of 20 ms: rank 0's call (synchronous, then
    asynchronous) lasts until 20 ms after rank 1 issued it, not 20 ms after its own issue."""
    early, late = run(_late_rank_worker, 2)
    for (_, end0), (issued1, end1) in zip(early, late):
        assert end0 - issued1 >= 0.02 - 1e-3 and end1 - issued1 >= 0.02, (early, late)
