"""Differentiable collectives: each forward collective paired with the collective its gradient
needs, taking the group (a :class:`~shardlab.distributed.collectives.Comm`) as an argument.

Notation: a group of N ranks; rank r holds ``x_r``. ``L`` is the *total* loss whose gradient
the ranks compute together; ``dL/dy_r`` is the gradient arriving at rank r's output.
Two kinds of tensors meet here:

* replicated: every rank holds the same value, and the loss is counted once (the downstream
  computation is identical on every rank, so every rank receives the same gradient);
* partial / sharded: rank r holds a different value (a slice, or a summand), and the gradient
  arriving at each rank is that rank's own contribution.

The pairs (Megatron-LM's f and g, and their sequence-parallel and MoE cousins):

==========================  =========================  ==========================
function                    forward                    backward
==========================  =========================  ==========================
copy_to_region       (f)    identity                   all-reduce (sum)
reduce_from_region   (g)    all-reduce (sum)           identity
sum_over_ranks              all-reduce (sum)           all-reduce (sum)
scatter_to_region           keep my slice along dim    all-gather along dim
gather_from_region          all-gather along dim       keep my slice along dim
all_gather                  all-gather along dim       reduce-scatter along dim
reduce_scatter              reduce-scatter along dim   all-gather along dim
all_to_all                  all-to-all (splits a->b)   all-to-all (splits b->a)
==========================  =========================  ==========================

Every communication goes through ``comm`` and is therefore counted in the ledger; the
algorithm (backend or shardlab's own) is the Comm's choice. With a group of one rank every
function is the identity. Tests: tests/distributed/test_autograd.py compares every gradient
with a single-process computation of the same global function.

Where a function communicates it goes through :func:`~shardlab.distributed.eager.eager`: inside a
compiled block (``parallel.compile``) that call runs eagerly instead of being traced into the
transports' host code.
"""
from __future__ import annotations

import torch

from .eager import eager
from .lanes import exchange


def _chunk(x: torch.Tensor, comm, dim: int) -> torch.Tensor:
    if x.shape[dim] % comm.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by the group size "
                         f"{comm.size} ({comm.name}); pad it or choose sizes that divide")
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


def _same(t, comm, dim):
    return t.view_as(t)


def _sum(t, comm, dim):
    return comm.all_reduce(t.clone(memory_format=torch.contiguous_format))


def _cat(t, comm, dim):
    return comm.all_gather(t.contiguous(), dim=dim)


def _sum_chunk(t, comm, dim):
    return comm.reduce_scatter(t.contiguous(), dim=dim)


class _Paired(torch.autograd.Function):
    """``forward(x, comm, dim)`` in the forward pass, its adjoint ``backward(g, comm, dim)`` in the
    backward pass: one row of the module doc's table."""

    @staticmethod
    def forward(ctx, x, comm, dim, forward, backward):
        ctx.comm, ctx.dim, ctx.adjoint = comm, dim, backward
        return forward(x, comm, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.adjoint(g, ctx.comm, ctx.dim), None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, in_splits, out_splits):
        ctx.comm, ctx.in_splits, ctx.out_splits = comm, in_splits, out_splits
        return exchange(comm, x.contiguous(), in_splits, out_splits)  # overlapped inside a lane (lanes.py)

    @staticmethod
    def backward(ctx, g):
        return exchange(ctx.comm, g.contiguous(), ctx.out_splits, ctx.in_splits), None, None, None


# Where the functions below communicate: eager inside a compiled block (a graph break there only,
# not on a one-rank group's identity)
_paired, _all_to_all = eager(_Paired.apply), eager(_AllToAll.apply)


def copy_to_region(x: torch.Tensor, comm) -> torch.Tensor:
    """Megatron's f. Forward: y_r = x (x replicated). Backward: dL/dx = sum_r dL/dy_r.

    Use where a replicated activation enters rank-specific computation (the input of a
    column-parallel linear): each rank's branch contributes part of the gradient of x."""
    return x if comm.size == 1 else _paired(x, comm, 0, _same, _sum)


def reduce_from_region(x: torch.Tensor, comm) -> torch.Tensor:
    """Megatron's g. Forward: y = sum_r x_r (y replicated). Backward: dL/dx_r = dL/dy.

    Use where partial sums leave rank-specific computation (the output of a row-parallel
    linear): y is replicated, so every rank already holds the full gradient of y."""
    return x if comm.size == 1 else _paired(x, comm, 0, _sum, _same)


def sum_over_ranks(x: torch.Tensor, comm) -> torch.Tensor:
    """Forward: y = sum_r x_r on every rank. Backward: dL/dx_r = sum_s dL/dy_s (every rank's loss
    depends on the sum: MoE statistics summed over the batch's ranks)."""
    return x if comm.size == 1 else _paired(x, comm, 0, _sum, _sum)


def scatter_to_region(x: torch.Tensor, comm, dim: int = -1) -> torch.Tensor:
    """Forward: y_r = chunk_r(x) along ``dim`` (x replicated; equal chunks).
    Backward: dL/dx = cat_r(dL/dy_r) along ``dim`` (an all-gather): chunk r of x only
    influences y_r."""
    return x if comm.size == 1 else _paired(x, comm, dim, _chunk, _cat)


def gather_from_region(x: torch.Tensor, comm, dim: int = -1) -> torch.Tensor:
    """Forward: y = cat_r(x_r) along ``dim`` (y replicated). Backward: dL/dx_r = chunk_r(dL/dy).

    The gradient of the replicated y is the same on every rank, so no communication is
    needed: each rank keeps the slice its x_r produced."""
    return x if comm.size == 1 else _paired(x, comm, dim, _cat, _chunk)


def all_gather(x: torch.Tensor, comm, dim: int = 0) -> torch.Tensor:
    """Sequence parallel's gather. Forward: y_r = cat_s(x_s) along ``dim`` on every rank, but
    each rank's y_r feeds a different (rank-specific) computation.
    Backward: dL/dx_r = chunk_r(sum_s dL/dy_s): a reduce-scatter along ``dim``."""
    return x if comm.size == 1 else _paired(x, comm, dim, _cat, _sum_chunk)


def reduce_scatter(x: torch.Tensor, comm, dim: int = 0) -> torch.Tensor:
    """Sequence parallel's scatter. Forward: y_r = chunk_r(sum_s x_s) along ``dim``.
    Backward: dL/dx_s = cat_r(dL/dy_r) along ``dim`` for every s: an all-gather (each
    summand x_s influences every chunk with coefficient one)."""
    return x if comm.size == 1 else _paired(x, comm, dim, _sum_chunk, _cat)


def all_to_all(x: torch.Tensor, comm, in_splits: list[int] | None = None,
               out_splits: list[int] | None = None) -> torch.Tensor:
    """Expert parallel's dispatch/combine. Forward: rows ``in_splits[s]`` of x_r (in order)
    go to rank s; y_r = cat_s(rows that rank s sent to r), with ``out_splits[s]`` rows from s.
    Backward: the transpose permutation, i.e. the same exchange with the splits swapped:
    dL/dx_r = all_to_all(dL/dy_r, in_splits=out_splits, out_splits=in_splits).
    Splits may be uneven (and zero); ``None`` means equal splits of dim 0."""
    if comm.size == 1:
        return x
    if in_splits is None:
        in_splits = [x.shape[0] // comm.size] * comm.size
    if out_splits is None:
        out_splits = list(in_splits)
    return _all_to_all(x, comm, list(in_splits), list(out_splits))


# Megatron-LM's names for the sequence-parallel pair, for readers coming from there.
gather_from_sequence_region = all_gather
reduce_scatter_to_sequence_region = reduce_scatter
