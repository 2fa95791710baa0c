"""GPT-2: learned positions, LayerNorm, biased q/k/v/proj, GELU MLP, tied head. The model is in
model.py, its HF adapter in hf.py; this file registers its ModelSpec (docs/models.md)."""
from __future__ import annotations

import math

from ...errors import ConfigError
from .. import decoder
from ..spec import ModelSpec, Sizes, layer_blocks, register
from . import hf
from .model import GPT2

TP_PLAN: dict[str, str] = {
    "wte": "vocab_embedding",
    "wpe": "position_embedding",
    "layers.*.ln_1": "sequence_parallel_norm",
    "layers.*.attn": "gather_input",
    "layers.*.attn.c_q": "colwise",
    "layers.*.attn.c_k": "colwise",
    "layers.*.attn.c_v": "colwise",
    "layers.*.attn.c_proj": "rowwise",
    "layers.*.ln_2": "sequence_parallel_norm",
    "layers.*.mlp": "gather_input",
    "layers.*.mlp.c_fc": "colwise",
    "layers.*.mlp.c_proj": "rowwise",
    "ln_f": "sequence_parallel_norm",
    "lm_head": "vocab_output",
    "criterion": "vocab_parallel_loss",
}
"""Megatron-LM's GPT layout: q/k/v and c_fc column-parallel (their biases split with the output
features), c_proj row-parallel (bias replicated, added once after the reduction); with sequence
parallel the LayerNorms and the position embedding run on this rank's S/tp tokens."""


def init_std(name: str, shape, cfg) -> float | None:
    """GPT-2's init: Normal(0, init_std) for weights and both embeddings, residual projections
    (``attn.c_proj``, ``mlp.c_proj``) scaled by 1/sqrt(2 L); biases zeros; LayerNorm weights ones."""
    if name.endswith(".bias"):
        return 0.0
    if ".ln_" in f".{name}":
        return None
    if name.endswith("c_proj.weight"):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def matmul_params_per_token(cfg) -> int:
    """Weights of the matmuls one token passes through: per layer q, k, v, proj (4 d^2) and the
    MLP (2 d ffn), plus the head (d V); embedding lookups excluded."""
    return decoder.matmul_params_per_token(cfg, ffn_matrices=2)


def flops_per_token(cfg, seq_len: int) -> float:
    return decoder.flops_per_token(cfg, seq_len, ffn_matrices=2)


def check(cfg) -> None:
    m = cfg.model if hasattr(cfg, "model") else cfg
    if m.n_kv_heads not in (0, m.n_heads):
        raise ConfigError("model.n_kv_heads", f"GPT-2 has no grouped-query attention: set 0 (= n_heads) "
                                              f"or {m.n_heads}, not {m.n_kv_heads}")
    decoder.check_transformer(m, rotary=False)


SPEC = register(ModelSpec(
    name="gpt2", build=GPT2, init_std=init_std, flops_per_token=flops_per_token, blocks=layer_blocks,
    tp_plan=TP_PLAN, attention=decoder.attention_cores("attn"), pp_first=("wte", "wpe"),
    pp_last=("ln_f", "lm_head"), sizes=Sizes(ffn_ratio=(4, 1)), check=check,
    verify_model={"n_kv_heads": 0, "tie_embeddings": True}, hf=hf))

__all__ = ["GPT2", "SPEC", "TP_PLAN", "matmul_params_per_token"]
