"""Global coordinates for checkpoints: gather local shards into global tensors, and cut the
local shard of a global tensor for any layout.

Every local tensor is described by a :class:`~shardlab.distributed.placement.Placement`
(global name and shape, the sliced dimension, offset, valid length). Saving gathers the
valid parts to rank 0, which assembles the global tensors; loading gives every rank the
global tensors, from which it cuts its own slice (zero-padding where its layout pads). So a
checkpoint written under one layout loads under any other.

Scaling note: consolidating through rank 0 needs the whole model state in rank 0's host
memory; fine for the CPU and single-node sizes shardlab trains, not for 70B (per-rank files
with the same placement records are the next step, see docs/composition.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .placement import Placement


def gather_global(items: list[tuple[str, Placement, torch.Tensor]], mesh,
                  everywhere: bool = False) -> dict[str, torch.Tensor]:
    """``items``: (key, placement, local tensor) of this rank. Returns the global tensors on
    rank 0 (every key complete) and an empty dict on the other ranks (on every rank when
    ``everywhere``)."""
    pieces = [(key, tuple(pl.global_shape), pl.dim, pl.start, pl.valid(t.detach()).cpu().clone())
              for key, pl, t in items]
    if mesh.world_size == 1:
        gathered = [pieces]
    elif everywhere:
        gathered = [None] * mesh.world_size
        dist.all_gather_object(gathered, pieces, group=mesh.group("world"))
    else:
        gathered = [None] * mesh.world_size if mesh.rank == 0 else None
        dist.gather_object(pieces, gathered, dst=0, group=mesh.group("world"))
        if mesh.rank != 0:
            return {}
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for rank_pieces in gathered:
        for key, shape, dim, start, value in rank_pieces:
            if dim is None:
                out[key] = value.reshape(shape)
                filled[key] = -1
                continue
            if key not in out:
                out[key] = torch.zeros(shape, dtype=value.dtype)
                filled[key] = 0
            region = out[key].narrow(dim, start, value.shape[dim])
            region.copy_(value)
            filled[key] += value.numel()  # replicas add duplicates: checked as >= below
    for key, n in filled.items():
        if n != -1 and n < out[key].numel():
            raise RuntimeError(f"checkpoint: shards of {key} do not cover the global tensor "
                               f"({n} of {out[key].numel()} elements)")
    return out


def local_slice(global_tensor: torch.Tensor, pl: Placement, local_shape) -> torch.Tensor:
    """This rank's part of ``global_tensor`` under placement ``pl`` (zero padding appended)."""
    if tuple(global_tensor.shape) != tuple(pl.global_shape):
        raise RuntimeError(f"checkpoint: {pl.name} has shape {tuple(global_tensor.shape)}, this model "
                           f"expects {tuple(pl.global_shape)} (a different model shape?)")
    if pl.dim is None:
        return global_tensor
    length = pl.length if pl.length is not None else local_shape[pl.dim]
    part = global_tensor.narrow(pl.dim, pl.start, length)
    pad = local_shape[pl.dim] - length
    if pad > 0:
        shape = list(local_shape)
        shape[pl.dim] = pad
        part = torch.cat([part, torch.zeros(shape, dtype=part.dtype)], dim=pl.dim)
    return part
