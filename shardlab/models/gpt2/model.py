"""GPT-2 (Radford et al. 2019): learned position embeddings, pre-LayerNorm blocks with biased
projections, GELU (tanh) MLP, tied output head. Single-device code: nothing here imports
torch.distributed. Parallel modules swap submodules by name (the architecture's ModelSpec), so
the names below are part of the contract:

  wte, wpe, layers.<i>.ln_1, layers.<i>.attn.{c_q,c_k,c_v,c_proj,core}, layers.<i>.ln_2,
  layers.<i>.mlp.{c_fc,c_proj}, ln_f, lm_head, criterion

q, k and v are three Linear layers (not GPT-2's fused ``c_attn``) so that tensor parallel splits
each by heads with the column-parallel style. ``layers`` is a ModuleDict keyed by the global layer
index (pipeline stages keep global names = checkpoint keys). The embedding is
``wte(tokens) + wpe(positions)``: under sequence parallel each term returns this rank's sequence
chunk (parallel/tensor.py), under context parallel ``positions`` are the shard's global positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..llama.model import SDPA, CrossEntropy, OutputHead, cached_attention


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
        """``cache`` (generation only): this layer's cache of keys/values (models/generate.py)."""
        b, s, _ = x.shape
        # Head counts come from the projection sizes: a tensor-parallel shard runs this same code.
        q = self.c_q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            return self.drop(self.c_proj(cached_attention(self.core, q, k, v, cache)))
        out = self.core(q, k, v, causal=True)
        return self.drop(self.c_proj(out.transpose(1, 2).reshape(b, s, -1)))


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
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.ffn_hidden or 4 * cfg.d_model, cfg.dropout)

    def forward(self, x, cache=None):
        x = x + (self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = OutputHead(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.criterion = CrossEntropy()

    def forward(self, tokens, targets=None, positions=None, cache=None):
        """tokens: (B, S) int64 (hidden states (B, S, d) in a pipeline stage without ``wte``).
        Returns logits (B, S, V), the mean loss if targets are given, or hidden states in a
        pipeline stage without ``ln_f``. ``cache`` (generation, models/generate.KVCache): keys/values
        of the ``cache.length`` tokens already seen; ``tokens`` continue them."""
        past = 0 if cache is None else cache.length
        if self.wte is not None:
            if positions is None:
                positions = torch.arange(past, past + tokens.shape[1], device=tokens.device)
            h = self.drop(self.wte(tokens) + self.wpe(positions))
        else:
            h = tokens
        for key, layer in self.layers.items():
            h = layer(h) if cache is None else layer(h, cache.layer(key))
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.ln_f is None:  # a pipeline stage that ends before the head
            return h
        logits = self.lm_head(self.ln_f(h))
        if targets is None:
            return logits
        return self.criterion(logits, targets)
