"""The Engine: what the train loop (and ``shardlab.initialize``) drives for any layout.

An Engine owns the local module and knows how to run forward+backward over the step's
micro-batches, how gradients are synchronised, how to build the optimizer, and how its local
tensors map to global ones (for the gradient norm and for checkpoints). This base class is a
model replicated on every rank with one all-reduce per gradient after backward; DDP, ZeRO-1/2,
FSDP and the pipeline subclass it. ``parallelize.py`` composes the parallel modules and returns one.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ..distributed import heap
from ..distributed.mesh import Mesh
from ..distributed.placement import get_placement, replicas
from ..checkpoint.reshard import gather_pieces
from ..checkpoint import pieces as state


def by_device_and_dtype(tensors) -> dict[tuple, list[torch.Tensor]]:
    """``{(device, dtype): [tensors]}``: a fused (foreach) kernel takes one device and dtype per call."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


class Engine:
    """Base engine: a model replicated on every rank, gradients averaged over ``dp_cp`` after
    backward (one all-reduce per parameter). Parallel modules subclass or replace this."""

    name = "replicated"

    def __init__(self, model: nn.Module, mesh: Mesh, cfg):
        self.model, self.mesh, self.cfg = model, mesh, cfg
        # (tokens, targets) of a micro-batch -> what this rank feeds its model (context
        # parallel keeps this rank's load-balanced sequence shard).
        self.shard_batch = None

    def _local(self, x, y):
        return self.shard_batch(x, y) if self.shard_batch else (x, y)

    # -- one micro-batch at a time: the loop below and shardlab.initialize's engine (api.py) ---
    # An engine that communicates during backward overrides these four; the step's structure
    # (start, [forward, backward, after_backward] per micro-batch, sync_grads) is the same for all.
    def start_step(self) -> None:
        """Before the first micro-batch of a step (sharded engines zero their gradient shards)."""

    def forward(self, *args, sync: bool = True, **kwargs):
        """The model's forward for one micro-batch. ``sync``: this micro-batch's backward ends the
        step's accumulation and synchronises gradients (DDP's ``no_sync`` on the others)."""
        return self.model(*args, **kwargs)

    def after_backward(self, sync: bool) -> None:
        """After one micro-batch's backward (ZeRO/FSDP: collect the reduced gradient parts)."""

    def forward_backward(self, micro_batches, loss_scale: float = 1.0, autocast=None,
                         mark=None) -> torch.Tensor:
        """Accumulate gradients of the mean loss over all micro-batches and data-parallel ranks.
        Returns the local mean loss (detached) for logging. ``mark(phase)``, when given, is called
        as each micro-batch's "forward" and "backward" begin (analysis/measured_memory.py's timeline)."""
        self.start_step()
        n = len(micro_batches)
        total = torch.zeros((), device=self.mesh.device, dtype=torch.float64)
        for k, (x, y) in enumerate(micro_batches):
            x, y = self._local(x, y)
            if mark:
                mark("forward")
            with autocast() if autocast else nullcontext():
                loss = self.forward(x, y, sync=k == n - 1)
            heap.release(self.mesh.device)  # the forward's freed temporaries, before backward grows the heap
            if mark:
                mark("backward")
            (loss * (loss_scale / n)).backward()
            self.after_backward(k == n - 1)
            total += loss.detach().double()
        self.sync_grads()
        return total / n

    @torch.no_grad()
    def evaluate(self, micro_batches, autocast=None) -> torch.Tensor:
        """Local mean loss over the micro-batches, no gradients."""
        total = torch.zeros((), device=self.mesh.device, dtype=torch.float64)
        for x, y in micro_batches:
            x, y = self._local(x, y)
            with autocast() if autocast else nullcontext():
                total += self.model(x, y).double()
        return total / len(micro_batches)

    def sync_grads(self):
        if self.mesh.size("dp_cp") == 1 and self.mesh.size("edp") == 1:
            return  # nothing to average (one rank, or model-parallel only): no per-parameter calls
        comm = self.mesh.comm("dp_cp")
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            if "ep" in get_placement(p, name).sharded_over:
                # Expert weights: the all-to-all backward already summed the ep ranks' gradients;
                # add those of the ranks holding the same experts, divide by the data-parallel size.
                self.mesh.comm("edp").all_reduce(p.grad).div_(self.mesh.size("dp_cp"))
            else:
                comm.all_reduce(p.grad, op="avg")

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean of the local losses over the ranks that compute a loss."""
        t = local.detach().clone().to(torch.float64)
        return float(self.mesh.comm("dp_cp").all_reduce(t, op="avg"))

    # -- optimizer and norms ---------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for p in self.model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def named_parameters(self, all_params: bool = False):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad or all_params]

    def make_optimizer(self, build):
        """``build(param_groups)`` -> optimizer. ZeRO engines wrap or shard it."""
        return build(self.param_groups())

    def param_groups(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        return [{"params": decay, "weight_decay": self.cfg.train.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient, each global element counted once: every rank adds
        its local squares divided by the number of identical copies (placement.py), then one
        all-reduce over the world."""
        by_copies: dict[int, list[torch.Tensor]] = {}
        for name, p in self.named_parameters():
            if p.grad is not None:
                pl = get_placement(p, name)
                by_copies.setdefault(replicas(pl, self.mesh), []).append(pl.valid(p.grad.detach()))
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for copies, grads in by_copies.items():  # one fused (foreach) norm per group
            sq += torch.nn.utils.get_total_norm(grads).double().square().to(sq.device) / copies
        if self.mesh.world_size > 1:
            self.mesh.comm("world").all_reduce(sq)
        return sq.sqrt()

    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds (engines with flat buffers return those)."""
        return [p.grad for p in self.parameters() if p.grad is not None]

    def clip_grads(self, max_norm: float, read: bool = True) -> float | torch.Tensor:
        """Scale every gradient by min(1, max_norm / global norm); returns the norm (``read=False``:
        as the device tensor, without a host read)."""
        norm = self.grad_norm()
        if max_norm > 0:  # always scaled (by exactly 1.0 when under the limit): no host read here
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for (device, dtype), grads in by_device_and_dtype(self.grads()).items():
                torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
        return float(norm) if read else norm

    # -- state in global coordinates (checkpoints: checkpoint/pieces.py) ----------------------------
    def replicate_groups(self, pl) -> tuple[str, ...]:
        """Groups over which a parameter with placement ``pl`` is replicated (tp and pp are
        added by ``writes_piece`` when the placement does not shard over them)."""
        return ("edp",) if "ep" in pl.sharded_over else ("dp_cp",)

    def state_pieces(self, optimizer) -> list:
        """This rank's :class:`Piece` s of the model and optimizer state; of identical replicas
        only one rank lists a piece. No communication."""
        return state.param_pieces(self.named_parameters(all_params=True), optimizer, self.mesh,
                                  self.replicate_groups)

    def load_pieces(self, reader, optimizer) -> None:
        """Read exactly this rank's boxes from ``reader`` (any saving layout). No communication."""
        state.load_param_pieces(self.named_parameters(all_params=True), reader, optimizer)

    def full_state(self, optimizer, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """Global tensors ``model.<global name>`` and ``optim.<global name>.<state>`` assembled
        from every rank's pieces, on rank 0 (on every rank with ``everywhere``). Collective;
        holds the whole state: for tests and small models (checkpoints never use it)."""
        return gather_pieces(self.state_pieces(optimizer), self.mesh, everywhere)

    def load_full_state(self, tensors: dict[str, torch.Tensor], optimizer) -> None:
        """Cut this rank's shards out of global tensors (any saving layout)."""
        self.load_pieces(state.DictReader(tensors), optimizer)
