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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

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


class Delayed:
    """A work or :class:`~shardlab.distributed.collectives.Pending` whose ``wait()`` returns no
    earlier than ``deadline`` (perf_counter seconds); everything else is the wrapped object's."""

    def __init__(self, work, deadline: float):
        self._inner, self.deadline = work, deadline  # not ``work``: a Pending's own ``work`` shows through

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

    def __init__(self, inner, nodes: list[int], link: Link):
        if len(nodes) != inner.size:
            raise ValueError(f"TieredComm: {len(nodes)} node ids for a group of {inner.size}")
        self.inner, self.nodes, self.link = inner, list(nodes), link

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

    def _run_now(self, op, cost, call):
        sent, recv, delay = cost
        deadline = _book(time.perf_counter(), delay)
        out = call()
        self.inner.ledger.record_inter(op, self.inner.name, sent, recv)
        _sleep_until(deadline)
        return out

    def _start(self, op: str, cost: tuple[int, int, float], call) -> Delayed:
        """An asynchronous call: counted now, its ``wait()`` no earlier than start + delay."""
        sent, recv, delay = cost
        deadline = _book(time.perf_counter(), delay)
        work = call()
        self.inner.ledger.record_inter(op, self.inner.name, sent, recv)
        return Delayed(work, deadline)

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
        overlap, parallel/expert_overlap.py), counted and given the slow tier's deadline."""
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


def tiered(comm, node_of, link: Link):
    """``comm`` wrapped in a TieredComm when its ranks span nodes (``node_of(global rank)``),
    else ``comm`` itself."""
    nodes = [node_of(r) for r in comm.ranks]
    return TieredComm(comm, nodes, link) if len(set(nodes)) > 1 else comm
