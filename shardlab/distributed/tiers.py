"""Two tiers of links: fast inside a node, slow between nodes (docs/collectives.md, "Two tiers").

A :class:`TieredComm` wraps the communicator of a group whose ranks sit on more than one node
(``Topology.nodes``; ``parallel.sim_nodes`` on one host). It changes no result; around each call it
counts the bytes that cross the slow tier in the rank's ledger (``Entry.inter_sent`` /
``inter_recv``): all-to-all the rows to and from other nodes; ring ops the ring model's bytes
when this rank's next rank is elsewhere; send / recv the message. With a :class:`Link` of finite
bandwidth (``parallel.sim_inter_node_gbps``, ``_latency_us``) it throttles the call: it returns no
earlier than ``start + latency + bytes / bandwidth`` (the real transfer runs inside that time; the
throttle adds only what is missing). Asynchronous calls get the same deadline on ``wait()``, and
a rank has one slow link, so transfers in flight together queue on it (``_book``).

A transfer starts when the last rank of the group has issued it, as on a real link, where no data
moves before the peers are there: where the group's ranks share the host (simulated nodes, the
only case the throttle is for), each rank writes when it issued each call into a small
shared-memory table (:class:`IssueTimes`) and the deadline counts from the latest of them, so the
link time of a rank that arrived early does not run out while it waits for the others. Across
hosts the deadline counts from the rank's own issue.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ledger import ring_bytes
from .p2p import _nbytes


@dataclass(frozen=True)
class Link:
    """The slow tier as seen by one rank: ``gbps`` GB/s (1e9 bytes/s; 0 = not throttled) and
    ``latency_us`` per message (rounds of a ring each pay it)."""

    gbps: float = 0.0
    latency_us: float = 0.0

    def seconds(self, nbytes: int, messages: int = 1) -> float:
        """Time of ``nbytes`` in ``messages`` sequential messages over this link."""
        bw = nbytes / (self.gbps * 1e9) if self.gbps > 0 else 0.0
        return bw + messages * self.latency_us * 1e-6

    @property
    def throttled(self) -> bool:
        return self.gbps > 0 or self.latency_us > 0


_link_free = [0.0]
"""When this rank's simulated slow link is free again (perf_counter seconds): one link per rank
(process), shared by all its tiered groups."""


def _book(t0: float, delay: float) -> float:
    """The deadline of a transfer of ``delay`` seconds issued at ``t0``: after the link's earlier
    transfers (module doc); books the link until then."""
    if delay <= 0:
        return t0
    end = max(t0, _link_free[0]) + delay
    _link_free[0] = end
    return end


def _sleep_until(deadline: float):
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class IssueTimes:
    """When each rank of a group issued each of its calls (perf_counter seconds, which is the
    host's monotonic clock, the same in every process): a table in shared memory, ``SLOTS`` calls
    deep, written by each rank in its own column (module doc). Built collectively by the group's
    first throttled call."""

    SLOTS = 4096

    def __init__(self, inner):
        n, me = inner.size, inner.rank
        path = [f"/dev/shm/shardlab-issue-{os.getuid()}-{uuid.uuid4().hex}" if me == 0 else None]
        if me == 0:
            with open(path[0], "wb") as fh:
                fh.truncate(self.SLOTS * n * 16)
        dist.broadcast_object_list(path, src=inner.ranks[0], group=inner.group)
        self.table = torch.from_file(path[0], shared=True, size=self.SLOTS * n * 2, dtype=torch.float64).view(self.SLOTS, n, 2)
        dist.barrier(group=inner.group)  # every rank has it mapped: the name can go
        if me == 0:
            os.unlink(path[0])
        self.me, self.calls = me, 0

    def issue(self) -> tuple[int, float]:
        """Record that this rank issues its next call now; returns (call number, now)."""
        k, now = self.calls, time.perf_counter()
        self.calls += 1
        row = self.table[k % self.SLOTS, self.me]
        row[0] = now
        row[1] = k + 1  # written after the time: a reader that sees the number sees the time
        return k, now

    def last(self, k: int, own: float) -> float:
        """When the last rank issued call ``k`` (call it once the call has completed, when every
        rank has issued it); ``own`` if a slot was reused or not yet written."""
        rows = self.table[k % self.SLOTS].tolist()
        return max(t for t, _ in rows) if all(c == k + 1 for _, c in rows) else own


class Delayed:
    """A work or :class:`~shardlab.distributed.collectives.Pending` whose ``wait()`` returns no
    earlier than ``deadline`` (perf_counter seconds, or a function giving it once the work is
    done); everything else is the wrapped object's."""

    def __init__(self, work, deadline):
        self._inner, self._deadline = work, deadline  # not ``work``: a Pending's own ``work`` shows through

    @property
    def deadline(self) -> float:
        if callable(self._deadline):
            self._deadline = self._deadline()
        return self._deadline

    def wait(self, *a, **k):
        out = self._inner.wait(*a, **k)
        _sleep_until(self.deadline)
        return out

    def is_completed(self) -> bool:
        return self._inner.is_completed() and time.perf_counter() >= self.deadline

    def __getattr__(self, name):
        return getattr(self._inner, name)


class TieredComm:
    """A Comm (or SharedComm) whose group spans nodes: same interface and results; slow-tier
    bytes counted, and throttled by ``link`` (module doc). ``nodes[q]``: node of group rank q."""

    def __init__(self, inner, nodes: list[int], link: Link, one_host: bool = False):
        """``one_host``: the group's ranks share the host, so the throttle counts each transfer
        from the last rank's issue (:class:`IssueTimes`; module doc)."""
        if len(nodes) != inner.size:
            raise ValueError(f"TieredComm: {len(nodes)} node ids for a group of {inner.size}")
        self.inner, self.nodes, self.link, self.one_host = inner, list(nodes), link, one_host
        self._issues = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __repr__(self):
        return f"Tiered({self.inner!r}, nodes={self.nodes})"

    def crosses(self, peer: int) -> bool:
        """Whether group rank ``peer`` sits on another node than this rank."""
        return self.nodes[peer] != self.nodes[self.inner.rank]

    # -- the bytes and the time of one call ------------------------------------------------------
    def _ring(self, op: str, nbytes: int) -> tuple[int, int, float]:
        n, me = self.inner.size, self.inner.rank
        if n == 1:
            return 0, 0, 0.0
        per = ring_bytes(op, nbytes, n)
        any_cross = any(self.nodes[i] != self.nodes[(i + 1) % n] for i in range(n))
        rounds = 2 * (n - 1) if op == "all_reduce" else n - 1
        delay = self.link.seconds(per, rounds) if any_cross and self.link.throttled else 0.0
        return per * self.crosses((me + 1) % n), per * self.crosses((me - 1) % n), delay

    def _a2a(self, t: torch.Tensor, in_splits, out_splits) -> tuple[int, int, float]:
        ins, outs = self.inner._a2a_splits(t, in_splits, out_splits)
        row = _nbytes(t) // t.shape[0] if t.shape[0] else 0
        sent = row * sum(s for q, s in enumerate(ins) if self.crosses(q))
        recv = row * sum(s for q, s in enumerate(outs) if self.crosses(q))
        delay = self.link.seconds(max(sent, recv)) if (sent or recv) and self.link.throttled else 0.0
        return sent, recv, delay

    def _run(self, op: str, cost: tuple[int, int, float], call):
        """Run ``call()``, count the slow-tier bytes, return no earlier than start + delay. Under
        the profiler the whole call, throttle included, is one ``tier:<op>`` span (always opened:
        a profiler of all threads does not show in ``_profiler_enabled()`` on them)."""
        with torch.profiler.record_function(f"tier:{op}"):
            return self._run_now(op, cost, call)

    def _issue(self, delay: float):
        """(when the transfer starts, as a function to call once the call has completed):
        the last rank's issue on one host, else this rank's (module doc)."""
        if delay <= 0:
            return lambda: 0.0
        if not self.one_host or self.inner.size == 1:
            now = time.perf_counter()
            return lambda: now
        if self._issues is None:
            self._issues = IssueTimes(self.inner)
        k, now = self._issues.issue()
        return lambda: self._issues.last(k, now)

    def _run_now(self, op, cost, call):
        sent, recv, delay = cost
        start = self._issue(delay)
        out = call()
        self.inner.ledger.record_inter(op, self.inner.name, sent, recv)
        _sleep_until(_book(start(), delay))
        return out

    def _start(self, op: str, cost: tuple[int, int, float], call) -> Delayed:
        """An asynchronous call: counted now, its ``wait()`` no earlier than the transfer's start +
        delay (booked on the link when the call has completed)."""
        sent, recv, delay = cost
        start = self._issue(delay)
        work = call()
        self.inner.ledger.record_inter(op, self.inner.name, sent, recv)
        return Delayed(work, lambda: _book(start(), delay))

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t, op="sum", algorithm=None):
        return self._run("all_reduce", self._ring("all_reduce", _nbytes(t)),
                         lambda: self.inner.all_reduce(t, op, algorithm))

    def all_gather(self, t, dim=0, algorithm=None):
        return self._run("all_gather", self._ring("all_gather", _nbytes(t) * self.inner.size),
                         lambda: self.inner.all_gather(t, dim, algorithm))

    def reduce_scatter(self, t, dim=0, op="sum", algorithm=None):
        return self._run("reduce_scatter", self._ring("reduce_scatter", _nbytes(t)),
                         lambda: self.inner.reduce_scatter(t, dim, op, algorithm))

    def broadcast(self, t, src=0, algorithm=None):
        return self._run("broadcast", self._ring("broadcast", _nbytes(t)),
                         lambda: self.inner.broadcast(t, src, algorithm))

    def all_to_all(self, t, in_splits=None, out_splits=None, algorithm=None):
        if self.inner.size == 1:
            return self.inner.all_to_all(t, in_splits, out_splits, algorithm)
        return self._run("all_to_all", self._a2a(t, in_splits, out_splits),
                         lambda: self.inner.all_to_all(t, in_splits, out_splits, algorithm))

    def all_reduce_async(self, t, op="sum", algorithm=None):
        return self._start("all_reduce", self._ring("all_reduce", _nbytes(t)),
                           lambda: self.inner.all_reduce_async(t, op, algorithm))

    def all_gather_async(self, t, out=None, algorithm=None):
        return self._start("all_gather", self._ring("all_gather", _nbytes(t) * self.inner.size),
                           lambda: self.inner.all_gather_async(t, out, algorithm))

    def reduce_scatter_async(self, t, op="sum", algorithm=None):
        return self._start("reduce_scatter", self._ring("reduce_scatter", _nbytes(t)),
                           lambda: self.inner.reduce_scatter_async(t, op, algorithm))

    def all_to_all_start(self, t, in_splits=None, out_splits=None, start=None):
        """An asynchronous all-to-all started by ``start()`` (a work with ``wait()``; expert
        overlap, parallel/expert_overlap.py), counted and given the slow tier's deadline. ``start``
        is called after the issue time is noted (IssueTimes: a peer whose call completes reads it)."""
        return self._start("all_to_all", self._a2a(t, in_splits, out_splits), start)

    # -- point to point ----------------------------------------------------------------------
    def _p2p(self, op: str, t, peer: int, work):
        if not self.crosses(peer):
            return work
        n = _nbytes(t)
        self.inner.ledger.record_inter(op, self.inner.name, n if op == "send" else 0, n if op == "recv" else 0)
        return Delayed(work, time.perf_counter() + self.link.seconds(n)) if self.link.throttled else work

    def isend(self, t, peer):
        return self._p2p("send", t, peer, self.inner.isend(t, peer))

    def irecv(self, t, peer):
        return self._p2p("recv", t, peer, self.inner.irecv(t, peer))

    def exchange(self, sends=(), recvs=()):
        works = self.inner.exchange(sends, recvs)
        if not works:
            return works
        msgs = [("recv", t, p) for t, p in recvs] + [("send", t, p) for t, p in sends]
        return [self._p2p(op, t, p, w) for (op, t, p), w in zip(msgs, works)]


def tiered(comm, node_of, link: Link, one_host: bool = False):
    """``comm`` wrapped in a TieredComm when its ranks span nodes (``node_of(global rank)``),
    else ``comm`` itself. ``one_host``: its ranks share the host (TieredComm)."""
    nodes = [node_of(r) for r in comm.ranks]
    return TieredComm(comm, nodes, link, one_host) if len(set(nodes)) > 1 else comm
