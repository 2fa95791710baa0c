"""Lanes: pieces of work of one rank interleaved at their transfers, so that one's collective
travels while another computes (docs/expert-parallel.md, "Overlap").

:meth:`Lanes.run` runs n callables in n threads of which exactly one runs at any moment (it
holds the baton). A lane passes the baton only at a transfer (:func:`exchange`): it *starts* an
asynchronous all-to-all on the group's process group, lets the next unfinished lane run until
that one starts a transfer of its own or finishes, then waits for its transfer. gloo moves the
data on its own threads (NCCL on its stream) meanwhile. Two lanes A and B:

    A: start a2a 1 | B: start a2a 2 | A: wait 1, compute, start a2a 3 | B: wait 2, compute ...

Every collective is therefore issued in an order fixed by the program, the same on every rank
whose lanes run the same code (the ranks of an expert-parallel group in the same pipeline
stage): lane 0 up to its first transfer, lane 1 up to its first, lane 0 again... Outside a lane,
:func:`exchange` is the plain synchronous all-to-all. Autograd's all-to-all
(autograd.py ``all_to_all``) goes through :func:`exchange` forward and backward, so any code
built from it (the flat, padded and hierarchical expert dispatches) overlaps inside lanes.

The lane a thread belongs to is a thread-local: a backward run by ``torch.autograd`` on the
calling thread (CPU) finds it; where autograd runs a node on one of its device threads (CUDA)
the transfer is synchronous there (correct, not overlapped). Grad mode is carried into the
lanes from the caller. Used by the pipeline executor (DualPipe's paired forward and backward,
parallel/pipeline/engine.py) and by the overlapped hierarchical dispatch (parallel/expert_overlap.py).
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
    with ``wait()``, output tensor filled once it is waited for)."""
    from .collectives import Comm
    from .tiers import TieredComm
    base = comm.inner if isinstance(comm, TieredComm) else comm
    pending = Comm.all_to_all_async(base, t, in_splits, out_splits)  # the backend's, by intent
    work = comm.all_to_all_start(t, in_splits, out_splits, lambda: pending) if isinstance(comm, TieredComm) else pending
    return work, pending.result


def wait(work) -> None:
    """Wait for a started transfer (a ``ep:wait`` span under the profiler: exposed time)."""
    with torch.profiler.record_function("ep:wait"):
        work.wait()


def exchange(comm, t: torch.Tensor, in_splits: list[int] | None = None,
             out_splits: list[int] | None = None) -> torch.Tensor:
    """``comm.all_to_all(t, in_splits, out_splits)``; inside a lane: started, the other lanes
    run, then waited for (module doc)."""
    lane = current()
    if lane is None or comm.size == 1:
        return comm.all_to_all(t, in_splits, out_splits)
    work, out = start_all_to_all(comm, t, in_splits, out_splits)
    lane[0].give_way(lane[1])
    wait(work)
    return out
