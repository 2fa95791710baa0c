"""Point-to-point messages of a :class:`~shardlab.distributed.collectives.Comm` over its
process group (group-relative peers), counted in the ledger and recorded by the flight
recorder. Mixed into ``Comm``; the shared-memory transport's rings (shm_p2p.py) override it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import flight as fl


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ProcessGroupP2P:
    """isend / irecv / exchange on ``self.group`` (a Comm's: ``ledger``, ``flight``, ``ranks``,
    ``name``, ``_host_staged``)."""

    # -- point to point (group-relative peers) -------------------------------------------------
    # No tags: NCCL ignores them and matches the messages between two ranks purely by the order
    # in which they are issued, so every caller must issue, per (sender, receiver) pair, its
    # sends and the peer's matching receives in the same order (docs/collectives.md). Without a
    # tag argument gloo runs the same matching as NCCL, so the CPU tests check that order too.
    # Check mode sends a fingerprint header just before each message on the same channel; the
    # receive's wait() compares it with what it expects (flight.CheckedRecv).
    # gloo sends and receives host memory (a CUDA pointer fails in its socket write): over gloo, a
    # CUDA message travels as a host copy and a receive lands in a host buffer (_HostRecv).
    def isend(self, t: torch.Tensor, peer: int):
        """Non-blocking send to group rank ``peer``. The peer's receives from this rank match
        this rank's sends to it in issue order (never by tag)."""
        self.ledger.record("send", self.name, _nbytes(t), 0)
        entry = self.flight.enter(self, "send", (t,), None, peer)
        t = t.cpu() if self._host_staged(t) else t
        if self.flight.check:
            head = dist.isend(fl.send_header(self, entry, t.device), dst=self.ranks[peer], group=self.group)
            return fl.Works([head, dist.isend(t.contiguous(), dst=self.ranks[peer], group=self.group)], entry)
        return dist.isend(t.contiguous(), dst=self.ranks[peer], group=self.group)

    def irecv(self, t: torch.Tensor, peer: int):
        """Non-blocking receive into ``t`` (contiguous) from group rank ``peer``: it gets the
        earliest message from ``peer`` that no earlier-issued receive has taken."""
        self.ledger.record("recv", self.name, 0, _nbytes(t))
        entry = self.flight.enter(self, "recv", (t,), None, peer)
        if self._host_staged(t):
            buf = torch.empty(t.shape, dtype=t.dtype)
            return _HostRecv(self._irecv_into(buf, peer, entry), buf, t)
        return self._irecv_into(t, peer, entry)

    def _irecv_into(self, t: torch.Tensor, peer: int, entry):
        if self.flight.check:
            head = torch.empty(fl.FP_BYTES, dtype=torch.uint8, device=t.device)
            hw = dist.irecv(head, src=self.ranks[peer], group=self.group)
            return fl.CheckedRecv(self, entry, head, hw, dist.irecv(t, src=self.ranks[peer], group=self.group))
        return dist.irecv(t, src=self.ranks[peer], group=self.group)

    def exchange(self, sends=(), recvs=()) -> list:
        """Issue ``[(tensor, peer), ...]`` sends and receives together, receives first, each list
        in its order (one ``batch_isend_irecv``: NCCL runs it as one group, so two ranks that send
        to each other cannot block on each other's send). Returns the works to wait for; sent
        tensors must stay unchanged until then. Counted like ``isend`` / ``irecv``."""
        ops, heads, check, staged = [], [], self.flight.check, {}
        for t, peer in recvs:
            if not t.is_contiguous():
                raise ValueError("exchange: a receive buffer must be contiguous")
            if self._host_staged(t):
                staged[len(ops)] = (torch.empty(t.shape, dtype=t.dtype), t)
                t = staged[len(ops)][0]
            self.ledger.record("recv", self.name, 0, _nbytes(t))
            ops.append(dist.P2POp(dist.irecv, t, self.ranks[peer], self.group))
            e = self.flight.enter(self, "recv", (t,), None, peer)
            if check:
                heads.append((e, torch.empty(fl.FP_BYTES, dtype=torch.uint8, device=t.device), peer))
        for t, peer in sends:
            self.ledger.record("send", self.name, _nbytes(t), 0)
            t = t.cpu() if self._host_staged(t) else t
            ops.append(dist.P2POp(dist.isend, t.contiguous(), self.ranks[peer], self.group))
            e = self.flight.enter(self, "send", (t,), None, peer)
            if check:
                heads.append((e, fl.send_header(self, e, t.device), peer))
        if not ops:
            return []
        if not check:
            works = dist.batch_isend_irecv(ops)
        else:
            head_ops = [dist.P2POp(dist.irecv if e[2] == "recv" else dist.isend, h, self.ranks[p], self.group)
                        for e, h, p in heads]
            both, n = dist.batch_isend_irecv(head_ops + ops), len(heads)
            works = [fl.CheckedRecv(self, e, h, both[i], both[n + i]) if e[2] == "recv"
                     else fl.Works([both[i], both[n + i]], e) for i, (e, h, _) in enumerate(heads)]
        return [_HostRecv(w, *staged[i]) if i in staged else w for i, w in enumerate(works)]


class _HostRecv:
    """A receive that landed in host memory (gloo): ``wait()`` copies it into the CUDA tensor."""

    def __init__(self, work, host: torch.Tensor, dest: torch.Tensor):
        self.work, self.host, self.dest = work, host, dest

    def wait(self, *a, **k):
        self.work.wait(*a, **k)
        self.dest.copy_(self.host)
        return True

    def is_completed(self):
        return self.work.is_completed()
