"""Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, optional tied embeddings and
Mixture-of-Experts feed-forwards. The model is in model.py, its HF and GGUF adapters in hf.py and
gguf.py; this file registers its ModelSpec."""
from __future__ import annotations

import math

from ...errors import ConfigError
from .. import decoder
from ..spec import ModelSpec, Sizes, layer_blocks, register
from . import gguf, hf
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


def check(cfg) -> None:
    decoder.check_transformer(cfg, rotary=True)
    m = cfg.model if hasattr(cfg, "model") else cfg
    if m.rope_scaling == "llama3" and m.rope_high_freq <= m.rope_low_freq:
        raise ConfigError("model.rope_high_freq", f"{m.rope_high_freq:g} must exceed model.rope_low_freq = "
                                                  f"{m.rope_low_freq:g} (the llama3 ramp runs between them)")


matmul_params_per_token = decoder.matmul_params_per_token

SPEC = register(ModelSpec(
    name="llama", build=Llama, init_std=init_std, flops_per_token=decoder.flops_per_token, blocks=layer_blocks,
    tp_plan=TP_PLAN, attention=decoder.attention_cores("attention"), pp_first=("tok_embeddings",),
    pp_last=("norm", "output"), sizes=Sizes(ffn_ratio=(8, 3), ffn_multiple_of=32), moe=True, check=check,
    hf=hf, gguf=gguf))

__all__ = ["Llama", "SPEC", "TP_PLAN", "matmul_params_per_token"]
