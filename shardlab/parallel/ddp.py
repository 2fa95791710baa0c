"""DDP: every rank holds the whole model; gradients are averaged over the data-parallel group.

How (the same design as ``torch.nn.parallel.DistributedDataParallel``, in ~200 lines):

* At wrap, rank 0's parameters and buffers are broadcast so that every replica starts equal.
* Parameters are packed, in *reverse* registration order (roughly the order in which backward
  produces their gradients), into buckets of at most ``bucket_cap_mb`` MiB. Each bucket owns one
  flat gradient buffer and every ``param.grad`` is made a view into it ("gradient as bucket
  view"): no second copy of the gradients exists.
* A post-accumulate-grad hook per parameter counts the bucket's ready gradients; when a bucket
  is complete its all-reduce is launched asynchronously while backward goes on computing the
  earlier layers (overlap). Buckets are launched in index order on every rank (a bucket that
  becomes ready early waits for its predecessors), so all ranks issue the same collective sequence.
* At the end of backward (an autograd callback) the pending all-reduces are waited and divided
  by the group size. Inside ``with ddp.no_sync():`` hooks only accumulate (gradient accumulation).

* ``grad_dtype`` (``train.reduce_dtype`` in the engine): buckets stored and all-reduced in a lower
  dtype than the parameters (bf16: 2 bytes/param). Gradients are then not views: each hook adds
  ``param.grad`` into its bucket and drops it; the optimizer gets fp32 copies during its step only.

Communication per step: one all-reduce of all gradients = 2 Psi (N-1)/N elements per rank.
Memory per rank: the full model, its gradients and the full optimizer state (16 Psi bytes for
mixed-precision Adam, 4+4+8 = 16 Psi in fp32).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.collectives import Comm
from ..distributed.ledger import Ledger
from ..distributed.placement import ATTR, get_placement
from .engine import Engine


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device, dtype):
        self.params = params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.flat = torch.zeros(n, device=device, dtype=dtype)
        self.ready = 0
        self.pending = None  # Pending all-reduce

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


def make_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """Reverse order, split when a bucket would exceed ``cap_bytes`` or the dtype changes."""
    buckets, cur, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > cap_bytes or p.dtype != cur[0].dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class DistributedDataParallel(nn.Module):
    """Drop-in for the common subset of ``torch.nn.parallel.DistributedDataParallel``.

    ``module``, ``device_ids``/``output_device`` (accepted, the module is already on its device),
    ``broadcast_buffers``, ``process_group`` (a torch group) *or* ``comm`` (a shardlab Comm, e.g.
    ``mesh.comm("dp_cp")``), ``bucket_cap_mb``. ``overlap=False`` launches every all-reduce only
    after backward (for comparison). The wrapped model is ``.module``.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group=None, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, *, comm: Comm | None = None, overlap: bool = True,
                 params: list[nn.Parameter] | None = None, grad_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.comm = comm or _comm_for(process_group)
        self.broadcast_buffers, self.overlap = broadcast_buffers, overlap
        self._sync = True
        if params is None:  # (shardlab) ``params``: only these are bucketed and averaged
            seen, params = set(), []
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self._broadcast_from_rank0(params)
        self.buckets = [_Bucket(b, b[0].device, grad_dtype or b[0].dtype)
                        for b in make_buckets(params, bucket_cap_mb * 2**20)]
        self.separate = any(b.flat.dtype != b.params[0].dtype for b in self.buckets)
        self._filled: set[int] = set()  # separate buckets: parameters whose gradient arrived
        self._where = {}  # id(param) -> (bucket index, index in bucket)
        self._hooks = []
        for bi, b in enumerate(self.buckets):
            for i, p in enumerate(b.params):
                self._where[id(p)] = (bi, i)
                p.grad = None
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._next = 0            # first bucket not launched yet in this backward
        self.overlapped = 0       # buckets launched from a hook (statistics, tests)
        self._callback_queued = False

    # -- torch DDP API ---------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and torch.is_grad_enabled():
            for b in self.module.buffers():
                self.comm.broadcast(b, 0)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- hooks -----------------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast_from_rank0(self, params):
        for t in list(params) + list(self.module.buffers()):
            self.comm.broadcast(t.data, 0)

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor):
        bi, i = self._where[id(p)]
        bucket = self.buckets[bi]
        view = bucket.view(i)
        if self.separate:  # low-precision bucket: first gradient of the step overwrites, then adds
            view.add_(p.grad) if id(p) in self._filled else view.copy_(p.grad)
            self._filled.add(id(p))
            p.grad = None
        elif p.grad.data_ptr() != view.data_ptr():  # a fresh grad (after zero_grad(set_to_none))
            view.copy_(p.grad)
            p.grad = view
        if not self._sync:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True
        bucket.ready += 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self, force: bool = False):
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and b.ready < len(b.params):
                break
            b.pending = self.comm.all_reduce_async(b.flat, op="sum")
            self._next += 1
            self.overlapped += not force  # launched while backward was still running

    @torch.no_grad()
    def finish(self):
        """End of a synchronising backward: launch what is left, wait, average."""
        for b in self.buckets:  # parameters that got no gradient contribute zeros
            if b.ready < len(b.params):
                for i, p in enumerate(b.params):
                    if self.separate and id(p) not in self._filled:
                        b.view(i).zero_()
                    elif not self.separate and p.grad is None:
                        b.view(i).zero_()
                        p.grad = b.view(i)
        self._launch_ready(force=True)
        for b in self.buckets:
            b.pending.wait()
            b.flat.div_(self.comm.size)
            b.pending, b.ready = None, 0
        self._next, self._callback_queued = 0, False
        self._filled.clear()

    def materialize_grads(self, on: bool):
        """Separate (low-precision) buckets: give every parameter a ``.grad`` in its own dtype
        (``on``, before the optimizer step) or drop them again (after it)."""
        if not self.separate:
            return
        for b in self.buckets:
            for i, p in enumerate(b.params):
                p.grad = b.view(i).to(p.dtype) if on else None


def _comm_for(process_group) -> Comm:
    """A Comm over a plain torch process group (default: the world), with its own ledger."""
    group = process_group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    return Comm("dp", group, ranks, dist.get_rank(), Ledger())


class DDPEngine(Engine):
    """The Engine for ``zero_stage = 0``: DDP over ``dp_cp``; ``no_sync`` on all micro-batches
    but the last, so the step communicates once whatever the accumulation."""

    name = "ddp"

    def __init__(self, model: nn.Module, mesh, cfg, group: str = "dp_cp"):
        super().__init__(model, mesh, cfg)
        # Expert weights (expert parallel) are averaged over another group: the base rule does it.
        self.experts = [p for n, p in self.named_parameters() if "ep" in get_placement(p, n).sharded_over]
        dense = [p for p in self.parameters() if all(p is not q for q in self.experts)]
        low = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(cfg.train.reduce_dtype)
        if low is not None and (self.experts or self._placed()):
            raise NotImplementedError("train.reduce_dtype with DDP covers plain data parallel (no TP, PP or "
                                      "experts); leave train.reduce_dtype empty for this layout")
        self.ddp = DistributedDataParallel(model, comm=mesh.comm(group), bucket_cap_mb=cfg.parallel.bucket_cap_mb,
                                           broadcast_buffers=False, overlap=cfg.parallel.overlap_comm, params=dense,
                                           grad_dtype=low)

    def make_optimizer(self, build):
        opt = super().make_optimizer(build)
        if self.ddp.separate:  # fp32 gradients exist only during the step
            opt.register_step_pre_hook(lambda *_: self.ddp.materialize_grads(True))
            opt.register_step_post_hook(lambda *_: self.ddp.materialize_grads(False))
        return opt

    def forward(self, *args, sync: bool = True, **kwargs):
        """Through the DDP wrapper; ``sync=False`` runs under ``no_sync`` (its backward only
        accumulates: the hooks read the flag when backward reaches them)."""
        self.ddp._sync = sync
        return self.ddp(*args, **kwargs)

    def sync_grads(self):
        """The dense gradients were all-reduced inside backward (see ``finish``); expert
        gradients are summed over the ranks holding the same experts, as in the base Engine."""
        for p in self.experts:
            if p.grad is not None:
                self.mesh.comm("edp").all_reduce(p.grad).div_(self.mesh.size("dp_cp"))

    def grad_norm(self) -> torch.Tensor:
        """After the all-reduce every rank holds the same averaged gradients: the norm is local,
        one fused reduction per bucket (tensors placed by TP/PP fall back to the general rule)."""
        if self._placed():
            return super().grad_norm()
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for b in self.ddp.buckets:
            flat = b.flat.float() if b.flat.dtype in (torch.float16, torch.bfloat16) else b.flat
            sq += torch.linalg.vector_norm(flat).double().square()  # fused, in the grads' dtype
        return sq.sqrt()

    def _placed(self) -> bool:
        return any(getattr(p, ATTR, None) is not None for p in self.parameters())

    def grads(self) -> list[torch.Tensor]:
        if self._placed():
            return super().grads()
        return [b.flat for b in self.ddp.buckets]  # the gradients are views into the buckets


def apply(model: nn.Module, mesh, cfg) -> DDPEngine:
    return DDPEngine(model, mesh, cfg)
