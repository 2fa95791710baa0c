"""Checks shared by the decoder-only transformer architectures (Llama, GPT-2)."""
from __future__ import annotations

from ..errors import ConfigError


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
