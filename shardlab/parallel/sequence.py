"""Sequence-parallel layers (Korthikanti et al. 2022): modules whose parameters are replicated
over tp while each rank sees only its S/tp tokens of the sequence, so every parameter gradient
is a partial sum; f (copy_to_region: identity forward, all-reduce backward) applied to the
parameter sums it over tp inside backward. Used by the ``sequence_parallel_norm`` and
``position_embedding`` styles of parallel/tensor.py (the row-parallel bias does the same inline).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import autograd as dc


def _param(w: torch.Tensor) -> nn.Parameter:
    """Keep an existing Parameter (and its Placement); wrap a plain tensor."""
    return w if isinstance(w, nn.Parameter) else nn.Parameter(w)


class SequenceParallelNorm(nn.Module):
    """Any norm (RMSNorm, LayerNorm) on a sequence shard: its parameters are replicated, but each
    rank sees S/tp tokens, so their gradients are partial sums; f on each parameter sums them
    over tp inside backward. The norm's parameters are registered here under their own names
    (checkpoint keys unchanged) and the norm runs with them through ``functional_call``."""

    def __init__(self, norm: nn.Module, comm):
        super().__init__()
        for key, p in norm.named_parameters(recurse=False):
            self.register_parameter(key, p)
        self._norm = (norm,)  # a tuple: not a submodule, its parameters are this module's
        self.comm = comm

    def forward(self, x):
        params = {k: dc.copy_to_region(p, self.comm) for k, p in self.named_parameters(recurse=False)}
        return torch.func.functional_call(self._norm[0], params, (x,))


class SequenceParallelPositionEmbedding(nn.Module):
    """A learned position embedding under sequence parallel: the token embedding's reduce-scatter
    left this rank S/tp tokens of the sequence (chunk ``rank``), so the lookup of the (local)
    ``positions`` is narrowed to the same chunk. The table is replicated; each rank's gradient
    covers only its chunk's rows, so f on the weight sums it over tp in backward."""

    def __init__(self, weight: torch.Tensor, comm):
        super().__init__()
        self.weight = _param(weight)
        self.comm = comm

    def forward(self, positions):
        out = F.embedding(positions, dc.copy_to_region(self.weight, self.comm))
        n = out.shape[-2] // self.comm.size
        return out.narrow(-2, self.comm.rank * n, n)
