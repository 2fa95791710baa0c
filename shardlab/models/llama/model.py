"""Llama-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention, optional
tied embeddings, attention through ``scaled_dot_product_attention``. Single-device code:
nothing here imports torch.distributed. Parallel modules swap submodules by name (the
TP_PLAN in ``__init__.py``), so the names below are part of the contract:

  tok_embeddings, layers.<i>.attention_norm, layers.<i>.attention.{wq,wk,wv,wo,core},
  layers.<i>.ffn_norm, layers.<i>.feed_forward.{w1,w2,w3}, norm, output, criterion

``layers`` is a ModuleDict keyed by the global layer index, so a pipeline stage that keeps
layers 4..7 still names them ``layers.4`` ... (global names = checkpoint keys).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn



class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight

    @torch.no_grad()
    def weight_grad(self, x, g):
        """d loss / d weight given the output gradient ``g``, without autograd (the deferred W of
        a zero-bubble pipeline schedule, docs/pipeline.md)."""
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return {"weight": (g * out).reshape(-1, g.shape[-1]).sum(0)}


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle pos * theta^(-2i/d). x: (B, S, H, D); positions: (S,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]          # (S, D/2)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = angles.cos().to(dtype)[None, :, None, :], angles.sin().to(dtype)[None, :, None, :]
    xr = x.to(dtype).reshape(*x.shape[:-1], d // 2, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.reshape(x.shape).to(x.dtype)


class SDPA(nn.Module):
    """Attention core: softmax(q k^T / sqrt(d)) v. ``kind`` (model.attention): ``sdpa`` calls
    PyTorch's fused kernel (flash/efficient: the scores are never stored); ``math`` computes the
    product, the causal mask, the softmax and attention dropout ``p`` as separate operators, so the
    (S x S) scores are materialised and saved for backward, as GPT-2 and Megatron-LM (2021) ran.
    Context parallel replaces this module (ring) or wraps it (Ulysses)."""

    def __init__(self, kind: str = "sdpa", p: float = 0.0):
        super().__init__()
        self.kind, self.p = kind, p

    def forward(self, q, k, v, causal: bool = True):
        # q: (B, Hq, S, D); k, v: (B, Hkv, S, D). Repeat kv heads for grouped-query attention.
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        if causal:  # query i sees keys 0..i (top-left aligned, as the fused kernel's is_causal)
            s, t = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(s, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        probs = F.dropout(torch.softmax(scores, dim=-1), self.p, self.training)
        return torch.matmul(probs, v)


def cached_attention(core, q, k, v, cache):
    """Attention of s new queries (B, Hq, s, D) over a layer cache's keys/values plus their own
    (``cache.update(k, v) -> (k_all, v_all)``, models/generate.py): causal with the query block
    aligned to the end of the keys. Head counts are read from the tensors, so a tensor-parallel
    shard (local query and kv heads) runs the same code. Returns (B, s, Hq * D)."""
    b, _, s, _ = q.shape
    k, v = cache.update(k, v)
    past = k.shape[2] - s
    if past == 0:
        out = core(q, k, v, causal=True)
    elif s == 1:
        out = core(q, k, v, causal=False)  # one new token sees every key
    else:
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.core = SDPA(cfg.attention)

    def forward(self, x, positions, cache=None):
        """``cache`` (generation only): a per-layer cache with ``update(k, v) -> (k_all, v_all)``
        over (B, H, S, D) tensors (models/generate.py); training passes none."""
        b, s, _ = x.shape
        # Head counts are read from the projection sizes so that a tensor-parallel shard
        # (fewer local heads) runs this same code.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        if cache is not None:
            return self.wo(cached_attention(self.core, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            cache))
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = cfg.n_experts > 0 and layer_id % cfg.moe_every == cfg.moe_every - 1
        if self.is_moe:
            from ..moe import MoE  # the MoE feed-forward (expert-parallel issue)
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.d_model, cfg.ffn_dim)

    def forward(self, x, positions, cache=None):
        a = self.attention_norm(x)
        x = x + (self.attention(a, positions) if cache is None else self.attention(a, positions, cache))
        return x + self.feed_forward(self.ffn_norm(x))


class OutputHead(nn.Linear):
    """The vocabulary projection (logits = h W^T). On CUDA a vocabulary that is not a multiple of
    ``ALIGN`` rows (GPT-2's 50257) gives logits whose rows start at unaligned addresses, and cuBLAS
    then falls back to slow kernels for all three products of the head (measured on an H200:
    31 ms of an 80 ms GPT-2 step; docs/gpu.md). There the weight is padded with
    zero rows to a multiple of ``ALIGN`` and the logits are a view of the first ``vocab`` columns:
    same values, no new parameter, checkpoints unchanged. Elsewhere (CPU) it is ``nn.Linear``.
    Its weight gradient is a plain linear's (pipeline/wgrad.py computes it directly)."""

    ALIGN = 64
    pad_devices = ("cuda",)
    plain_linear_grads = True

    def forward(self, x):
        v = self.weight.shape[0]
        pad = -v % self.ALIGN if x.device.type in self.pad_devices else 0
        if not pad:
            return F.linear(x, self.weight, self.bias)
        b = None if self.bias is None else F.pad(self.bias, (0, pad))
        return F.linear(x, F.pad(self.weight, (0, 0, 0, pad)), b)[..., :v]


class CrossEntropy(nn.Module):
    """Mean token cross-entropy. Tensor parallel swaps in the vocab-parallel version."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, -2).float() if logits.dtype in (torch.float16, torch.bfloat16)
                               else logits.flatten(0, -2), targets.flatten())


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = OutputHead(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.criterion = CrossEntropy()

    def forward(self, tokens, targets=None, positions=None, cache=None):
        """tokens: (B, S) int64. Returns logits (B, S, V), or the mean loss if targets are given.
        ``cache`` (generation, models/generate.KVCache): keys/values of the ``cache.length`` tokens
        already seen; ``tokens`` continue them (positions start at ``cache.length``)."""
        past = 0 if cache is None else cache.length
        if positions is None:
            positions = torch.arange(past, past + tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for key, layer in self.layers.items():
            h = layer(h, positions) if cache is None else layer(h, positions, cache.layer(key))
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.norm is None:  # a pipeline stage that ends before the head
            return h
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return self.criterion(logits, targets) + self.aux_loss()

    def aux_loss(self):
        """Sum of auxiliary losses (MoE load balance and z-loss) stored by the last forward."""
        total = 0.0
        for layer in self.layers.values():
            if getattr(layer, "is_moe", False):
                total = total + layer.feed_forward.last_aux_loss
        return total
