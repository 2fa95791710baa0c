"""Llama-style decoder on the shared body (models/decoder.py): RMSNorm, rotary positions, SwiGLU,
grouped-query attention, optional MoE feed-forwards. Single-device code; its module names are the
contract parallel modules use (the TP_PLAN in ``__init__.py``) and the checkpoint keys."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..decoder import SDPA, Decoder, attend
from ..spec import ffn_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normed(self, x):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def forward(self, x):
        return self.normed(x) * self.weight

    @torch.no_grad()
    def weight_grad(self, x, g):
        """d loss / d weight given the output gradient ``g``, without autograd (the deferred W of
        a zero-bubble pipeline schedule, docs/pipeline.md)."""
        return {"weight": (g * self.normed(x)).reshape(-1, g.shape[-1]).sum(0)}


class Rope(NamedTuple):
    """A model's rotary settings (ModelConfig's rope_* fields)."""
    theta: float
    scaling: str = "none"
    factor: float = 1.0
    low_freq: float = 1.0
    high_freq: float = 4.0
    original_len: int = 8192

    @classmethod
    def of(cls, cfg) -> "Rope":
        return cls(cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq, cfg.rope_high_freq,
                   cfg.rope_original_len)


def inv_frequencies(rope: Rope, d: int, device=None) -> torch.Tensor:
    """The rotary frequencies theta^(-2i/d), i < d/2 (float64), scaled by ``rope.scaling``: linear
    divides each by the factor; llama3 (Llama 3.1) divides those whose wavelength 2 pi / f exceeds
    original_len / low_freq, keeps those below original_len / high_freq, and between the two blends
    f / factor and f by s = (original_len / wavelength - low_freq) / (high_freq - low_freq):
    (1 - s) f / factor + s f. Computed on the tensors' device at each call, as the plain one was."""
    f = 1.0 / (rope.theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float64) / d))
    if rope.scaling == "linear":
        return f / rope.factor
    if rope.scaling == "llama3":
        low, high, factor, orig = rope.low_freq, rope.high_freq, rope.factor, rope.original_len
        wavelength = 2 * math.pi / f
        s = ((orig / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0 beyond orig / low, 1 below orig / high
        return (1 - s) * f / factor + s * f
    return f


def rotary(x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle pos * f_i (:func:`inv_frequencies`).
    x: (B, S, H, D); positions: (S,)."""
    d = x.shape[-1]
    inv_freq = inv_frequencies(rope, d, x.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]          # (S, D/2)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = angles.cos().to(dtype)[None, :, None, :], angles.sin().to(dtype)[None, :, None, :]
    xr = x.to(dtype).reshape(*x.shape[:-1], d // 2, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.reshape(x.shape).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim, self.rope = cfg.head_dim, Rope.of(cfg)
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.core = SDPA(cfg.attention)

    def forward(self, x, positions, cache=None):
        b, s, _ = x.shape  # head counts from the projection sizes: a tensor-parallel shard runs this too
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rotary(q, positions, self.rope), rotary(k, positions, self.rope)
        return self.wo(attend(self.core, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache))


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
            from ..moe import MoE
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.d_model, ffn_dim(cfg))

    def forward(self, x, positions, cache=None):
        x = x + self.attention(self.attention_norm(x), positions, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(Decoder):
    def __init__(self, cfg):
        super().__init__(cfg, {"tok_embeddings": nn.Embedding(cfg.vocab_size, cfg.d_model)}, Block,
                         lambda c: RMSNorm(c.d_model, c.norm_eps))
