"""Layout-independent initialisation, one box at a time.

The global initial value of a parameter is ``randn(shape, generator=G(seed, name)) * std`` (or
ones, for norm weights): the same on every rank and under every layout. A rank that owns only a
box of it (a tensor-parallel slice, an expert range, a piece of an FSDP flat shard) must get
exactly those values without ever holding the whole tensor.

The CPU generator cannot jump ahead, so :func:`init_box` streams: it draws the tensor in chunks
of whole dim-0 rows, in order, keeping the part of each chunk inside the box and stopping after
the box's last row. Memory is one chunk (about 1M elements) plus the box. Drawing a tensor in
chunks gives bit-identical values to drawing it at once because ``normal_`` consumes the
generator in groups of 16 and handles a tail shorter than 16 by redrawing the last 16: every
chunk but the last is a multiple of 16 elements and the last is at least 16 (or the whole
tensor) -- tests/unit/test_init.py checks this against ``torch.randn`` on awkward shapes.
"""
from __future__ import annotations

import math
import zlib

import torch

CHUNK = 1 << 20  # elements drawn per chunk


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
