"""GPT-2 (Radford et al. 2019) on the shared body (models/decoder.py): learned positions, pre-
LayerNorm blocks with biased projections, GELU (tanh) MLP. q, k and v are three Linear layers
(not HF's fused ``c_attn``) so that tensor parallel splits each by heads. Single-device code; its
module names are the contract parallel modules use (TP_PLAN) and the checkpoint keys (docs/models.md)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..decoder import SDPA, Decoder, attend
from ..spec import ffn_dim


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.head_dim = cfg.head_dim
        self.c_q = nn.Linear(d, d)
        self.c_k = nn.Linear(d, d)
        self.c_v = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)
        self.core = SDPA(cfg.attention, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cache=None):
        b, s, _ = x.shape  # head counts from the projection sizes: a tensor-parallel shard runs this too
        q = self.c_q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        return self.drop(self.c_proj(attend(self.core, q, k, v, cache)))


class MLP(nn.Module):
    """c_proj(gelu_tanh(c_fc x)), both biased."""

    def __init__(self, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(d_model, hidden)
        self.c_proj = nn.Linear(hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg, layer_id: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, ffn_dim(cfg), cfg.dropout)

    def forward(self, x, positions=None, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT2(Decoder):
    EMBED, NORM, HEAD = "wte", "ln_f", "lm_head"

    def __init__(self, cfg):
        super().__init__(cfg, {"wte": nn.Embedding(cfg.vocab_size, cfg.d_model),
                               "wpe": nn.Embedding(cfg.max_seq_len, cfg.d_model), "drop": nn.Dropout(cfg.dropout)},
                         Block, lambda c: nn.LayerNorm(c.d_model, eps=c.norm_eps))

    def embed(self, tokens, positions):
        return self.drop(self.wte(tokens) + self.wpe(positions))
