"""Llama's GGUF adapter (models/gguf.py reads the file): ``llama.*`` metadata -> ModelConfig, GGUF
tensor names -> shardlab's. GGUF keeps q/k in the interleaved-pair rotary layout ``rotary``
rotates, so they load unchanged (logits parity against transformers: tests/unit/test_gguf.py).
RoPE scaling: llama.cpp's ``rope_freqs`` tensor (Llama 3.1 / 3.2: a divisor per frequency) is read
back into the llama3 rule, ``llama.rope.scaling.type = linear`` into the linear one."""
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


FREQS = "rope_freqs.weight"
"""llama.cpp's per-frequency RoPE divisors: a setting of the model read by :func:`model_config`, no parameter."""


def tensors(r, cfg) -> dict:
    """{shardlab parameter name: GGUF tensor}; the tied head is the embedding."""
    out = {shardlab_name(t.name): t for t in r.tensors if t.name != FREQS}
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
    theta = float(field(r, "llama.rope.freq_base", 10000.0))
    rope = _rope_scaling(r, names, theta, d_model // n_heads)
    return ModelConfig(
        arch="llama", vocab_size=int(vocab), d_model=d_model, n_layers=int(field(r, "llama.block_count")),
        n_heads=n_heads, n_kv_heads=int(field(r, "llama.attention.head_count_kv", n_heads)),
        ffn_hidden=int(field(r, "llama.feed_forward_length")),
        max_seq_len=int(field(r, "llama.context_length", 2048)),
        rope_theta=theta, **rope,
        norm_eps=float(field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names)


def _rope_scaling(r, names: set, theta: float, head_dim: int) -> dict:
    """The ``model.rope_*`` settings of the file's RoPE scaling: none; ``linear`` (its factor from
    the metadata); or llama.cpp's ``rope_freqs`` divisors read back into the llama3 rule."""
    kind = field(r, "llama.rope.scaling.type")
    kind = None if kind in (None, "none") else kind
    if kind is None and FREQS not in names:
        return {}
    if kind == "linear" and FREQS not in names:
        factor = field(r, "llama.rope.scaling.factor")
        if factor is None or float(factor) <= 0:
            raise ConfigError("source", f"RoPE scaling linear without a positive llama.rope.scaling.factor "
                                        f"({factor!r}); import the model's Hugging Face directory")
        return {"rope_scaling": "linear", "rope_factor": float(factor)}
    if kind is not None:
        raise ConfigError("source", f"RoPE scaling {kind!r}{' with ' + FREQS if FREQS in names else ''} in a GGUF "
                                    "is not supported (linear, and llama3 as llama.cpp's rope_freqs, are); import "
                                    "the model's Hugging Face directory")
    from ..gguf import dequantize
    divisors = dequantize(next(t for t in r.tensors if t.name == FREQS)).double().flatten()
    orig = int(field(r, "llama.rope.scaling.original_context_length", 8192))
    return llama3_from_divisors(divisors, theta, head_dim, orig)


def llama3_from_divisors(divisors, theta: float, head_dim: int, original_len: int = 8192) -> dict:
    """The llama3 settings whose frequencies are ``f_i / divisors[i]`` (llama.cpp writes the
    divisors: 1 for the kept frequencies, the factor beyond the pretrained context, and on the ramp
    1 / ((1 - s) / factor + s), s = (original_len / wavelength - low) / (high - low), linear in
    1 / wavelength). The factor is the largest divisor; two points of the ramp give low and high for
    ``original_len`` (any length gives the same frequencies: only original_len / low and / high
    matter). ConfigError unless the rule reproduces every divisor."""
    import math

    import torch

    from ...config import ModelConfig
    from .model import Rope, inv_frequencies
    d = divisors.double()
    plain = inv_frequencies(Rope(theta), head_dim)
    factor = float(d.max())
    if d.numel() == plain.numel() and bool((d == 1).all()):
        return {}  # every frequency kept: no scaling
    if d.numel() != plain.numel() or factor <= 1.0:
        raise ConfigError("source", f"{FREQS} holds {d.numel()} divisors (largest {factor:g}) for "
                                    f"{plain.numel()} rotary frequencies: not a llama3 RoPE scaling shardlab reads")
    s = (1 / d - 1 / factor) / (1 - 1 / factor)  # 1 where kept, 0 where divided by the factor
    ramp = ((s > 1e-6) & (s < 1 - 1e-6)).nonzero().flatten()
    found = {}
    if ramp.numel() >= 2:
        i, j = int(ramp[0]), int(ramp[-1])
        x_i, x_j = original_len * plain[i] / (2 * math.pi), original_len * plain[j] / (2 * math.pi)
        span = float((x_i - x_j) / (s[i] - s[j]))  # high - low: s = (x - low) / (high - low)
        low = float(x_i - s[i] * span)
        for lo, hi in ((float(f"{low:.6g}"), float(f"{low + span:.6g}")), (low, low + span)):  # rounded if it fits
            rule = {"rope_scaling": "llama3", "rope_factor": factor, "rope_low_freq": lo, "rope_high_freq": hi,
                    "rope_original_len": original_len}
            if torch.allclose(inv_frequencies(Rope.of(ModelConfig(rope_theta=theta, **rule)), head_dim), plain / d,
                              rtol=1e-5, atol=0):
                found = rule
                break
    if not found:
        raise ConfigError("source", f"{FREQS}: the divisors do not follow Llama 3.1's rule (kept, a ramp of at "
                                    "least two frequencies, divided by the factor); import the Hugging Face directory")
    return found
