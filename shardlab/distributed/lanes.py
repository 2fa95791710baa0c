"""Lanes: pieces of work of one rank interleaved at their transfers, so that one's collective
travels while another computes (docs/expert-parallel.md, "Lanes").

:meth:`Lanes.run` runs n callables in n threads of which exactly one runs at a time (it holds the
baton). A lane passes the baton only at a transfer (:func:`exchange`): it starts an asynchronous
all-to-all, lets the next unfinished lane run until that one starts a transfer of its own or
ends, then waits for its own. So the collectives keep one order fixed by the program, the same on
every rank running the same lanes (issue-order matching, as gloo and NCCL need). Outside a lane
:func:`exchange` is the plain synchronous all-to-all; autograd's ``all_to_all`` goes through it
both ways. The lane is a thread-local: where autograd runs a node on a device thread (CUDA) the
transfer is synchronous (correct, not overlapped). Users: DualPipe's paired F and B
(parallel/pipeline/executor.py) and the overlapped hierarchical dispatch (parallel/expert_overlap.py).
"""
from __future__ import annotations

import threading

import torch

_here = threading.local()


def current() -> tuple["Lanes", int] | None:
    """(lanes, index) of the lane running on this thread, or None."""
    return getattr(_here, "lane", None)


class Lanes:
    """Run callables as lanes that take turns at their transfers (module doc)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.turn, self.done = 0, []
        self.switches = 0
        """How often a lane gave the baton to another at a transfer (tests check that lanes interleave)."""

    def run(self, *fns):
        """Run ``fns`` as lanes 0, 1, ...; returns their results in order (re-raises the first
        error, after every lane has ended)."""
        n = len(fns)
        self.turn, self.done = 0, [False] * n
        results, errors = [None] * n, [None] * n
        grad = torch.is_grad_enabled()

        def body(i):
            _here.lane = (self, i)
            with self.cv:
                self.cv.wait_for(lambda: self.turn == i)
            try:
                with torch.set_grad_enabled(grad):
                    results[i] = fns[i]()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors[i] = e
            finally:
                _here.lane = None
                with self.cv:
                    self.done[i] = True
                    self._pass(i)
        threads = [threading.Thread(target=body, args=(i,), name=f"lane{i}", daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errors:
            if e is not None:
                raise e
        return results

    def _pass(self, i: int) -> None:
        """Hand the baton to the next unfinished lane after ``i`` (held: ``self.cv``)."""
        n = len(self.done)
        for d in range(1, n + 1):
            j = (i + d) % n
            if not self.done[j]:
                self.turn = j
                break
        self.cv.notify_all()

    def give_way(self, i: int) -> None:
        """Lane ``i`` lets the others run until the baton comes back to it."""
        with self.cv:
            self._pass(i)
            self.switches += self.turn != i
            self.cv.wait_for(lambda: self.turn == i)


def start_all_to_all(comm, t: torch.Tensor, in_splits: list[int] | None, out_splits: list[int] | None):
    """Start ``comm``'s all-to-all on its process group without waiting: the backend's
    ``Comm.all_to_all_async`` even under the shared-memory transport (whose asynchronous calls are
    done when issued on the CPU), priced by the tier wrapper when ``comm`` has one. Returns (work
    with ``wait()``, output tensor filled once it is waited for). Under the profiler the issue is an
    ``ep:start`` span: with the ``ep:wait`` that follows on the same thread it tells when the
    transfer could start on every rank (benchmarks/moe_dispatch.py, exposed transfer time)."""
    from .collectives import Comm
    from .tiers import TieredComm
    base = comm.inner if isinstance(comm, TieredComm) else comm
    issued = []

    def issue():  # the backend's, by intent; issued by the tier wrapper after it noted the time
        issued.append(Comm.all_to_all_async(base, t, in_splits, out_splits))
        return issued[0]
    with torch.profiler.record_function("ep:start"):
        work = comm.all_to_all_start(t, in_splits, out_splits, issue) if isinstance(comm, TieredComm) else issue()
    return work, issued[0].result


def wait(work) -> None:
    """Wait for a started transfer (a ``ep:wait`` span under the profiler: exposed time)."""
    with torch.profiler.record_function("ep:wait"):
        work.wait()


def exchange(comm, t: torch.Tensor, in_splits: list[int] | None = None,
             out_splits: list[int] | None = None) -> torch.Tensor:
    """``comm.all_to_all(t, in_splits, out_splits)``, a ``ep:all_to_all`` span under the profiler;
    inside a lane: started, the other lanes run, then waited for (module doc)."""
    lane = current()
    if comm.size == 1:
        return comm.all_to_all(t, in_splits, out_splits)
    if lane is None:  # a span of its own: a group inside a node has no tier wrapper to open one
        with torch.profiler.record_function("ep:all_to_all"):
            return comm.all_to_all(t, in_splits, out_splits)
    work, out = start_all_to_all(comm, t, in_splits, out_splits)
    lane[0].give_way(lane[1])
    wait(work)
    return out
