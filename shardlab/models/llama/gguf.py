"""Llama's GGUF adapter (models/gguf.py reads the file): ``llama.*`` metadata -> ModelConfig, GGUF
tensor names -> shardlab's. GGUF keeps q/k in the interleaved-pair rotary layout ``rotary``
rotates, so they load unchanged (logits parity against transformers: tests/unit/test_gguf.py)."""
from __future__ import annotations

import re

from ...errors import ConfigError
from ..gguf import field
from .hf import BLOCK, TOP

ARCH = "llama"
_BLOCK = {g: name for name, (_, g) in BLOCK.items()}
_TOP = {g: name for name, (_, g) in TOP.items()}


def shardlab_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``layers.3.attention.wq.weight``; ConfigError for an unknown tensor."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+\.weight)", gguf_name)
    if m and m[2] in _BLOCK:
        return f"layers.{m[1]}.{_BLOCK[m[2]]}"
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    raise ConfigError("source", f"GGUF tensor {gguf_name!r} has no Llama counterpart in shardlab")


def tensors(r, cfg) -> dict:
    """{shardlab parameter name: GGUF tensor}; the tied head is the embedding."""
    out = {shardlab_name(t.name): t for t in r.tensors}
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def model_config(r):
    """The shardlab ModelConfig of a GGUF's ``llama.*`` metadata."""
    from ...config import ModelConfig
    names = {t.name for t in r.tensors}
    vocab = field(r, "llama.vocab_size") or len(field(r, "tokenizer.ggml.tokens", []))
    d_model, n_heads = int(field(r, "llama.embedding_length")), int(field(r, "llama.attention.head_count"))
    rope_dim = field(r, "llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != d_model // n_heads:
        raise ConfigError("source", f"partial rotary (rope.dimension_count={rope_dim}, head_dim="
                                    f"{d_model // n_heads}) is not supported")
    scaling = field(r, "llama.rope.scaling.type")
    if "rope_freqs.weight" in names or scaling not in (None, "none"):  # llama.cpp's per-frequency factors
        raise ConfigError("source", f"RoPE scaling ({'rope_freqs.weight' if scaling in (None, 'none') else scaling}) "
                                    "in a GGUF is not supported; import the model's Hugging Face directory, "
                                    "whose rope_parameters shardlab reads (linear, llama3)")
    return ModelConfig(
        arch="llama", vocab_size=int(vocab), d_model=d_model, n_layers=int(field(r, "llama.block_count")),
        n_heads=n_heads, n_kv_heads=int(field(r, "llama.attention.head_count_kv", n_heads)),
        ffn_hidden=int(field(r, "llama.feed_forward_length")),
        max_seq_len=int(field(r, "llama.context_length", 2048)),
        rope_theta=float(field(r, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names)
