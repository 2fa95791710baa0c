"""Layout-independent initialisation, one box at a time: the global value of a parameter is
``randn(shape, generator=G(seed, name)) * std`` (or ones), the same on every rank and layout, and
:func:`init_box` streams it in chunks of whole dim-0 rows to keep only a rank's box, bit-identical
to drawing it at once (why: docs/training.md, "Layout-independent initialisation").
"""
from __future__ import annotations

import contextlib
import math
import zlib

import torch

CHUNK = 1 << 20  # elements drawn per chunk


class _SkipMetaFills(torch.overrides.TorchFunctionMode):
    """Random and constant fills of meta tensors return the tensor untouched: a meta tensor has no
    values to fill, and its fill (``nn.init`` in every module's constructor) runs a Python reference
    kernel whose first call imports ``torch._dynamo``: about 800 modules and 2 CPU-s in a process
    that builds a model and no optimizer (``shardlab generate``, ``checkpoint export``; a torch
    optimizer imports it anyway). :func:`init_box` draws the real values later."""
    FILLS = {getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "random_", "bernoulli_", "exponential_",
                                                  "geometric_", "log_normal_", "cauchy_", "fill_", "zero_")}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by keyword
        in_place_init = getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_")
        if (func in self.FILLS or in_place_init) and isinstance(t, torch.Tensor) and t.is_meta:
            return t
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device():
    """``torch.device("meta")`` for building a model's shapes, its parameters' initial fills skipped."""
    with torch.device("meta"), _SkipMetaFills():
        yield


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed that depends only on the run seed and the parameter's global name."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (2**63 - 1)


def _chunk_rows(row: int) -> int:
    """Rows per chunk: about CHUNK elements, a multiple of 16 elements."""
    step = 16 // math.gcd(row, 16)               # rows that make a multiple of 16 elements
    return max(step, (CHUNK // max(row, 1)) // step * step)


def init_box(name: str, shape, std: float | None, seed: int, offsets=None, sizes=None,
             dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The box ``[offsets, offsets + sizes)`` of the global initial value of parameter ``name``
    (``std`` None means ones, 0 zeros). Whole tensor when ``offsets`` is None."""
    shape = tuple(int(s) for s in shape)
    if offsets is None:
        offsets, sizes = (0,) * len(shape), shape
    offsets, sizes = tuple(offsets), tuple(sizes)
    if std is None or std == 0 or math.prod(sizes) == 0:
        fill = torch.ones if std is None else torch.zeros
        return fill(sizes, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    if len(shape) == 0 or math.prod(shape) < 16 or shape[0] == 1:
        full = torch.randn(shape, generator=g, dtype=torch.float32) * std
        sl = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        return full[sl].to(device=device, dtype=dtype).contiguous()
    rows, inner = shape[0], math.prod(shape[1:])
    per = _chunk_rows(inner)
    r_lo, r_hi = offsets[0], offsets[0] + sizes[0]
    rest = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
    out = torch.empty(sizes, dtype=dtype, device=device)
    r = 0
    while r < r_hi:
        n = min(per, rows - r)
        if 0 < (rows - r - n) * inner < 16:      # never leave a tail under 16 elements
            n = rows - r
        chunk = torch.randn((n,) + shape[1:], generator=g, dtype=torch.float32)
        a, b = max(r, r_lo), min(r + n, r_hi)
        if a < b:
            out[a - r_lo:b - r_lo] = (chunk[(slice(a - r, b - r),) + rest] * std).to(dtype)
        r += n
    return out
