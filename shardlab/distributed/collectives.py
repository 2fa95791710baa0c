"""Collectives on one named group, counted in the ledger: ``comm = mesh.comm("tp")``.

Every parallel module communicates through a :class:`Comm` so that every byte is counted.
``algorithm`` picks the backend's implementation or shardlab's own (ring / tree / rhd, built
on point-to-point ops; see the collectives issue) per call.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .ledger import Ledger, ring_bytes

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Pending:
    """The handle of an ``async_op=True`` collective: ``wait()`` blocks until it is done, applies
    any finishing step (the division of ``op="avg"``) and returns the result tensor."""

    def __init__(self, work, result: torch.Tensor, finish=None):
        self.work, self.result, self.finish = work, result, finish

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.finish is not None:
                self.finish(self.result)
        return self.result


def _done(t: torch.Tensor, async_op: bool):
    return Pending(None, t) if async_op else t


def _avg(size: int):
    return lambda t: t.div_(size)


class Comm:
    """A process group with a name, its member ranks, the rank's ledger and an algorithm choice."""

    def __init__(self, name: str, group, ranks: list[int], rank: int, ledger: Ledger,
                 algorithm: str = "backend"):
        self.name, self.group, self.ranks, self.ledger = name, group, list(ranks), ledger
        self.algorithm = algorithm
        self.size = len(self.ranks)
        self.rank = self.ranks.index(rank)  # index inside the group
        self.global_rank = rank

    def __repr__(self):
        return f"Comm({self.name!r}, size={self.size}, rank={self.rank})"

    def _count(self, op: str, nbytes: int):
        sent = ring_bytes(op, nbytes, self.size)
        self.ledger.record(op, self.name, sent, sent)

    # -- collectives (in place where torch is) -----------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        """In place: t <- op over the group. ``op``: sum, avg, max, min.
        ``async_op=True`` returns a :class:`Pending` whose ``wait()`` gives ``t``."""
        if self.size == 1:
            return _done(t, async_op)
        self._count("all_reduce", _nbytes(t))
        work = dist.all_reduce(t, op=_OPS["sum" if op == "avg" else op], group=self.group, async_op=async_op)
        if async_op:
            return Pending(work, t, _avg(self.size) if op == "avg" else None)
        if op == "avg":
            t.div_(self.size)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0, async_op: bool = False, out: torch.Tensor | None = None):
        """Concatenate every rank's ``t`` along ``dim`` (equal shapes). For ``dim=0``, ``out``
        (optional) receives the result and ``async_op=True`` returns a :class:`Pending`."""
        if self.size == 1:
            if out is not None:
                out.copy_(t)
                t = out
            return _done(t, async_op)
        self._count("all_gather", _nbytes(t) * self.size)
        if dim == 0:
            if out is None:
                out = torch.empty((t.shape[0] * self.size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            work = dist.all_gather_into_tensor(out, t.contiguous(), group=self.group, async_op=async_op)
            return Pending(work, out) if async_op else out
        if async_op or out is not None:
            raise ValueError("all_gather: async_op and out are supported for dim=0 only")
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0, op: str = "sum", async_op: bool = False):
        """Reduce over the group and keep this rank's 1/size slice of ``dim``.
        ``async_op=True`` (dim 0 only) returns a :class:`Pending` whose ``wait()`` gives the slice."""
        if self.size == 1:
            return _done(t, async_op)
        if async_op:
            if dim != 0 or t.shape[0] % self.size:
                raise ValueError(f"reduce_scatter(async_op=True) needs dim 0 divisible by {self.size}")
            self._count("reduce_scatter", _nbytes(t))
            out = torch.empty((t.shape[0] // self.size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            work = dist.reduce_scatter_tensor(out, t.contiguous(), op=_OPS["sum" if op == "avg" else op],
                                              group=self.group, async_op=True)
            return Pending(work, out, _avg(self.size) if op == "avg" else None)
        if t.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} not divisible by {self.size}")
        self._count("reduce_scatter", _nbytes(t))
        x = t if dim == 0 else t.movedim(dim, 0)
        x = x.contiguous()
        out = torch.empty((x.shape[0] // self.size,) + tuple(x.shape[1:]), dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, x, op=_OPS["sum" if op == "avg" else op], group=self.group)
        if op == "avg":
            out.div_(self.size)
        return out if dim == 0 else out.movedim(0, dim).contiguous()

    def all_to_all(self, t: torch.Tensor, in_splits: list[int] | None = None,
                   out_splits: list[int] | None = None) -> torch.Tensor:
        """Exchange dim-0 chunks: chunk i of ``t`` goes to rank i (uneven splits allowed)."""
        if self.size == 1:
            return t
        if in_splits is None:
            in_splits = [t.shape[0] // self.size] * self.size
        if out_splits is None:
            out_splits = in_splits
        out = torch.empty((sum(out_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        row = _nbytes(t) // max(1, t.shape[0]) if t.shape[0] else 0
        sent = row * (sum(in_splits) - in_splits[self.rank])
        recv = row * (sum(out_splits) - out_splits[self.rank])
        self.ledger.record("all_to_all", self.name, sent, recv)
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0, async_op: bool = False):
        """In place from group rank ``src``."""
        if self.size == 1:
            return _done(t, async_op)
        self._count("broadcast", _nbytes(t))
        work = dist.broadcast(t, src=self.ranks[src], group=self.group, async_op=async_op)
        return Pending(work, t) if async_op else t

    # -- point to point (group-relative peers) -------------------------------------------------
    def isend(self, t: torch.Tensor, peer: int):
        self.ledger.record("send", self.name, _nbytes(t), 0)
        return dist.isend(t.contiguous(), dst=self.ranks[peer], group=self.group)

    def irecv(self, t: torch.Tensor, peer: int):
        self.ledger.record("recv", self.name, 0, _nbytes(t))
        return dist.irecv(t, src=self.ranks[peer], group=self.group)

    def barrier(self):
        if self.size > 1:
            dist.barrier(group=self.group)
