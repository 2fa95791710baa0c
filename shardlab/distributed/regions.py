"""Regions of a global tensor: boxes, flat ranges, and which rank writes a replicated piece.

A *box* is ``(offsets, sizes)``: the block ``t[o0:o0+s0, o1:o1+s1, ...]`` of a global tensor.
Every local tensor a rank holds maps to boxes of global tensors:

* a tensor-parallel / expert / pipeline slice (a :class:`~.placement.Placement` with ``dim``)
  is one box (its padding excluded);
* a ZeRO/FSDP flat shard covers a flat (row-major) element range ``[lo, hi)`` of each local
  parameter, which :func:`flat_boxes` cuts into at most ``2 * ndim - 1`` boxes.

Initialisation (models/init.py) and checkpoints (checkpoint/save.py) speak only in boxes, so
neither ever needs a full copy of a tensor that the layout shards.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_boxes(shape, lo: int, hi: int) -> list[Box]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes, in flat order."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= lo <= hi <= math.prod(shape):
        raise ValueError(f"flat_boxes: range [{lo}, {hi}) outside a tensor of {math.prod(shape)} elements")
    if lo == hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    r0, r1 = lo // inner, (hi - 1) // inner      # first and last dim-0 row touched
    if r0 == r1:                                  # inside one row: recurse into it
        return [((r0,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], lo - r0 * inner, hi - r0 * inner)]
    out: list[Box] = []
    first_full = r0
    if lo % inner:                                # partial first row
        out += [((r0,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], lo % inner, inner)]
        first_full = r0 + 1
    last_full = r1 if hi % inner == 0 else r1 - 1  # rows first_full..last_full are whole
    if last_full >= first_full:
        out.append(((first_full,) + (0,) * (len(shape) - 1), (last_full - first_full + 1,) + shape[1:]))
    if hi % inner:                                # partial last row
        out += [((r1,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], 0, hi % inner)]
    return out


def placement_box(pl, local_shape) -> Box:
    """The box of the global tensor that a local tensor with placement ``pl`` holds (padding
    excluded). ``local_shape`` is the local tensor's shape."""
    glob = tuple(pl.global_shape)
    if pl.dim is None:
        return (0,) * len(glob), glob
    sizes = list(local_shape)
    sizes[pl.dim] = pl.length if pl.length is not None else local_shape[pl.dim]
    offsets = [0] * len(glob)
    offsets[pl.dim] = pl.start
    return tuple(offsets), tuple(sizes)


def sub_box(outer: Box, inner: Box) -> Box:
    """``inner`` is a box in the coordinates of the tensor that ``outer`` describes; return it
    in the global coordinates of ``outer``'s tensor."""
    return tuple(a + b for a, b in zip(outer[0], inner[0])), tuple(inner[1])


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def writes_piece(pl, mesh, replicate_groups: tuple[str, ...]) -> bool:
    """Whether this rank is the one rank, among those holding an identical copy of a piece with
    placement ``pl``, that writes it: index 0 in every group over which the piece is replicated
    (``replicate_groups``, plus tp when the piece is not tensor-parallel), and the first of the
    tp ranks that share a replicated key/value head (``pl.copies``)."""
    groups = list(replicate_groups)
    if "tp" not in pl.sharded_over:
        groups.append("tp")
    if "pp" not in pl.sharded_over:
        groups.append("pp")
    if any(mesh.size(g) > 1 and mesh.local_rank(g) != 0 for g in groups):
        return False
    return pl.copies == 1 or mesh.local_rank("tp") % pl.copies == 0


class Piece(NamedTuple):
    """A box of a global tensor that one rank holds: the unit of checkpoints and of state
    exchange. ``tensor.shape`` is the box's sizes."""
    key: str
    """``model.<global name>`` or ``optim.<global name>.<state>``."""
    global_shape: tuple
    """Shape of the whole tensor (``()`` for scalars)."""
    offsets: tuple
    """Origin of the box in global coordinates."""
    tensor: torch.Tensor
    """The box's values."""
