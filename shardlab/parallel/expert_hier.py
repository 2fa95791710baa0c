"""Hierarchical expert dispatch (``parallel.ep_dispatch = hierarchical``): a token crosses the slow
tier between nodes at most once per destination node and is forwarded to its experts inside that
node over the fast tier; the combine reverses both hops (DeepEP's "asymmetric bandwidth
forwarding"; docs/expert-parallel.md, "Two tiers", with a worked example).

Ep rank (node b, local l) talks over the slow tier only to the ranks with local index l on the
other nodes (``ep_inter``) and over the fast tier to its node's ep ranks (``ep_intra``). The steps
of :func:`hierarchical_moe`: 1. the (node, token) pairs of the kept assignments, node-major, and
the counts of both hops (:class:`Route`), exchanged first, one small exchange per tier for all
the chunks of an overlapped layer (:func:`exchange_counts`): the slow tier carries each pair count
with the assignments per expert slot, so a forwarder knows what it passes on before the rows come;
2. slow hop: each pair's row with the token's k gates and k expert ids as extra columns;
3. fast hop: one row per assignment to its expert's rank; 4. the experts; 5. fast hop back, the
gate-weighted sum per pair; 6. slow hop back, the sum over nodes. Exact split sizes (one host
read for both count exchanges); the gradient is autograd's through the same exchanges. Equal to
the flat dispatch up to the order of the sums over a token's experts
(tests/distributed/test_expert_hier.py, float64, 1e-10).
"""
from __future__ import annotations

import time

import torch

from ..distributed.autograd import all_to_all
from ..distributed.lanes import exchange
from ..models.moe import count


class Hierarchy:
    """Where each expert lives in two-tier coordinates, and the two communicators."""

    def __init__(self, mesh, n_experts: int):
        self.intra, self.inter = mesh.comm("ep_intra"), mesh.comm("ep_inter")
        ep_ranks = mesh.ranks("ep")
        node = {g: mesh.node_of(g) for g in ep_ranks}
        order = sorted(set(node.values()))
        local = {g: [h for h in ep_ranks if node[h] == node[g]].index(g) for g in ep_ranks}
        self.N, self.L = self.inter.size, self.intra.size
        if self.N * self.L != len(ep_ranks) or self.N != len(order):
            raise ValueError(f"hierarchical dispatch: ep group {ep_ranks} is not {len(order)} nodes x "
                             f"{len(ep_ranks) // len(order)} ranks (topology.py groups ep_inter / ep_intra)")
        # the communicators' rank order is the tiers' order: node b in ep_inter, local l in ep_intra
        assert [order.index(node[g]) for g in self.inter.ranks] == list(range(self.N))
        assert [local[g] for g in self.intra.ranks] == list(range(self.L))
        per_rank = n_experts // len(ep_ranks)
        q = torch.arange(n_experts) // per_rank
        self.exp_node = torch.tensor([order.index(node[ep_ranks[i]]) for i in q.tolist()])
        self.exp_local = torch.tensor([local[ep_ranks[i]] for i in q.tolist()])
        self.per_rank = per_rank


_EXACT_INTS = {torch.float64: 2**53, torch.float32: 2**24, torch.float16: 2**11, torch.bfloat16: 2**8}
"""Integers up to these are exact in each dtype: expert ids ride in the row's own message."""


class _WithIds(torch.autograd.Function):
    """The slow hop's all-to-all of rows with the expert ids as trailing columns: forward sends
    ``[rows | ids]``, backward returns the gradient of ``rows`` only (the ids have none: the
    transpose exchange would carry k zero columns per row back over the slow tier)."""

    @staticmethod
    def forward(ctx, rows, ids, comm, ins, outs):
        ctx.comm, ctx.ins, ctx.outs, ctx.width = comm, ins, outs, rows.shape[1]
        return exchange(comm, torch.cat([rows, ids], 1), ins, outs)

    @staticmethod
    def backward(ctx, g):
        return exchange(ctx.comm, g[:, :ctx.width].contiguous(), ctx.outs, ctx.ins), None, None, None, None


class Route:
    """One piece of tokens' two-tier routing on this rank, before any transfer (step 1 of the module
    doc): the (node, token) pairs, node-major, and the counts both hops need, so that one exchange
    per tier (:func:`exchange_counts`) sizes every hop of every piece. ``counts`` (N, 1 + L *
    per_rank): per destination node, the pairs sent there, then the kept assignments per expert
    slot of that node (local rank l, expert e % per_rank), from which the forwarder there knows
    what it passes to each local rank before the rows arrive."""

    def __init__(self, layer, h: Hierarchy, r, T: int, dev):
        k, N = layer.top_k, h.N
        self.expert, self.keep = r.expert.view(k, T), r.keep.view(k, T)
        enode = h.exp_node.to(dev)[self.expert]                       # (k, T) node of each assignment
        hit = torch.zeros(N, T, dtype=torch.bool, device=dev)
        hit.view(-1).index_fill_(0, (enode * T + torch.arange(T, device=dev))[self.keep], True)
        self.pb, self.pt = hit.nonzero(as_tuple=True)                  # pair p: node pb[p], token pt[p]
        self.on = self.keep[:, self.pt] & (enode[:, self.pt] == self.pb)  # (k, P): assignment j of pair p here
        S = h.L * h.per_rank
        slot = h.exp_local.to(dev)[self.expert] * h.per_rank + self.expert % h.per_rank
        per_slot = count((enode * S + slot)[self.keep], N * S).view(N, S)
        self.counts = torch.cat([hit.sum(1, keepdim=True), per_slot], 1)


def exchange_counts(h: Hierarchy, routes: list[Route]) -> None:
    """Size both hops of every piece in ``routes`` with one count exchange per tier (the slow one
    carries each piece's pairs and per-slot assignments, the fast one what each forwarder passes
    on), and one host read for all; sets ``ins1``/``outs1`` (slow hop splits), ``ins2``/``outs2``
    (fast hop) and ``recv`` (L, per_rank: rows arriving from each local rank, per local expert)."""
    n, S = len(routes), 1 + h.L * h.per_rank
    send = torch.stack([ro.counts for ro in routes], 1)                        # (N, n, S)
    got = exchange(h.inter, send.reshape(h.N, -1).contiguous()).view(h.N, n, S)
    fwd = got[:, :, 1:].sum(0).view(n, h.L, h.per_rank).transpose(0, 1)       # (L, n, per_rank) forwarded
    recv = exchange(h.intra, fwd.reshape(h.L, -1).contiguous()).view(h.L, n, h.per_rank)
    splits = torch.cat([send[:, :, 0], got[:, :, 0], fwd.sum(2), recv.sum(2)]).t().tolist()  # the host read
    for c, ro in enumerate(routes):  # splits[c]: N sent, N received, L passed on, L arriving
        col = splits[c]
        ro.ins1, ro.outs1 = col[:h.N], col[h.N:2 * h.N]
        ro.ins2, ro.outs2 = col[2 * h.N:2 * h.N + h.L], col[2 * h.N + h.L:]
        ro.recv = recv[:, c]


def _slow_hop(comm, rows: torch.Tensor, ids: torch.Tensor | None, ins, outs):
    """The slow hop's rows, with ``ids`` as extra columns that get no gradient."""
    if ids is not None and comm.size > 1:
        return _WithIds.apply(rows, ids, comm, ins, outs)
    return all_to_all(rows if ids is None else torch.cat([rows, ids], 1), comm, ins, outs)


def hierarchical_moe(layer, h: Hierarchy, x: torch.Tensor, r, capacity: int, ro: Route | None = None) -> torch.Tensor:
    """The MoE output (T, D) of the tokens ``x`` routed as ``r`` (models/moe.py Routing), through
    the two hops of the module doc. ``layer``: the ExpertParallelMoE (its local experts, timing);
    ``ro``: the tokens' Route with its counts exchanged (chunks, parallel/expert_overlap.py), or
    None to route and exchange them here."""
    t0 = time.perf_counter()
    T, D = x.shape
    k, N, dev = layer.top_k, h.N, x.device
    if ro is None:
        ro = Route(layer, h, r, T, dev)
        exchange_counts(h, [ro])
    pb, pt, on = ro.pb, ro.pt, ro.on
    # 2. slow hop: row + k gate weights (as columns, in x's dtype like the flat combine) + the k ids
    w = (r.weight.view(k, T)[:, pt] * on).t().to(x.dtype)           # (P, k)
    ids = torch.where(on, ro.expert[:, pt], -1).t()
    inline = layer.n_experts <= _EXACT_INTS.get(x.dtype, 0)          # ids exact in x's dtype: one message
    payload = torch.cat([x.index_select(0, pt), w], 1)
    got = _slow_hop(h.inter, payload, ids.to(x.dtype) if inline else None, ro.ins1, ro.outs1)
    got_ids = (got[:, D + k:].detach().round() if inline else
               exchange(h.inter, ids.to(torch.int32).contiguous(), ro.ins1, ro.outs1)).long()
    xr, wr = got[:, :D], got[:, D:D + k]                             # R received pairs
    # 3. fast hop: one row per assignment, sorted by (owner's local index, expert)
    R = got.shape[0]
    valid = got_ids >= 0                                              # (R, k)
    e = got_ids.clamp(min=0)
    key = torch.where(valid, h.exp_local.to(dev)[e] * layer.n_experts + e, h.L * layer.n_experts).view(-1)
    sel = torch.argsort(key, stable=True)[:sum(ro.ins2)]             # assignment i*k+j, sorted
    rows = xr.index_select(0, sel // k)
    arrived = all_to_all(rows, h.intra, ro.ins2, ro.outs2)
    # 4. experts on rows regrouped from (source, expert) to (expert, source), as the flat dispatch
    L, n_local = h.L, h.per_rank
    block = torch.arange(L * n_local, device=dev).view(L, n_local)
    bkey = torch.repeat_interleave(((block % n_local) * L + block // n_local).flatten(), ro.recv.flatten(),
                                   output_size=arrived.shape[0])
    perm = torch.argsort(bkey, stable=True)
    t1 = time.perf_counter()
    y = layer.experts(arrived.index_select(0, perm), ro.recv.sum(0), layer.ep.size * capacity)
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=dev)
    y = y.index_select(0, back)
    t2 = time.perf_counter()
    # 5. fast hop back; per pair, the gate-weighted sum of its assignments here (segments in pair order)
    y = all_to_all(y, h.intra, ro.outs2, ro.ins2)
    order = torch.argsort(sel)                                       # assignment i*k+j, by (pair i, j)
    gates = wr[valid].unsqueeze(1)                                   # the same (pair, j) order
    z = y.index_select(0, order) * gates                            # no pair here: empty, still in the graph
    z = torch.segment_reduce(z, "sum", lengths=valid.sum(1), axis=0) if R else z
    # 6. slow hop back, sum over nodes
    z = all_to_all(z, h.inter, ro.outs1, ro.ins1)
    out = z.new_zeros(N * T, D).index_copy(0, pb * T + pt, z)
    layer._time(t0, t1, t2, time.perf_counter())
    return out.view(N, T, D).sum(0)
