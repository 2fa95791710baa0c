"""The decoder-only language model Llama and GPT-2 share: embedding, ``layers`` blocks, final norm,
head, loss (each architecture supplies its blocks, norm, embedding and attribute names), and the
attention core, head, loss, FLOPs and config checks they share (docs/models.md)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .spec import ffn_dim


class SDPA(nn.Module):
    """Attention core softmax(q k^T / sqrt(d)) v, by ``kind`` (model.attention): ``sdpa`` (PyTorch's
    fused kernel) or ``math`` (separate operators, the scores stored; dropout ``p``). Context
    parallel replaces or wraps it."""

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


def attend(core, q, k, v, cache=None):
    """Causal attention of q (B, Hq, S, D) over k, v (B, Hkv, S, D) -> (B, S, Hq * D). With a layer
    ``cache`` (generation, models/generate.py: ``update(k, v) -> (k_all, v_all)``) the S new queries
    attend to the cached keys too, aligned to the end. Head counts are read from the tensors, so a
    tensor-parallel shard (local heads) runs the same code."""
    b, _, s, _ = q.shape
    past = 0
    if cache is not None:
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


class OutputHead(nn.Linear):
    """The vocabulary projection (logits = h W^T). On CUDA a vocabulary that is not a multiple of
    ``ALIGN`` rows (GPT-2's 50257) makes cuBLAS fall back to slow kernels for all three products of
    the head (docs/gpu.md): there the weight is padded with zero rows to a multiple of ``ALIGN`` and
    the logits are a view of the first ``vocab`` columns (same values, no new parameter). Elsewhere
    it is ``nn.Linear``; its weight gradient is a plain linear's (pipeline/wgrad.py)."""

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


class Decoder(nn.Module):
    """``embeddings`` (name -> module), ``layers`` (``block(cfg, i)``, keyed by global index), the
    final norm and the head under the architecture's names (``EMBED`` is the token embedding, which
    a tied head shares) and ``criterion``. A module a pipeline stage does not own is None: without
    the embedding ``forward`` takes hidden states, without the norm it returns them."""

    EMBED, NORM, HEAD = "tok_embeddings", "norm", "output"

    def __init__(self, cfg, embeddings: dict, block, norm):
        super().__init__()
        self.cfg = cfg
        for name, module in embeddings.items():
            setattr(self, name, module)
        self.layers = nn.ModuleDict({str(i): block(cfg, i) for i in range(cfg.n_layers)})
        setattr(self, self.NORM, norm(cfg))
        setattr(self, self.HEAD, OutputHead(cfg.d_model, cfg.vocab_size, bias=False))
        if cfg.tie_embeddings:
            getattr(self, self.HEAD).weight = getattr(self, self.EMBED).weight
        self.criterion = CrossEntropy()

    def embed(self, tokens, positions):
        return getattr(self, self.EMBED)(tokens)

    def forward(self, tokens, targets=None, positions=None, cache=None):
        """tokens (B, S) -> logits (B, S, V), or the mean loss with targets. ``cache``
        (models/generate.KVCache): keys/values of the ``cache.length`` tokens already seen."""
        past = 0 if cache is None else cache.length
        if positions is None:
            positions = torch.arange(past, past + tokens.shape[1], device=tokens.device)
        h = self.embed(tokens, positions) if getattr(self, self.EMBED) is not None else tokens
        for key, layer in self.layers.items():
            h = layer(h, positions) if cache is None else layer(h, positions, cache.layer(key))
        if cache is not None:
            cache.advance(tokens.shape[1])
        norm = getattr(self, self.NORM)
        if norm is None:  # a pipeline stage that ends before the head
            return h
        logits = getattr(self, self.HEAD)(norm(h))
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


def matmul_params_per_token(cfg, ffn_matrices: int = 3) -> int:
    """Parameters in matmuls one token passes through: attention, the MLP's ``ffn_matrices``
    (SwiGLU 3, GELU 2), the head; embedding lookups excluded; for MoE only the top-k experts and
    the router."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    dense_ffn = ffn_matrices * d * ffn_dim(cfg)
    total = 0
    for i in range(cfg.n_layers):
        moe = cfg.n_experts > 0 and i % cfg.moe_every == cfg.moe_every - 1
        total += attn + (cfg.moe_top_k * dense_ffn + d * cfg.n_experts if moe else dense_ffn)
    return total + d * cfg.vocab_size


def flops_per_token(cfg, seq_len: int, ffn_matrices: int = 3) -> float:
    """6 N (forward + backward of the matmuls) + 12 L d S (attention scores and weighted sum, the
    full non-causal count: SDPA's CPU and math kernels do not skip masked blocks)."""
    return 6.0 * matmul_params_per_token(cfg, ffn_matrices) + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def attention_cores(attribute: str):
    """``ModelSpec.attention`` of a decoder whose blocks hold their attention as ``attribute``."""
    return lambda model: [(getattr(layer, attribute), "core") for layer in model.layers.values()]


def check_transformer(cfg, rotary: bool) -> None:
    """Shape constraints of multi-head attention; ConfigError naming the field otherwise."""
    m = cfg.model if hasattr(cfg, "model") else cfg
    for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name}", "must be >= 1")
    if m.d_model % m.n_heads:
        raise ConfigError("model.n_heads", f"{m.n_heads} does not divide d_model={m.d_model}")
    if m.n_heads % m.kv_heads:
        raise ConfigError("model.n_kv_heads", f"{m.kv_heads} does not divide n_heads={m.n_heads}; "
                                              f"pick a divisor of {m.n_heads}")
    if rotary and m.head_dim % 2:
        raise ConfigError("model.d_model", "head_dim = d_model/n_heads must be even for rotary embeddings")
