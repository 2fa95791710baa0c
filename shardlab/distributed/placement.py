"""Placement: how a rank's local parameter maps to its global tensor.

Parallel modules that shard or place a parameter attach a :class:`Placement` to it
(``set_placement(param, ...)``). The gradient norm uses it to count each global element once,
and checkpoints use it to save and load in global coordinates (any layout -> any layout).
A parameter without one is a full copy, replicated on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ATTR = "_shardlab_placement"


@dataclass(frozen=True)
class Placement:
    name: str
    """Global name of the tensor (the checkpoint key), e.g. ``layers.3.attention.wq.weight``."""
    global_shape: tuple
    """Shape of the full, unsharded tensor (without padding)."""
    dim: int | None = None
    """Dimension along which the local tensor is a slice; None = the full tensor."""
    start: int = 0
    """Offset of the local slice along ``dim`` in the global tensor."""
    length: int | None = None
    """Valid (unpadded) length of the local slice along ``dim``; the rest is padding."""
    sharded_over: tuple = field(default_factory=tuple)
    """Mesh groups whose ranks hold different parts (or different tensors): e.g. ("tp",), ("pp",).
    The ranks outside these groups hold identical copies."""
    copies: int = 1
    """Ranks inside the ``sharded_over`` groups that hold this same slice (e.g. key/value heads
    replicated when tp > n_kv_heads: tp // n_kv_heads copies of each head)."""

    def valid(self, local: torch.Tensor) -> torch.Tensor:
        """The part of ``local`` that is real data (padding removed)."""
        if self.dim is None or self.length is None or self.length == local.shape[self.dim]:
            return local
        return local.narrow(self.dim, 0, self.length)


def set_placement(param: torch.Tensor, placement: Placement) -> None:
    setattr(param, ATTR, placement)


def get_placement(param: torch.Tensor, name: str) -> Placement:
    """The parameter's placement, or 'full copy named ``name``' when it has none."""
    pl = getattr(param, ATTR, None)
    return pl if pl is not None else Placement(name, tuple(param.shape))


def replicas(placement: Placement, mesh) -> int:
    """How many ranks hold an identical copy of this local tensor."""
    n = mesh.world_size
    for g in placement.sharded_over:
        n //= mesh.size(g)
    return n * placement.copies
