"""Expert parallel with its all-to-alls overlapped with the experts' compute (``parallel.ep_overlap
= n``; docs/expert-parallel.md, "Overlap").

The tokens are routed together, then their assignments go in n chunks by token: every chunk's
dispatch and combine is an asynchronous collective, so one chunk's transfer runs while another
chunk's experts compute (forward: per chunk wait its dispatch, start the next chunk's, experts,
start its combine; wait the combines. The backward mirrors it, the experts' backward an inner
``torch.autograd.backward`` as activation checkpointing does). At most (n-1)/n of the transfer
time can hide. The hierarchical dispatch overlaps the same way in lanes
(:func:`hierarchical_overlapped`, distributed/lanes.py), both hops of every chunk sized by one
count exchange per tier before the lanes start. Equal to the layer without overlap up to
the order of the expert gradients' sums (tests/distributed/test_expert_hier.py, float64, 1e-10).
"""
from __future__ import annotations

import torch

from ..distributed.lanes import Lanes, start_all_to_all, wait as _wait
from ..models.moe import Routing, chunk_bounds
from .expert_hier import Route, exchange_counts, hierarchical_moe


class _Chunk:
    """One chunk's routing on this rank: its rows' splits and the regrouping of received rows."""

    def __init__(self, layer, send: torch.Tensor, recv: torch.Tensor):
        ep, n_local = layer.ep.size, layer.n_local
        self.ins, self.outs = send.sum(1).tolist(), recv.sum(1).tolist()   # this chunk's host read
        self.n = sum(self.ins)
        block = torch.arange(ep * n_local, device=recv.device).view(ep, n_local)
        key = torch.repeat_interleave(((block % n_local) * ep + block // n_local).flatten(), recv.flatten(),
                                      output_size=sum(self.outs))
        self.perm = torch.argsort(key, stable=True)
        self.back = torch.empty_like(self.perm)
        self.back[self.perm] = torch.arange(self.perm.numel(), device=recv.device)
        self.local_counts = recv.sum(0)


def _arrivals(layer, rows, chunks):
    """Each chunk's rows as they arrive, chunk by chunk: chunk c's transfer starts once chunk
    c - 1's has arrived, before chunk c - 1 computes, so one is in flight beside the previous
    chunk's combine. All n at once would share the transport between them (gloo moves concurrent
    all-to-alls together), so the first chunk's would arrive last. The issue order (d0, d1, c0,
    d2, c1, ...) is the same on every rank."""
    start = lambda c: start_all_to_all(layer.ep, rows[c], chunks[c].ins, chunks[c].outs)  # noqa: E731
    nxt = start(0)
    for c in range(len(chunks)):
        work, got = nxt
        _wait(work)
        if c + 1 < len(chunks):
            nxt = start(c + 1)
        yield got


class _Overlapped(torch.autograd.Function):
    """The kept rows of each chunk (grouped by expert) -> their expert outputs, with the
    transfers of one chunk overlapping another's compute (module doc)."""

    @staticmethod
    def forward(ctx, layer, chunks, capacity, n, *tensors):
        """``tensors``: the n chunks' rows, then the local experts' parameters (inputs only so
        that the outputs need a gradient whenever they do; their gradients accumulate in the
        inner backward)."""
        ctx.layer, ctx.chunks, ctx.n = layer, chunks, n
        inputs, outputs, combines = [], [], []
        for h, got in zip(chunks, _arrivals(layer, tensors, chunks)):
            x = got.detach().requires_grad_()
            with torch.enable_grad():
                y = layer.experts(x[h.perm], h.local_counts, layer.ep.size * capacity)[h.back]
            inputs.append(x)
            outputs.append(y)
            combines.append(start_all_to_all(layer.ep, y.detach(), h.outs, h.ins))
        ctx.inputs, ctx.outputs = inputs, outputs
        result = []
        for work, out in combines:
            _wait(work)
            result.append(out)
        return tuple(result)

    @staticmethod
    def backward(ctx, *grads_out):
        layer, chunks, n = ctx.layer, ctx.chunks, ctx.n
        rows_grad = any(ctx.needs_input_grad[4:4 + n])  # the same on every rank
        back = []
        for h, x, y, g in zip(chunks, ctx.inputs, ctx.outputs, _arrivals(layer, grads_out, chunks)):
            torch.autograd.backward(y, g)
            if rows_grad:
                grad = x.grad if x.grad is not None else torch.zeros_like(x)
                back.append(start_all_to_all(layer.ep, grad, h.outs, h.ins))
        grads = [None] * n
        for i, (work, out) in enumerate(back):
            _wait(work)
            grads[i] = out
        ctx.inputs = ctx.outputs = None
        return (None,) * 4 + tuple(grads) + (None,) * (len(ctx.needs_input_grad) - 4 - n)


def overlapped_experts(layer, x: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """``x``: the rows of chunk 0 (``k * T_0``: its kept rows by expert, then its dropped ones),
    then those of chunk 1, ...; chunk c holds tokens ``chunk_bounds(T, n)[c:c + 2]`` (models/moe.py:
    the end chunks half the size of the others); ``counts`` (n, E):
    kept rows per expert of each chunk. Returns the expert outputs in the same row order, zeros
    for dropped rows."""
    n, k = counts.shape[0], layer.top_k
    T = x.shape[0] // k
    send = counts.view(n, layer.ep.size, layer.n_local).transpose(0, 1)  # (ep, n, n_local): per destination
    recv = layer.ep.all_to_all(send.reshape(layer.ep.size, -1)).view(send.shape)  # one count exchange for all
    chunks = [_Chunk(layer, send[:, c], recv[:, c]) for c in range(n)]
    starts = [k * b for b in chunk_bounds(T, n)]  # first row of each chunk
    rows = [x[starts[c]:starts[c] + h.n] for c, h in enumerate(chunks)]
    ys = _Overlapped.apply(layer, chunks, capacity, n, *rows, *layer.experts.parameters())
    parts = []
    for c, (y, h) in enumerate(zip(ys, chunks)):
        parts += [y, x.new_zeros(starts[c + 1] - starts[c] - h.n, x.shape[1])]
    return torch.cat(parts)


class _HierChunks(torch.autograd.Function):
    """The hierarchical layer's output for routed tokens, chunk c of the tokens in lane c."""

    @staticmethod
    def forward(ctx, layer, h, r, capacity, n, x, weight, *params):
        """``weight``: the routing's gate weights (k*T, j-major); ``params``: the local experts'
        (inputs only so that the output needs a gradient whenever they do)."""
        T, k = x.shape[0], layer.top_k
        ctx.bounds = bounds = chunk_bounds(T, n)
        need_x, need_w = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
        pieces = []
        for c in range(n):
            a, b = bounds[c], bounds[c + 1]
            xc = x[a:b].detach().requires_grad_(need_x)
            wc = weight.view(k, T)[:, a:b].detach().requires_grad_(need_w)
            with torch.enable_grad():  # the gates' reshape too: it must reach wc's gradient
                rc = Routing(r.expert.view(k, T)[:, a:b].reshape(-1), None, wc.reshape(-1),
                             r.keep.view(k, T)[:, a:b].reshape(-1))
            pieces.append((xc, wc, rc, Route(layer, h, rc, b - a, x.device)))
        exchange_counts(h, [p[3] for p in pieces])  # every chunk's hops sized at once, before the lanes

        def lane(c):
            xc, wc, rc, ro = pieces[c]
            with torch.enable_grad():
                return xc, wc, hierarchical_moe(layer, h, xc, rc, capacity, ro)
        ctx.lanes = Lanes()
        ctx.chunks = ctx.lanes.run(*[(lambda c=c: lane(c)) for c in range(n)])
        return torch.cat([y.detach() for _, _, y in ctx.chunks])

    @staticmethod
    def backward(ctx, g):
        bounds = ctx.bounds

        def lane(c):
            xc, wc, y = ctx.chunks[c]
            if y.requires_grad:
                torch.autograd.backward(y, g[bounds[c]:bounds[c + 1]])
            zero = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731 (unused chunk)
            return zero(xc), zero(wc)
        grads = ctx.lanes.run(*[(lambda c=c: lane(c)) for c in range(len(ctx.chunks))])
        ctx.chunks = None
        gx = torch.cat([gx for gx, _ in grads]) if ctx.needs_input_grad[5] else None
        gw = torch.cat([gw for _, gw in grads], 1).reshape(-1) if ctx.needs_input_grad[6] else None
        return (None,) * 5 + (gx, gw) + (None,) * (len(ctx.needs_input_grad) - 7)


def hierarchical_overlapped(layer, h, x: torch.Tensor, r, capacity: int, n: int) -> torch.Tensor:
    """The hierarchical dispatch of ``x`` (T, D) routed as ``r``, in ``n`` chunks of the tokens
    whose transfers overlap each other's compute (module doc)."""
    return _HierChunks.apply(layer, h, r, capacity, n, x, r.weight, *layer.experts.parameters())
