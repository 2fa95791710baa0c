"""Mixture-of-Experts feed-forward (single device; nothing here imports torch.distributed): a linear
router sends each token to ``top_k`` of ``n_experts`` SwiGLU experts (k = 1: the raw probability,
Switch; k > 1: gates renormalised, Mixtral; node-limited routing with ``moe_node_groups`` /
``moe_max_nodes``, DeepSeek-V3), an optional capacity with a deterministic drop order, the Switch
load-balance and router z-loss (``self.last_aux_loss``; :meth:`batch_sum` is where expert parallel
adds the other ranks' statistics), and no host read on the grouped path. Expert weights are stacked
global parameters ``experts.w1`` / ``experts.w3`` (E, H, D) and ``experts.w2`` (E, D, H). The
formulas, the drop order and the host reads: docs/expert-parallel.md ("The MoE layer").
"""
from __future__ import annotations

import math
from collections import namedtuple

import torch
from torch import nn

from .moe_gemm import expert_ffn
from .spec import ffn_dim


def expert_capacity(factor: float, n_tokens: int, top_k: int, n_experts: int) -> int:
    """Assignments each expert may take of ``n_tokens`` routed tokens: ceil(factor T k / E);
    0 = unlimited (dropless, ``factor`` 0)."""
    return math.ceil(factor * n_tokens * top_k / n_experts) if factor > 0 else 0


def count(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in ``index``: ``bincount`` without its host read (CUDA's
    ``bincount`` reads the maximum to size its output); integer adds, so exact in any order."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(0, index, torch.ones_like(index))


def limit_groups(probs: torch.Tensor, groups: int, max_groups: int, top_k: int) -> torch.Tensor:
    """``probs`` (T, E) with every expert outside each token's top ``max_groups`` of ``groups``
    contiguous expert groups set to 0; a group's score is the sum of its best
    ``ceil(top_k / max_groups)`` probabilities (DeepSeek-V3's node-limited routing)."""
    T, E = probs.shape
    per = min(math.ceil(top_k / max_groups), E // groups)
    score = probs.detach().view(T, groups, E // groups).topk(per, -1).values.sum(-1)     # (T, G)
    chosen = torch.zeros(T, groups, dtype=torch.bool, device=probs.device)
    chosen.scatter_(1, score.topk(max_groups, -1).indices, True)
    return probs.masked_fill(~chosen.repeat_interleave(E // groups, 1), 0.0)


class Experts(nn.Module):
    """``n`` SwiGLU experts with stacked weights. ``forward(x, counts)``: the rows of ``x`` are
    grouped by expert, ``counts[e]`` rows for expert e, in order (a tensor); rows past
    ``counts.sum()`` come back as zeros. ``impl``: the kernel (models/moe_gemm.py)."""

    def __init__(self, n: int, d_model: int, hidden: int, impl: str = "grouped"):
        super().__init__()
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(n, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n, d_model, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, capacity: int = 0) -> torch.Tensor:
        """``capacity``: a bound on every count (0 = none), which fixes the padded kernel's shapes."""
        return expert_ffn(x, counts, self.w1, self.w3, self.w2, self.impl, capacity=capacity)


Routing = namedtuple("Routing", "expert token weight keep")
"""The router's decision for T tokens, as k*T assignments in priority order (j-major)."""


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.node_groups, self.max_nodes = getattr(cfg, "moe_node_groups", 0), getattr(cfg, "moe_max_nodes", 0)
        self.aux_coef, self.z_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, ffn_dim(cfg), getattr(cfg, "moe_impl", "grouped"))
        self.last_aux_loss = 0.0
        self._stats: dict = {}
        self.split = 1
        """n > 1: group the rows by chunk of the tokens first, counts (n, E) (parallel/expert_overlap.py)."""

    @property
    def last_stats(self) -> dict:
        """Statistics of the last forward as Python numbers (read on the host here, never
        during the forward): tokens per expert, dropped fraction, balance and z losses."""
        st = self._stats
        if not st:
            return {}
        return {"tokens_per_expert": st["tokens_per_expert"].round().long().cpu(),
                **{k: float(st[k]) for k in ("dropped_fraction", "balance_loss", "z_loss")}}

    # -- hooks that expert parallel overrides --------------------------------------------------
    def batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over every rank holding other tokens of the batch (differentiably)."""
        return t

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor, capacity: int = 0) -> torch.Tensor:
        """Rows of ``x`` grouped by global expert (``counts[e]`` each, a tensor, at most
        ``capacity`` where that is not 0) -> expert outputs, same order; rows past
        ``counts.sum()`` (dropped assignments) -> zeros."""
        return self.experts(x, counts, capacity)

    # -- routing ---------------------------------------------------------------------------------
    def capacity(self, n_tokens: int) -> int:
        """Assignments each expert may take (0 = unlimited)."""
        return expert_capacity(self.capacity_factor, n_tokens, self.top_k, self.n_experts)

    def route(self, x: torch.Tensor) -> Routing:
        T, E, k = x.shape[0], self.n_experts, self.top_k
        logits = self.router(x)
        lf = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        probs = lf.softmax(-1)
        pick = probs
        if 0 < self.max_nodes < self.node_groups:
            pick = limit_groups(probs, self.node_groups, self.max_nodes, k)
        gate, idx = pick.topk(k, dim=-1)                                  # (T, k)
        if k > 1:
            gate = gate / gate.sum(-1, keepdim=True)
        expert = idx.t().reshape(-1)                                      # priority order: choice, token
        token = torch.arange(T, device=x.device).repeat(k)
        weight = gate.t().reshape(-1)
        counts = count(expert, E)
        keep = torch.ones_like(expert, dtype=torch.bool)
        cap = self.capacity(T)
        if cap:
            # position of each assignment inside its expert's queue, in priority order
            order = torch.argsort(expert, stable=True)
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.empty_like(expert)
            pos[order] = torch.arange(expert.numel(), device=x.device) - starts[expert[order]]
            keep = pos < cap
        # batch-wide statistics in one vector (one all-reduce under expert parallel)
        dropped = (~keep).sum()
        vec = torch.cat([probs.sum(0), torch.logsumexp(lf, -1).pow(2).sum()[None],
                         counts.to(lf.dtype), dropped.to(lf.dtype)[None],
                         lf.new_full((1,), float(T))])
        vec = self.batch_sum(vec)
        prob_sum, z_sum, g_counts, g_dropped, g_tokens = vec[:E], vec[E], vec[E + 1:2 * E + 1], vec[-2], vec[-1]
        f = g_counts / (g_tokens * k)
        balance = E * (f * prob_sum / g_tokens).sum()
        z = z_sum / g_tokens
        self.last_aux_loss = self.aux_coef * balance + self.z_coef * z
        self._stats = {"tokens_per_expert": g_counts.detach(), "dropped_fraction": (g_dropped / (g_tokens * k)).detach(),
                       "balance_loss": balance.detach(), "z_loss": z.detach()}
        return Routing(expert, token, weight, keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.route(x)
        # group by expert with the dropped assignments last: shapes never depend on the routing
        # (no host read); the experts return zeros for the dropped rows, weighted by 0 anyway
        key = torch.where(r.keep, r.expert, self.n_experts)
        if self.split > 1:  # chunks of the tokens, chunk-major (expert parallel's overlap)
            key = key + chunk_of(r.token, x.shape[0], self.split) * (self.n_experts + 1)
        sel = torch.argsort(key, stable=True)                 # row i of the experts' input: assignment sel[i]
        inv = torch.empty_like(sel)
        inv[sel] = torch.arange(sel.numel(), device=sel.device)
        counts = count(key, self.split * (self.n_experts + 1)).view(self.split, -1)[:, :self.n_experts]
        counts = counts[0] if self.split == 1 else counts
        y = self.run_experts(_Spread.apply(x, sel, inv, self.top_k), counts, self.capacity(x.shape[0]))
        # combine in x's dtype (under autocast the experts return bf16/fp16, x is fp32)
        w = (r.weight * r.keep)[sel, None].to(x.dtype)
        out = _Collect.apply(y.to(x.dtype) * w, sel, inv, self.top_k)
        self.last_routing = r
        return out.view(shape)


def chunk_bounds(T: int, n: int) -> list[int]:
    """The first token of each of n chunks of T tokens, and T (expert parallel's overlap,
    parallel/expert_overlap.py): the two end chunks half the size of the others (weights 1, 2,
    ..., 2, 1), since only the first chunk's dispatch and the last one's combine have no compute
    beside them; two chunks are halves."""
    w = [1] + [2] * (n - 2) + [1] if n > 2 else [1] * n
    total, acc, out = sum(w), 0, [0]
    for x in w:
        acc += x
        out.append(T * acc // total)
    return out


def chunk_of(token: torch.Tensor, T: int, n: int) -> torch.Tensor:
    """The chunk (:func:`chunk_bounds`) of each token index in ``token``."""
    inner = torch.tensor(chunk_bounds(T, n)[1:-1], device=token.device, dtype=token.dtype)
    return torch.bucketize(token, inner, right=True)


# Token t's k assignments are t, T + t, ..., (k-1) T + t (priority order); sorted by expert,
# assignment a sits at row inv[a] and row i holds assignment sel[i]. Spreading the tokens to
# the sorted rows and collecting the rows back to the tokens are adjoint, so each one's backward
# is the other: a gather and a sum over k, never a scatter-add (index_add) into the tokens.
class _Spread(torch.autograd.Function):
    """(T, D) tokens -> (kT, D) rows sorted by expert: ``x[sel % T]``."""

    @staticmethod
    def forward(ctx, x, sel, inv, k):
        ctx.save_for_backward(sel, inv)
        ctx.k = k
        return x.index_select(0, sel % x.shape[0])

    @staticmethod
    def backward(ctx, g):
        sel, inv = ctx.saved_tensors
        return _Collect.apply(g, sel, inv, ctx.k), None, None, None


class _Collect(torch.autograd.Function):
    """(kT, D) rows sorted by expert -> (T, D): token t sums the rows of its k assignments."""

    @staticmethod
    def forward(ctx, rows, sel, inv, k):
        ctx.save_for_backward(sel, inv)
        ctx.k = k
        return rows.index_select(0, inv).view(k, -1, rows.shape[1]).sum(0)

    @staticmethod
    def backward(ctx, g):
        sel, inv = ctx.saved_tensors
        return _Spread.apply(g, sel, inv, ctx.k), None, None, None
