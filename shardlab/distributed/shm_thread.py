"""A communication thread per shared-memory comm (``parallel.comm_thread``; docs/collectives.md,
"The communication thread").

Without it an asynchronous collective of :class:`~.shm.SharedComm` meets its peers at the host
barrier on the calling thread before it returns: on a GPU the copies are queued on the comm
stream, but a rank that reaches a DDP bucket first waits there for the other ranks' hosts
instead of queuing its next backward kernels (0.6-1.0 ms per call on an H100, docs/gpu.md).
With it, ``all_reduce_async``, ``all_gather_async`` and ``reduce_scatter_async`` go to one thread
of the comm, in issue order, and return at once; ``wait()`` joins the call and (CUDA) makes the
caller's stream wait for its last copy.

Order is kept by construction: the comm's calls stay one sequence. Every other call on the comm
(a blocking collective, a barrier, point-to-point) first waits until the thread has run what was
queued (``hold``), and a call is queued only when the thread can run it without the process
group: the arena already holds its first chunk, the host barrier is the shared-memory one, no
point-to-point ring was opened on the comm, no fingerprint check (``check_collectives``), and on
CUDA the peers' events were exchanged. Otherwise it runs as before, on the caller's thread.
"""
from __future__ import annotations

import queue
import threading

import torch

from .collectives import Pending, _nbytes, _recorded, _t_a2a, _t_op, _t_out
from .shm_cuda import run_async
from .shm_host import _spans


class Job:
    """One queued call: its function, and once run, its result or error."""
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None


class CommThread:
    """The thread that runs a comm's queued calls one after another."""

    def __init__(self, device: torch.device, name: str):
        self.device, self._queue, self._lock = device, queue.SimpleQueue(), threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.pending, self.ran, self.error = 0, 0, None  # ran: calls run here (tests read it)
        self._thread = threading.Thread(target=self._loop, name=f"shardlab-comm-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self._queue.get()
            if self.error is None:
                try:
                    with torch.no_grad():
                        job.result = job.fn()
                    self.ran += 1
                except BaseException as e:  # re-raised where the call is waited for
                    job.error = self.error = e
            else:  # a call after a failed one is not run: the comm's sequence is broken
                job.error = RuntimeError(f"not run: an earlier queued call failed ({self.error})")
            job.done.set()
            with self._lock:
                self.pending -= 1
                if self.pending == 0:
                    self._idle.notify_all()

    def submit(self, fn) -> Job:
        job = Job(fn)
        with self._lock:
            self.pending += 1
        self._queue.put(job)
        return job

    def hold(self) -> None:
        """Return once every queued call has run (raising the first failure), so that the caller's
        next call on the comm comes after them. The thread itself never waits."""
        if threading.current_thread() is self._thread:
            return
        with self._lock:
            while self.pending:
                self._idle.wait()
        if self.error is not None:
            raise RuntimeError(f"an earlier asynchronous collective failed: {self.error}") from self.error


class Queued:
    """``Pending.work`` of a queued call: ``wait()`` joins it, hands its result to the Pending
    and (CUDA) makes the current stream wait for the call's copies."""

    def __init__(self, job: Job, device: torch.device, given: tuple):
        self.job, self.device, self.given, self.owner = job, device, given, None

    def wait(self) -> None:
        self.job.done.wait()
        if self.job.error is not None:
            raise self.job.error
        res, done = self.job.result
        if done is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(done)
            if isinstance(res, torch.Tensor) and all(res.data_ptr() != x.data_ptr() for x in self.given):
                res.record_stream(cur)  # made on the comm stream, used on the caller's
        if self.owner is not None:
            self.owner.result = res


class ThreadedAsync:
    """SharedComm's asynchronous collectives, queued on its :class:`CommThread` where allowed."""

    _comm_thread: CommThread | None = None
    comm_thread = False  # parallel.comm_thread

    def _first_chunk(self, kind: str, t: torch.Tensor) -> int:
        """Bytes the arena must hold for the call's first chunk (what ``_ensure`` asks for)."""
        es, n = t.element_size(), self.size
        if kind == "all_reduce":
            return _spans(t.numel(), 1, es, self._chunk)[0][1] * es
        if kind == "all_gather":  # (into a non-contiguous ``out``: whole, kind "all_gather_whole")
            return _spans(t.numel(), 1, es, self._chunk)[0][1] * es if _nbytes(t) > self._chunk else _nbytes(t)
        if kind == "all_gather_whole":
            return _nbytes(t)
        return n * _spans(t.numel() // n, n, es, self._chunk)[0][1] * es  # reduce_scatter, dim 0

    def _queueable(self, kind: str, t: torch.Tensor) -> bool:
        """Whether the thread can run this call without the process group (module docstring).
        ``StreamOrder.active`` is not asked: the thread sets it while it runs a call, and the
        next call must queue behind that one, not wait for it here."""
        o = self._order
        return (self.comm_thread and self.size > 1 and t.numel() > 0 and not self._elsewhere(t)
                and self.host_barrier == "shm" and not self.flight.check and self._channels is None
                and bool(self._regions) and self.cap >= self._first_chunk(kind, t)
                and (o.peers if o is not None else self.device.type == "cpu"))

    def _issue(self, kind: str | None, run, t: torch.Tensor, given: tuple) -> Pending:
        """``run()`` queued on the comm thread when :meth:`_queueable`, else as before (after
        what was queued)."""
        if kind is None or not self._queueable(kind, t):
            self._hold()
            return Pending(*run_async(self, run))
        if self._comm_thread is None:
            self._comm_thread = CommThread(self.device, self.name)
        o = self._order
        if o is None:
            job = self._comm_thread.submit(lambda: (run(), None))
        else:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for x in given:
                x.record_stream(o.stream)

            def on_stream():
                o.stream.wait_event(ready)  # the inputs as the caller left them at the call
                with torch.cuda.stream(o.stream):
                    o.active = True  # the collective runs as a nested call, on this stream
                    try:
                        res = run()
                    finally:
                        o.active = False
                done = torch.cuda.Event()
                done.record(o.stream)
                return res, done
            job = self._comm_thread.submit(on_stream)
        work = Queued(job, self.device, given)
        pending = Pending(work, given[-1])
        work.owner = pending
        return pending

    # -- the asynchronous collectives ----------------------------------------------------------
    @_recorded("all_reduce", _t_op, queued=True)
    def all_reduce_async(self, t: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> Pending:
        """``all_reduce(t, op)``; ``.wait()`` returns ``t`` (on CUDA: the caller's stream waits)."""
        inner = type(self).all_reduce.__wrapped__  # not recorded again: this call's entry stands
        return self._issue("all_reduce", lambda: inner(self, t, op), t, (t,))

    @_recorded("all_gather", _t_out, queued=True)
    def all_gather_async(self, t: torch.Tensor, out: torch.Tensor | None = None,
                         algorithm: str | None = None) -> Pending:
        """A dim-0 all-gather of ``t``, into ``out`` if given; ``.wait()`` returns it."""
        kind = "all_gather" if out is None or out.is_contiguous() else "all_gather_whole"
        return self._issue(kind, lambda: self._gather(t, 0, out), t, (t,) if out is None else (t, out))

    @_recorded("all_to_all", _t_a2a)
    def all_to_all_async(self, t: torch.Tensor, in_splits: list[int] | None = None,
                         out_splits: list[int] | None = None, algorithm: str | None = None) -> Pending:
        """``all_to_all``; ``.wait()`` returns the received rows (never queued: its arena size is
        agreed during the call)."""
        return Pending(*run_async(self, lambda: self.all_to_all(t, in_splits, out_splits)))

    @_recorded("reduce_scatter", _t_op, queued=True)
    def reduce_scatter_async(self, t: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> Pending:
        """A dim-0 reduce-scatter; ``.wait()`` returns this rank's slice."""
        inner = type(self).reduce_scatter.__wrapped__
        even = t.dim() > 0 and t.shape[0] % self.size == 0  # else the call raises, on this thread
        return self._issue("reduce_scatter" if even else None, lambda: inner(self, t, 0, op), t, (t,))

    def _hold(self) -> None:
        if self._comm_thread is not None:
            self._comm_thread.hold()
