"""Llama weights from a GGUF file (llama.cpp's format): metadata -> ModelConfig, every tensor
dequantised to float32 and renamed to shardlab's parameter names.

GGUF stores q/k projections in the interleaved-pair rotary layout (llama.cpp's HF converter permutes
them into it), which is the layout ``model.rotary`` rotates, so they load unchanged (checked by logits
parity against transformers in tests/unit/test_gguf.py). Nothing here downloads.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ...errors import ConfigError

_BLOCK = {
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
    "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
}
_TOP = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


def reader(path):
    """A ``gguf.GGUFReader`` of ``path``; ConfigError (one line) if it is missing or not a GGUF."""
    from gguf import GGUFReader
    p = Path(path)
    if not p.is_file():
        raise ConfigError("source", f"no such file: {path}")
    try:
        return GGUFReader(str(p))
    except Exception as e:  # the reader raises ValueError / struct errors on a bad magic or truncation
        raise ConfigError("source", f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def field(r, key, default=None):
    """The value of metadata ``key`` (str, number or list), or ``default``."""
    f = r.fields.get(key)
    return default if f is None else f.contents()


def shardlab_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``layers.3.attention.wq.weight``; ConfigError for an unknown tensor."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"layers.{m.group(1)}.{_BLOCK[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.weight"
    raise ConfigError("source", f"GGUF tensor {gguf_name!r} has no Llama counterpart in shardlab")


@lru_cache(maxsize=None)
def readable_types() -> tuple[str, ...]:
    """Names of the GGML tensor types gguf-python can dequantise here, found by dequantising one
    zero block of each (its list of implemented types is private and grows between versions)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as deq
    names = []
    for q in GGMLQuantizationType:
        if q not in GGML_QUANT_SIZES:
            continue
        try:
            deq(np.zeros((1, GGML_QUANT_SIZES[q][1]), dtype=np.uint8), q)
        except Exception:  # NotImplementedError for the types it lacks
            continue
        names.append(q.name)
    return tuple(names)


def check_types(r) -> None:
    """ConfigError (one line) naming the first tensor whose type cannot be dequantised -- checked
    when the file is opened, so nothing is half-loaded."""
    ok = readable_types()
    for t in r.tensors:
        name = getattr(t.tensor_type, "name", str(t.tensor_type))
        if name not in ok:
            where = getattr(getattr(r, "data", None), "filename", None) or "GGUF"
            raise ConfigError("source", f"{where}: tensor {t.name} has quantisation {name}, which shardlab "
                                        f"cannot read; supported: {', '.join(ok)}")


def model_config(r):
    """The shardlab ModelConfig of a GGUF's ``llama.*`` metadata; ConfigError for another
    architecture or a tensor type that cannot be dequantised."""
    from ...config import ModelConfig
    arch = field(r, "general.architecture")
    if arch != "llama":
        raise ConfigError("source", f"GGUF architecture {arch!r} is not supported (only Llama-family GGUFs)")
    check_types(r)
    names = {t.name for t in r.tensors}
    vocab = field(r, "llama.vocab_size") or len(field(r, "tokenizer.ggml.tokens", []))
    d_model, n_heads = int(field(r, "llama.embedding_length")), int(field(r, "llama.attention.head_count"))
    rope_dim = field(r, "llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != d_model // n_heads:
        raise ConfigError("source", f"partial rotary (rope.dimension_count={rope_dim}, head_dim="
                                    f"{d_model // n_heads}) is not supported")
    return ModelConfig(
        arch="llama", vocab_size=int(vocab), d_model=d_model, n_layers=int(field(r, "llama.block_count")),
        n_heads=n_heads, n_kv_heads=int(field(r, "llama.attention.head_count_kv", n_heads)),
        ffn_hidden=int(field(r, "llama.feed_forward_length")),
        max_seq_len=int(field(r, "llama.context_length", 2048)),
        rope_theta=float(field(r, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names)


def dequantize(t) -> torch.Tensor:
    """One GGUF tensor as float32 in PyTorch's shape. GGUF lists dims fastest-first (``t.shape`` is
    [in, out] for a matrix); the dequantised numpy array is already row-major [out, in]."""
    from gguf.quants import dequantize as deq
    arr = np.asarray(deq(t.data, t.tensor_type), dtype=np.float32)
    shape = tuple(int(n) for n in reversed(list(t.shape)))
    return torch.from_numpy(arr.reshape(shape).copy())

