"""Collectives on one named group, counted in the ledger: ``comm = mesh.comm("tp")``.

Every parallel module communicates through a :class:`Comm` so that every byte is counted.
``algorithm`` picks the backend's implementation or shardlab's own (ring / tree / rhd, built
on point-to-point ops in algorithms.py) per call: every method takes ``algorithm=`` (default
``self.algorithm``, from ``parallel.comm_algorithm``). Backend ops are counted with the bytes
a ring algorithm would move (ledger.ring_bytes); own algorithms record the bytes they really
sent and received. The ledger labels the first "modelled" and the second "measured".
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import algorithms as algos
from . import flight as fl
from .eager import eager
from .ledger import Ledger, ring_bytes
from .p2p import ProcessGroupP2P, _nbytes

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn); keep both working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _recorded(op: str, args, queued: bool = False):
    """Record the call in the Comm's flight recorder (``args(*a, **k)`` -> (tensors, extra)), run
    the fingerprint check in check mode, dump the recorder if the call raises (flight.py). A call
    that is not ``queued`` first waits for what the comm's thread has queued (shm_thread.py)."""
    def deco(method):
        @functools.wraps(method)
        def wrapper(self, *a, **k):
            thread = None if queued else getattr(self, "_comm_thread", None)
            if thread is not None:
                thread.hold()
            if self._inside:
                return method(self, *a, **k)
            tensors, extra = args(*a, **k)
            entry = self.flight.enter(self, op, tensors, extra)
            self._inside = True
            try:
                if self.flight.check and self.size > 1:
                    fl.check_collective(self, entry, tensors[0].device if tensors else self._fp_device())
                out = method(self, *a, **k)
            except Exception as e:
                fl.dump_all(f"{self.name} {op}: {type(e).__name__}: {e}".splitlines()[0][:300])
                raise
            finally:
                self._inside = False
            if isinstance(out, Pending):
                out.entry = entry
            else:
                entry[-1] = True
            return out
        return eager(wrapper)  # inside a compiled block: a graph break, the call eager (eager.py)
    return deco


def _t_op(t, op="sum", *a, **k):
    return (t,), op


def _t_dim(t, dim=0, *a, **k):
    return (t,), (f"dim={dim}" if dim else None)


def _t_rs(t, dim=0, op="sum", *a, **k):
    return (t,), (f"{op}, dim={dim}" if dim else op)


def _t_a2a(t, in_splits=None, out_splits=None, *a, **k):
    n = len(in_splits) if in_splits is not None else None
    return (t,), {"in": list(in_splits) if in_splits is not None else None,
                  "out": list(out_splits if out_splits is not None else in_splits) if n else None,
                  "row": str(t.dtype).replace("torch.", "") + str(list(t.shape[1:]))}


def _t_src(t, src=0, *a, **k):
    return (t,), f"src={src}"


def _t_out(t, out=None, *a, **k):
    return (t,), None


class Pending:
    """The handle of an asynchronous collective (``Comm.*_async``): ``wait()`` blocks until it is
    done, applies any finishing step (the division of ``op="avg"``) and returns the result."""

    entry = None  # its flight-recorder entry, marked done by wait()

    def __init__(self, work, result: torch.Tensor, finish=None):
        self.work, self.result, self.finish = work, result, finish

    @eager
    def wait(self) -> torch.Tensor:
        if self.entry is not None:
            self.entry[-1] = True
        if self.work is not None:
            try:
                self.work.wait()
            except Exception as e:
                fl.dump_all(f"wait: {type(e).__name__}: {e}".splitlines()[0][:300])
                raise
            self.work = None
            if self.finish is not None:
                self.finish(self.result)
        return self.result


class Comm(ProcessGroupP2P):
    """A process group with a name, its member ranks, the rank's ledger and an algorithm choice."""

    def __init__(self, name: str, group, ranks: list[int], rank: int, ledger: Ledger,
                 algorithm: str = "backend", flight: fl.Recorder | None = None):
        self.name, self.group, self.ranks, self.ledger = name, group, list(ranks), ledger
        self.flight = flight if flight is not None else fl.Recorder(rank)
        self._inside = False
        self.algorithm = algorithm
        self.size = len(self.ranks)
        self.rank = self.ranks.index(rank)  # index inside the group
        self.global_rank = rank

    def __repr__(self):
        return f"Comm({self.name!r}, size={self.size}, rank={self.rank})"

    def _fp_device(self):
        """Where check mode's fingerprints live: the current GPU under NCCL, else the CPU."""
        nccl = self.group is not None and str(dist.get_backend(self.group)) == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _count(self, op: str, nbytes: int):
        sent = ring_bytes(op, nbytes, self.size)
        self.ledger.record(op, self.name, sent, sent, modelled=True)

    def _choose(self, op: str, t: torch.Tensor, algorithm: str | None, nbytes: int) -> str:
        return algos.select(op, algorithm or self.algorithm, nbytes)

    def _host_staged(self, t: torch.Tensor) -> bool:
        """gloo's send/recv read host memory: own algorithms on CUDA tensors over gloo (N ranks
        sharing one GPU) run on a host copy. NCCL sends device memory directly."""
        if t.device.type != "cuda":
            return False
        if not hasattr(self, "_backend"):
            self._backend = str(dist.get_backend(self.group))
        return self._backend == "gloo"

    def _link(self) -> algos.Link:
        return algos.Link(self.group, self.ranks, self.rank)

    def _record(self, op: str, link: algos.Link):
        self.ledger.record(op, self.name, link.sent, link.recv)

    def _own_in_place(self, op: str, t: torch.Tensor, run) -> torch.Tensor:
        """Run an own algorithm ``run(link, flat)`` on ``t`` in place: flatten (a copy when ``t``
        is not contiguous), run, copy back, record the bytes the link really moved."""
        x = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        link = self._link()
        run(link, x)
        if not t.is_contiguous():
            t.copy_(x.view(t.shape))
        self._record(op, link)
        return t

    @staticmethod
    def _check_avg(what: str, t: torch.Tensor, op: str):
        if op == "avg" and not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"{what}(op='avg') of a {t.dtype} tensor is not exact; use op='sum' and divide")

    def _check_divisible(self, t: torch.Tensor, dim: int):
        if t.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} not divisible by {self.size}")

    def _a2a_splits(self, t: torch.Tensor, in_splits, out_splits) -> tuple[list[int], list[int]]:
        """all_to_all's splits: even by default, out = in unless given; checked against ``t``."""
        if in_splits is None:
            in_splits = [t.shape[0] // self.size] * self.size
        if out_splits is None:
            out_splits = in_splits
        if len(in_splits) != self.size or len(out_splits) != self.size or sum(in_splits) != t.shape[0]:
            raise ValueError(f"all_to_all: need {self.size} in/out splits with sum(in_splits) = "
                             f"{t.shape[0]} rows, got {list(in_splits)} / {list(out_splits)}")
        return list(in_splits), list(out_splits)

    def _count_a2a(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]):
        """The rows this rank sends to and receives from the others (its own chunk stays)."""
        row = _nbytes(t) // max(1, t.shape[0]) if t.shape[0] else 0
        self.ledger.record("all_to_all", self.name, row * (sum(in_splits) - in_splits[self.rank]),
                           row * (sum(out_splits) - out_splits[self.rank]), modelled=True)

    # -- collectives (in place where torch is) -----------------------------------------------
    @_recorded("all_reduce", _t_op)
    def all_reduce(self, t: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> torch.Tensor:
        """In place: t <- op over the group. ``op``: sum, avg, max, min."""
        self._check_avg("all_reduce", t, op)
        if self.size == 1:
            return t
        algo = self._choose("all_reduce", t, algorithm, _nbytes(t))
        if algo != "backend" and self._host_staged(t):
            return t.copy_(self.all_reduce(t.cpu(), op, algorithm))
        if algo != "backend":
            self._own_in_place("all_reduce", t, lambda link, x: algos.ALL_REDUCE[algo](link, x, op))
            return t.div_(self.size) if op == "avg" else t
        self._count("all_reduce", _nbytes(t))
        dist.all_reduce(t, op=_OPS["sum" if op == "avg" else op], group=self.group)
        return t.div_(self.size) if op == "avg" else t

    @_recorded("all_gather", _t_dim)
    def all_gather(self, t: torch.Tensor, dim: int = 0, algorithm: str | None = None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (equal shapes)."""
        if self.size == 1:
            return t
        if self._choose("all_gather", t, algorithm, _nbytes(t) * self.size) != "backend":
            if self._host_staged(t):
                return self.all_gather(t.cpu(), dim, algorithm).to(t.device)
            m, n = t.numel(), self.size
            flat = torch.empty(n * m, dtype=t.dtype, device=t.device)
            flat[self.rank * m:(self.rank + 1) * m].copy_(t.reshape(-1))
            link = self._link()
            algos.ring_all_gather_(link, flat, [(i * m, (i + 1) * m) for i in range(n)])
            self._record("all_gather", link)
            parts = flat.view((n,) + tuple(t.shape))
            return torch.cat(list(parts.unbind(0)), dim=dim)
        self._count("all_gather", _nbytes(t) * self.size)
        if dim == 0:
            out = torch.empty((t.shape[0] * self.size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            _all_gather_single(out, t.contiguous(), group=self.group)
            return out
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    @_recorded("reduce_scatter", _t_rs)
    def reduce_scatter(self, t: torch.Tensor, dim: int = 0, op: str = "sum",
                       algorithm: str | None = None) -> torch.Tensor:
        """Reduce over the group and keep this rank's 1/size slice of ``dim``."""
        self._check_avg("reduce_scatter", t, op)
        if self.size == 1:
            return t
        self._check_divisible(t, dim)
        if self._choose("reduce_scatter", t, algorithm, _nbytes(t)) != "backend":
            if self._host_staged(t):
                return self.reduce_scatter(t.cpu(), dim, op, algorithm).to(t.device)
            x = t.movedim(dim, 0).contiguous().view(-1)
            x = x.clone() if x.data_ptr() == t.data_ptr() else x
            m = x.numel() // self.size
            link = self._link()
            algos.ring_reduce_scatter_(link, x, [(i * m, (i + 1) * m) for i in range(self.size)], op)
            self._record("reduce_scatter", link)
            shape = (t.shape[dim] // self.size,) + tuple(t.movedim(dim, 0).shape[1:])
            out = x[self.rank * m:(self.rank + 1) * m].view(shape)
            if op == "avg":
                out.div_(self.size)
            return out.movedim(0, dim).clone(memory_format=torch.contiguous_format)
        self._count("reduce_scatter", _nbytes(t))
        x = t if dim == 0 else t.movedim(dim, 0)
        x = x.contiguous()
        out = torch.empty((x.shape[0] // self.size,) + tuple(x.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter_single(out, x, op=_OPS["sum" if op == "avg" else op], group=self.group)
        if op == "avg":
            out.div_(self.size)
        return out if dim == 0 else out.movedim(0, dim).contiguous()

    @_recorded("all_to_all", _t_a2a)
    def all_to_all(self, t: torch.Tensor, in_splits: list[int] | None = None,
                   out_splits: list[int] | None = None, algorithm: str | None = None) -> torch.Tensor:
        """Exchange dim-0 chunks: chunk i of ``t`` goes to rank i (uneven splits allowed)."""
        if self.size == 1:
            return t
        in_splits, out_splits = self._a2a_splits(t, in_splits, out_splits)
        out = torch.empty((sum(out_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        if self._choose("all_to_all", t, algorithm, _nbytes(t)) != "backend":
            if self._host_staged(t):
                return self.all_to_all(t.cpu(), in_splits, out_splits, algorithm).to(t.device)
            link = self._link()
            algos.pairwise_all_to_all(link, t.contiguous(), out, list(in_splits), list(out_splits))
            self._record("all_to_all", link)
            return out
        self._count_a2a(t, in_splits, out_splits)
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=self.group)
        return out

    @_recorded("broadcast", _t_src)
    def broadcast(self, t: torch.Tensor, src: int = 0, algorithm: str | None = None) -> torch.Tensor:
        """In place from group rank ``src``."""
        if self.size == 1:
            return t
        algo = self._choose("broadcast", t, algorithm, _nbytes(t))
        if algo != "backend" and self._host_staged(t):
            return t.copy_(self.broadcast(t.cpu(), src, algorithm))
        if algo != "backend":
            return self._own_in_place("broadcast", t, lambda link, x: algos.BROADCAST[algo](link, x, src))
        self._count("broadcast", _nbytes(t))
        dist.broadcast(t, src=self.ranks[src], group=self.group)
        return t

    # -- asynchronous variants (backend only; own algorithms run synchronously) ---------------
    # Used where communication overlaps computation (DDP buckets launched from gradient hooks,
    # FSDP prefetch). Counted in the ledger exactly like the synchronous calls.
    def _sync_instead(self, algorithm) -> bool:
        return self.size == 1 or (algorithm or self.algorithm) != "backend"

    @_recorded("all_reduce", _t_op)
    def all_reduce_async(self, t: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> Pending:
        """Start ``all_reduce(t, op)`` in place; ``.wait()`` returns ``t``."""
        if self._sync_instead(algorithm):
            return Pending(None, self.all_reduce(t, op, algorithm))
        self._count("all_reduce", _nbytes(t))
        work = dist.all_reduce(t, op=_OPS["sum" if op == "avg" else op], group=self.group, async_op=True)
        return Pending(work, t, (lambda r: r.div_(self.size)) if op == "avg" else None)

    @_recorded("all_gather", _t_out)
    def all_gather_async(self, t: torch.Tensor, out: torch.Tensor | None = None,
                         algorithm: str | None = None) -> Pending:
        """Start a dim-0 all-gather of ``t`` into ``out`` (allocated if None); ``.wait()`` returns it."""
        if self._sync_instead(algorithm):
            res = self.all_gather(t, 0, algorithm)
            return Pending(None, out.copy_(res) if out is not None else res)
        if out is None:
            out = torch.empty((t.shape[0] * self.size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        self._count("all_gather", _nbytes(out))
        work = _all_gather_single(out, t.contiguous(), group=self.group, async_op=True)
        return Pending(work, out)

    @_recorded("reduce_scatter", _t_op)
    def reduce_scatter_async(self, t: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> Pending:
        """Start a dim-0 reduce-scatter; ``.wait()`` returns this rank's slice."""
        if self._sync_instead(algorithm):
            return Pending(None, self.reduce_scatter(t, 0, op, algorithm))
        self._check_divisible(t, 0)
        self._count("reduce_scatter", _nbytes(t))
        out = torch.empty((t.shape[0] // self.size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        work = _reduce_scatter_single(out, t.contiguous(), op=_OPS["sum" if op == "avg" else op],
                                          group=self.group, async_op=True)
        return Pending(work, out, (lambda r: r.div_(self.size)) if op == "avg" else None)

    @_recorded("all_to_all", _t_a2a)
    def all_to_all_async(self, t: torch.Tensor, in_splits: list[int] | None = None,
                         out_splits: list[int] | None = None, algorithm: str | None = None) -> Pending:
        """``all_to_all`` issued on the process group without waiting (gloo runs it on a thread of
        its own, NCCL on its stream); ``.wait()`` returns the received rows."""
        if self.size == 1:
            return Pending(None, t)
        in_splits, out_splits = self._a2a_splits(t, in_splits, out_splits)
        out = torch.empty((sum(out_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        self._count_a2a(t, in_splits, out_splits)
        return Pending(dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=self.group,
                                              async_op=True), out)

    def control_device(self, device) -> torch.device:
        """Where a small control tensor (a flag, a note) for this group goes: ``device`` under
        NCCL, which moves device memory only; the host elsewhere (no device round trip)."""
        return torch.device(device) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    @_recorded("barrier", lambda: ((), None))
    def barrier(self):
        """Wait for every rank of the group (counted in the ledger: a call, no bytes)."""
        if self.size > 1:
            self.ledger.record("barrier", self.name, 0, 0, modelled=True)
            dist.barrier(group=self.group)
