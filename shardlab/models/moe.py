"""Mixture-of-Experts feed-forward (single device; nothing here imports torch.distributed).

Each token picks ``top_k`` of ``n_experts`` SwiGLU experts with a linear router:

  probs = softmax(x W_r^T)                    (T, E)
  gate, idx = top_k(probs)                    k = 1: gate = the raw probability (Switch);
                                              k > 1: gates renormalised to sum to 1 (Mixtral)
  y_t = sum_j gate_tj * expert_{idx_tj}(x_t)  (dropped assignments contribute 0; the block's
                                               residual carries the token through)

Capacity (``moe_capacity_factor`` > 0): every expert takes at most
``C = ceil(factor * T * top_k / n_experts)`` assignments of the ``T`` tokens of one forward call
(one rank's tokens: a "group" in GShard's words). Drop order is deterministic: assignments are
ranked first by choice (every token's first choice before any second choice), then by token
index (flattened batch x sequence order); an expert keeps the first C it receives in that order.
``moe_capacity_factor = 0`` is dropless: every assignment is computed.

Auxiliary losses, stored in ``self.last_aux_loss`` (``Llama.aux_loss`` adds them to the loss):
  Switch load balance  aux_coef * E * sum_e f_e * P_e,  f_e = share of assignments routed to e
                       (before capacity), P_e = mean router probability of e
  router z-loss        z_coef * mean_t (logsumexp_e logits_te)^2
Both are means over the whole batch: :meth:`batch_sum` (identity here) is where expert parallel
adds the statistics of the other data-parallel ranks, so a sharded run equals this module on the
global batch. Per-step statistics are kept in ``self.last_stats`` (tokens per expert, dropped
fraction) for the metrics.

Expert weights are stacked parameters ``experts.w1`` / ``experts.w3`` (E, H, D) and
``experts.w2`` (E, D, H) with global names, so ``init_tensor`` initialises them the same under
every layout and expert parallel keeps rows [start, start + E/ep) of dim 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn



class Experts(nn.Module):
    """``n`` SwiGLU experts with stacked weights. ``forward(x, counts)``: the rows of ``x`` are
    grouped by expert, ``counts[e]`` rows for expert e, in order."""

    def __init__(self, n: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n, d_model, hidden))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(counts):
            xe = x[start:start + n]
            start += n
            outs.append(F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e]))
        return torch.cat(outs) if outs else x[:0]


class Routing:
    """The router's decision for T tokens, as k*T assignments in priority order (j-major)."""

    def __init__(self, expert, token, weight, keep):
        self.expert, self.token, self.weight, self.keep = expert, token, weight, keep


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coef, self.z_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.ffn_dim)
        self.last_aux_loss = 0.0
        self.last_stats: dict = {}

    # -- hooks that expert parallel overrides --------------------------------------------------
    def batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over every rank holding other tokens of the batch (differentiably)."""
        return t

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` grouped by global expert (``counts[e]`` each) -> expert outputs, same order."""
        return self.experts(x, counts.tolist())

    # -- routing ---------------------------------------------------------------------------------
    def capacity(self, n_tokens: int) -> int:
        """Assignments each expert may take (0 = unlimited)."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def route(self, x: torch.Tensor) -> Routing:
        T, E, k = x.shape[0], self.n_experts, self.top_k
        logits = self.router(x)
        lf = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        probs = lf.softmax(-1)
        gate, idx = probs.topk(k, dim=-1)                                 # (T, k)
        if k > 1:
            gate = gate / gate.sum(-1, keepdim=True)
        expert = idx.t().reshape(-1)                                      # priority order: choice, token
        token = torch.arange(T, device=x.device).repeat(k)
        weight = gate.t().reshape(-1)
        counts = torch.bincount(expert, minlength=E)
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
                         torch.tensor([float(T)], dtype=lf.dtype, device=x.device)])
        vec = self.batch_sum(vec)
        prob_sum, z_sum, g_counts, g_dropped, g_tokens = vec[:E], vec[E], vec[E + 1:2 * E + 1], vec[-2], vec[-1]
        f = g_counts / (g_tokens * k)
        balance = E * (f * prob_sum / g_tokens).sum()
        z = z_sum / g_tokens
        self.last_aux_loss = self.aux_coef * balance + self.z_coef * z
        with torch.no_grad():
            self.last_stats = {"tokens_per_expert": g_counts.round().long().cpu(),
                               "dropped_fraction": float(g_dropped / (g_tokens * k)),
                               "balance_loss": float(balance), "z_loss": float(z)}
        return Routing(expert, token, weight, keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.route(x)
        kept = torch.nonzero(r.keep).squeeze(1)
        sel = kept[torch.argsort(r.expert[kept], stable=True)]             # grouped by expert
        counts = torch.bincount(r.expert[sel], minlength=self.n_experts)
        y = self.run_experts(x[r.token[sel]], counts)
        # combine in x's dtype (under autocast the experts return bf16/fp16, x is fp32)
        out = torch.zeros_like(x).index_add(0, r.token[sel], y.to(x.dtype) * r.weight[sel, None].to(x.dtype))
        self.last_routing = r
        return out.view(shape)
