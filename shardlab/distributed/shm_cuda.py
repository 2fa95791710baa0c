"""The shared-memory transport on one GPU (``SharedComm`` with CUDA ranks): collectives on a
communication stream, ordered between processes by interprocess CUDA events, never by a host
wait for the GPU (docs/collectives.md, "On a GPU", which gives the ordering argument).

Every collective runs on the comm's own stream after it waits for the caller's; the caller's
stream then waits for it (a blocking call) or ``Pending.wait()`` makes it wait (``*_async``). At
each barrier a rank records one of its two interprocess events (by barrier parity) on the comm
stream before it announces its arrival on the host, and after the host barrier the comm stream
waits on every peer's event of that parity. Tensors cross streams with ``record_stream``; a
message goes in chunks of :data:`CHUNK` bytes per rank.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

CHUNK = 64 << 20
"""Bytes a rank writes per phase on CUDA (its two regions: 2 x CHUNK at most)."""


class StreamWait:
    """``Pending.work`` of an asynchronous collective on the comm stream: ``wait()`` makes the
    caller's current stream wait for it (the host does not wait)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class StreamOrder:
    """A comm's stream and interprocess events (one per barrier parity) and the peers' events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.mine = [torch.cuda.Event(interprocess=True) for _ in range(2)]
        self.peers: list[list[torch.cuda.Event] | None] = []  # per group rank; empty until exchanged
        self.count = 0  # barriers passed with events
        self.active = False  # inside a collective (nested calls run on the stream already current)
        self.defer = False  # the next collective is an async one: the caller's stream does not wait here

    def exchange(self, group, rank: int, size: int) -> None:
        """Collective: open every peer's events from their IPC handles (done once)."""
        if self.peers:
            return
        handles = [None] * size
        dist.all_gather_object(handles, [e.ipc_handle() for e in self.mine], group=group)
        self.peers = [None if i == rank else [torch.cuda.Event.from_ipc_handle(self.device, h) for h in hs]
                      for i, hs in enumerate(handles)]

    def arrive(self) -> None:
        """Before the host barrier: mark this rank's work so far on its comm stream."""
        self.count += 1
        self.mine[self.count % 2].record(torch.cuda.current_stream(self.device))

    def depart(self) -> None:
        """After the host barrier: the current stream waits for every peer's work before it."""
        s = torch.cuda.current_stream(self.device)
        for evs in self.peers:
            if evs is not None:
                s.wait_event(evs[self.count % 2])


def streamed(fn):
    """Run a SharedComm collective ``fn(self, t, ...)`` on the comm stream (CUDA ranks; elsewhere,
    and for nested calls, as it is). ``out=`` (a given output) crosses streams like ``t``."""
    @functools.wraps(fn)
    def wrapper(self, t, *a, **k):
        o = self._order
        if o is None or o.active or self.size == 1 or t.device.type != "cuda":
            return fn(self, t, *a, **k)
        cur = torch.cuda.current_stream(self.device)
        o.stream.wait_stream(cur)
        given = [x for x in (t, k.get("out"), *a) if isinstance(x, torch.Tensor) and x.device.type == "cuda"]
        for x in given:
            x.record_stream(o.stream)
        o.active = True
        try:
            with torch.cuda.stream(o.stream):
                res = fn(self, t, *a, **k)
        finally:
            o.active = False
        if isinstance(res, torch.Tensor) and not any(res.data_ptr() == x.data_ptr() for x in given):
            res.record_stream(cur)
        if o.defer:
            o.defer = False
        else:
            cur.wait_stream(o.stream)
        return res
    return wrapper


def run_async(comm, run):
    """``(work, result)`` of ``run()`` (a collective of ``comm``) issued asynchronously: on the comm
    stream with a :class:`StreamWait` to wait on, or, on the CPU, completed now (work None)."""
    o = comm._order
    if o is None or o.active or comm.size == 1:
        return None, run()
    o.defer = True
    try:
        res = run()
    finally:
        o.defer = False
    ev = torch.cuda.Event()
    ev.record(o.stream)
    return StreamWait(ev, comm.device), res
