"""GGUF files (llama.cpp's format) for every spec with a ``gguf`` adapter (``ARCH``, its
``general.architecture``; ``model_config(reader)``; ``tensors(reader, cfg)`` -> {shardlab name:
GGUF tensor}); here, naming no architecture: opening, metadata, dequantising to float32, and
:class:`GGUFTensors`, the checkpoint reader over a file. Nothing downloads (docs/pretrained.md)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .spec import specs


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


def adapter(r):
    """The ``gguf`` adapter of the file's ``general.architecture``; ConfigError when none reads it."""
    arch = field(r, "general.architecture")
    found = {s.gguf.ARCH: s.gguf for s in specs().values() if s.gguf is not None}
    if arch not in found:
        raise ConfigError("source", f"GGUF architecture {arch!r} is not supported (supported: "
                                    f"{', '.join(sorted(found))})")
    return found[arch]


def model_config(r):
    """The shardlab ModelConfig of a GGUF's metadata; ConfigError for an architecture no spec reads
    or a tensor type that cannot be dequantised."""
    mod = adapter(r)
    check_types(r)
    return mod.model_config(r)


def dequantize(t) -> torch.Tensor:
    """One GGUF tensor as float32 in PyTorch's shape. GGUF lists dims fastest-first (``t.shape`` is
    [in, out] for a matrix); the dequantised numpy array is already row-major [out, in]."""
    from gguf.quants import dequantize as deq
    arr = np.asarray(deq(t.data, t.tensor_type), dtype=np.float32)
    shape = tuple(int(n) for n in reversed(list(t.shape)))
    return torch.from_numpy(arr.reshape(shape).copy())


class GGUFTensors:
    """The checkpoint reader interface over a GGUF: each tensor dequantised to float32 the first
    time it is read, then kept (a rank reads several boxes of the same tensor)."""

    def __init__(self, gguf_reader):
        self.cfg = model_config(gguf_reader)
        self.tensors = {f"model.{n}": t for n, t in adapter(gguf_reader).tensors(gguf_reader, self.cfg).items()}
        self._cache: dict[str, torch.Tensor] = {}
        self.meta, self.step = {}, 0

    def keys(self) -> list[str]:
        return list(self.tensors)

    def has(self, key: str) -> bool:
        return key in self.tensors

    def global_shape(self, key: str) -> tuple:
        return tuple(int(n) for n in reversed(list(self.tensors[key].shape)))

    def dtype(self, key: str) -> torch.dtype:
        return torch.float32

    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = dequantize(self.tensors[key])
        t = self._cache[key]
        if offsets is not None:
            t = t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        return t.to(dtype) if dtype is not None else t

    def close(self) -> None:
        self._cache.clear()
