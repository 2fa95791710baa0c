"""DualPipe's two parameter copies: gradient sum per rank pair, norm and checkpoints counted once.

Under DualPipe (dualpipe.py) the model is cut into ``p`` parts and pipeline rank ``r`` holds part
``r`` (stage id ``r``, the "down" direction) and part ``p-1-r`` (stage id ``2p-1-r``, the "up"
direction). So every part lives on the two ranks ``r`` and ``p-1-r`` (``p`` even: the pairs
``(i, p-1-i)`` are disjoint), each copy under its global parameter names:

* Init: both copies are drawn from (seed, global name) (parallel/materialize.py), so they start
  equal; loading a checkpoint fills both from the same global tensors.
* Step: each copy's gradient covers only the micro-batches of its direction. After the schedule,
  gradients are averaged over ``dp_cp`` (the base Engine), then summed over the pair (one
  all-reduce of a flat buffer over a 2-rank group): both copies then hold the full gradient,
  bit-equal (a + b == b + a), so clipping and the optimizer keep them bit-equal.
* Norm and checkpoints: a part is counted (and saved) once, by the rank holding it as its "down"
  stage (stage id == pp rank): the mirror copy is left out of the gradient norm and of the pieces.

The pair is the Mesh's ``pp_pair`` group (distributed/topology.py), built with the others, so its
all-reduce is counted and runs on the Mesh's transport (shared memory on one host); for ``p = 2``
it is the pipeline group itself.
"""
from __future__ import annotations

import torch

from ...distributed.placement import get_placement, replicas
from ...checkpoint import pieces as state
from .executor import PipelineEngine


class DualPipeEngine(PipelineEngine):
    """PipelineEngine over DualPipe's two parameter copies per rank (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pair = self.mesh.comm("pp_pair")  # ranks i and pp-1-i: the two copies of the same stages
        down = self.chunks[self.pp_rank]  # stage id == pp rank: the part this rank owns
        self._owned = {id(p) for p in down.parameters()}

    def owned(self, named):
        """The (name, parameter) pairs of ``named`` this rank counts and saves."""
        return [(n, p) for n, p in named if id(p) in self._owned]

    def sync_grads(self):
        super().sync_grads()  # average over dp_cp first; the pair sum last keeps the copies bit-equal
        params = [p for _, p in self.named_parameters()]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.pair.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm, each global element counted once: the mirror copies are left out."""
        by_copies: dict[int, list[torch.Tensor]] = {}
        for name, p in self.owned(self.named_parameters()):
            if p.grad is not None:
                pl = get_placement(p, name)
                by_copies.setdefault(replicas(pl, self.mesh), []).append(pl.valid(p.grad.detach()))
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for copies, grads in by_copies.items():
            sq += torch.nn.utils.get_total_norm(grads).double().square().to(sq.device) / copies
        self.mesh.comm("world").all_reduce(sq)
        return sq.sqrt()

    def state_pieces(self, optimizer) -> list:
        """Each global parameter once: the owner's copy (loading fills both copies)."""
        return state.param_pieces(self.owned(self.named_parameters(all_params=True)), optimizer, self.mesh,
                                  self.replicate_groups)
