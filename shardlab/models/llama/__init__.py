"""Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, optional tied embeddings and
Mixture-of-Experts feed-forwards. The model is in model.py; this file registers its ModelSpec."""
from __future__ import annotations

import math

from ..spec import ModelSpec, layer_blocks, register
from .model import Llama

TP_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "sequence_parallel_norm",
    "layers.*.attention": "gather_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise_kv",
    "layers.*.attention.wv": "colwise_kv",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sequence_parallel_norm",
    "layers.*.feed_forward": "gather_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "sequence_parallel_norm",
    "output": "vocab_output",
    "criterion": "vocab_parallel_loss",
}
"""Megatron-LM's layout of a Llama block: one all-reduce (or all-gather + reduce-scatter with
sequence parallel) per attention and per MLP, forward and backward (styles: parallel/tensor.py)."""


def init_std(name: str, shape, cfg) -> float | None:
    """Normal(0, init_std) for matrices; residual output projections scaled by 1/sqrt(2 L)
    (GPT-2's rule); norm weights ones."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) or ".w2" in name:
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def matmul_params_per_token(cfg) -> int:
    """Parameters in matmuls one token passes through (head included, embedding lookup excluded;
    for MoE only the top-k experts and the router)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    dense_ffn = 3 * d * cfg.ffn_dim
    total = 0
    for i in range(cfg.n_layers):
        moe = cfg.n_experts > 0 and i % cfg.moe_every == cfg.moe_every - 1
        total += attn + (cfg.moe_top_k * dense_ffn + d * cfg.n_experts if moe else dense_ffn)
    return total + d * cfg.vocab_size


def flops_per_token(cfg, seq_len: int) -> float:
    """6 N (forward + backward of the matmuls) + 12 L d S (attention scores and weighted sum, the
    full non-causal count: SDPA's CPU and math kernels do not skip masked blocks)."""
    return 6.0 * matmul_params_per_token(cfg) + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def attention_cores(model) -> list:
    return [(layer.attention, "core") for layer in model.layers.values()]


def check(cfg) -> None:
    from ..transformer import check_transformer
    check_transformer(cfg, rotary=True)


SPEC = register(ModelSpec(
    name="llama", build=Llama, init_std=init_std, flops_per_token=flops_per_token, blocks=layer_blocks,
    tp_plan=TP_PLAN, attention=attention_cores, pp_first=("tok_embeddings",), pp_last=("norm", "output"),
    ffn_dim=lambda cfg: cfg.ffn_dim, moe=True, check=check))

__all__ = ["Llama", "SPEC", "TP_PLAN", "matmul_params_per_token"]
