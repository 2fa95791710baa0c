"""Point-to-point messages through shared memory, for :class:`shm.SharedComm` (docs/collectives.md,
"Shared-memory transport", Point-to-point).

Each pair of group ranks that exchanges messages gets one /dev/shm file holding two byte rings,
one per direction: single-producer, single-consumer queues whose ``written`` / ``read`` counters
each have one writer (x86-64 store ordering; elsewhere SharedComm keeps the process group's
point-to-point). A message is an 8-byte length then its bytes (a size mismatch fails naming both
sizes); messages are matched by issue order only, as NCCL's. Longer messages stream through the
ring, advanced by :meth:`Channels.progress` in every point-to-point call and ``wait()``. The
pair's file is set up lazily by the lower rank, its name sent through the process group. Every
barrier of the group compares, per pair, the messages each side issued, so a send no receive
matched raises on both ranks before the next collective (as NCCL requires).
"""
from __future__ import annotations

import atexit
import os
import uuid
from collections import deque

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from . import shm_host
from . import shm_pair
from .shm_pair import LINE, Ring
from .collectives import _nbytes, _recorded

NAME = 32          # bytes of a pair file's name token (uuid4 hex)
DEFAULT_CAP = 16 << 20
"""Bytes of one ring (per direction and pair); longer messages stream through it."""
SIZES_KEPT = 64
"""Sizes of the latest sends kept per peer, to name an unreceived one."""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the contiguous tensor ``t`` (writes through to ``t``)."""
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class Op:
    """A queued send or receive; ``wait()`` advances every queued message until this one is done."""

    def __init__(self, chans: "Channels", kind: str, peer: int, t: torch.Tensor, entry=None, boxed=False):
        self.chans, self.kind, self.peer, self.entry = chans, kind, peer, entry
        self.tensor = t
        self.boxed = boxed  # the data goes through the box (shm_pair.py); a receive learns it from the header
        self.head = torch.tensor([shm_pair.encode(t.numel() * t.element_size(), boxed)], dtype=torch.int64)
        self.parts = [_bytes(self.head), _bytes(t)]  # a send reads them, a receive fills them
        self.part, self.off, self.done = 0, 0, False
        self.record = self.record_bytes = None  # a boxed piece's record in the ring (made by the box)
        self.ready = self.last = None  # CUDA boxes: the caller's stream at the post; the op's last copy
        if t.is_cuda and (boxed or kind == "recv"):  # a receive learns from the header whether it is boxed
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(t.device))

    def is_completed(self) -> bool:
        with _disable_current_modes():
            self.chans.progress()
        return self.done

    def wait(self, *a, **k) -> bool:
        with _disable_current_modes():  # spins dispatch a varying number of operators (shm_host.modes_off)
            self.chans.wait_until(lambda: self.done, f"{self.kind} {'to' if self.kind == 'send' else 'from'} "
                                                     f"group rank {self.peer}")
            if self.last is not None:  # its copies ran on the p2p stream (shm_pair.py)
                torch.cuda.current_stream(self.chans.comm.device).wait_event(self.last)
        if self.entry is not None:
            self.entry[-1] = True
        return True


class Channels:
    """The shared-memory point-to-point state of one SharedComm: per peer its rings (once set up)
    and its queues of sends and receives."""

    def __init__(self, comm, cap: int = DEFAULT_CAP, timeout_s: float = shm_host.DEFAULT_TIMEOUT_S):
        self.comm, self.cap, self.timeout_s = comm, cap, timeout_s
        self.rings: dict[int, tuple[Ring, Ring]] = {}  # peer -> (out, in)
        self.setup: dict[int, tuple] = {}              # peer -> (work, name buffer) until its name arrived
        self._names: list = []                          # (work, name buffer) this rank sent
        self.sends: dict[int, deque] = {}
        self.recvs: dict[int, deque] = {}
        self.issued: dict[tuple[str, int], int] = {}   # (kind, peer) -> messages issued so far
        self.sizes: dict[int, deque] = {}               # peer -> bytes of the latest sends to it
        self.rounds = 0                                 # the slot of the latest publish
        self._maps: list[torch.Tensor] = []
        self.broken = False  # a desync was raised here already: not checked again at exit
        self.boxes: dict[tuple[int, bool], shm_pair.Box] = {}  # (peer, out) -> its box, at its first boxed message
        self.stream = torch.cuda.Stream(comm.device) if comm.device.type == "cuda" else None  # the boxes' copies
        comm.flight.at_exit.append(self.at_exit)

    def post(self, kind: str, t: torch.Tensor, peer: int, entry=None) -> Op:
        if peer == self.comm.rank or not 0 <= peer < self.comm.size:
            raise ValueError(f"{self.comm.name}: {kind} peer {peer} must be another rank of the group "
                             f"(0..{self.comm.size - 1}, this is {self.comm.rank})")
        if not t.is_contiguous():
            raise ValueError(f"{self.comm.name}: a {kind} buffer must be contiguous")
        boxed = kind == "send" and (t.device.type == self.comm.device.type == "cuda"
                                    or (t.device.type == "cpu" and shm_pair.HOST_SLOT > 0))
        with _disable_current_modes():
            self._connect(peer)
            op = Op(self, kind, peer, t, entry, boxed)
            (self.sends if kind == "send" else self.recvs).setdefault(peer, deque()).append(op)
            self.issued[kind, peer] = self.issued.get((kind, peer), 0) + 1
            if kind == "send":
                sizes = self.sizes.get(peer)
                if sizes is None:
                    sizes = self.sizes[peer] = deque(maxlen=SIZES_KEPT)
                sizes.append(t.numel() * t.element_size())
            self.progress()
        return op

    # -- set-up ------------------------------------------------------------------------------
    def _connect(self, peer: int) -> None:
        if peer in self.rings or peer in self.setup:
            return
        c = self.comm
        if c.rank < peer:  # create, map, send the name
            token = uuid.uuid4().hex
            path = f"/dev/shm/shardlab-{os.getuid()}-p2p-{token}"
            shm_host.reserve(path, 2 * Ring.nbytes(self.cap))
            self._map(peer, path, first=True)  # before the name goes out: the peer unlinks it once mapped
            atexit.register(_unlink, path)  # for a peer that never maps it
            buf = torch.tensor(list(token.encode()), dtype=torch.uint8)
            self._names.append((dist.isend(buf, dst=c.ranks[peer], group=c.group), buf))  # alive until sent
        else:
            buf = torch.empty(NAME, dtype=torch.uint8)
            self.setup[peer] = (dist.irecv(buf, src=c.ranks[peer], group=c.group), buf)

    def _map(self, peer: int, path: str, first: bool) -> None:
        size = Ring.nbytes(self.cap)
        arena = torch.from_file(path, shared=True, size=2 * size, dtype=torch.uint8)
        # fault every page in now (the creator writes them, the peer reads them), not in the
        # first messages: a fresh ring's pages would otherwise cost a fault per 4 KiB for a whole lap
        if first:
            arena.zero_()
        else:
            arena.view(torch.int64).sum()
        self._maps.append(arena)
        lo, hi = Ring(arena[:size], self.cap), Ring(arena[size:], self.cap)  # lo: lower rank -> higher
        self.rings[peer] = (lo, hi) if first else (hi, lo)

    def _advance_setup(self) -> None:
        """Map the pairs whose name arrived. gloo's irecv reports completion only from ``wait()``
        (``is_completed()`` stays false) but receives straight into the buffer, so the buffer is
        polled: 32 non-zero bytes (hex digits) once written. Never blocks: a rank waiting for a
        name keeps moving its other messages (SharedComm uses the rings only on gloo groups)."""
        for peer, (work, buf) in list(self.setup.items()):
            if bool((buf != 0).all()):
                work.wait()
                path = f"/dev/shm/shardlab-{os.getuid()}-p2p-{bytes(buf.tolist()).decode()}"
                self._map(peer, path, first=False)
                _unlink(path)  # both ranks have it mapped: the name can go
                del self.setup[peer]

    # -- progress ----------------------------------------------------------------------------
    def progress(self) -> bool:
        """Move every queued message as far as the rings allow; True if any byte moved."""
        if self.setup:
            self._advance_setup()
        moved = False
        for queues, out in ((self.sends, True), (self.recvs, False)):
            for peer, q in queues.items():
                if peer not in self.rings:
                    continue
                ring = self.rings[peer][0 if out else 1]
                while q:
                    op = q[0]
                    if op.part == 1 and op.boxed:  # the header went: the data goes through the box
                        moved |= self._box(peer, out, ring).advance(op) > 0
                        if not op.done:
                            break
                        q.popleft()
                        continue
                    n = (ring.put if out else ring.take)(op.parts[op.part], op.off)
                    op.off += n
                    moved |= n > 0
                    if op.off < op.parts[op.part].numel():
                        break
                    if op.part == 0 and not out:
                        self._check_header(op, peer)
                    op.part, op.off = op.part + 1, 0
                    if op.part == 2:
                        op.done = True
                        q.popleft()
        return moved

    def _check_header(self, op: Op, peer: int) -> None:
        """A receive's header came: its length must be the buffer's; it says whether the data
        comes through the box."""
        got, op.boxed = shm_pair.decode(int(op.head[0]))
        if got != op.tensor.numel() * op.tensor.element_size():
            self.broken = True
            raise RuntimeError(
                f"{self.comm.name}: group rank {peer} sent a message of {got} bytes "
                f"where this rank's receive expects {op.tensor.numel() * op.tensor.element_size()} "
                "(sends and receives between two ranks must be issued in the same order)")

    def _box(self, peer: int, out: bool, ring: Ring) -> shm_pair.Box:
        box = self.boxes.get((peer, out))
        if box is None:
            box = self.boxes[peer, out] = shm_pair.Box(ring, out, self.comm.device, self.stream)
        return box

    # -- sends left unreceived (checked at each collective and barrier of the group) -----------
    def publish(self, rounds: int) -> tuple[int, int]:
        """Before this rank enters a collective of the group: map every pair still being set up
        (its peer sent the name at its first message with this rank: it arrives), then publish
        how many messages it has sent to and asked from each peer, in slot ``rounds % 2``
        (``rounds``: the barrier's number); returns this rank's (sent, asked for) totals."""
        if self.setup:
            self.wait_until(lambda: not self.setup, "point-to-point set-up (the peer's ring name never came)")
        slot = self.rounds = rounds % 2
        for peer, (out, inc) in self.rings.items():
            out.posted[slot] = self.issued.get(("send", peer), 0)
            inc.wanted[slot] = self.issued.get(("recv", peer), 0)
        return (sum(v for (kind, _), v in self.issued.items() if kind == "send"),
                sum(v for (kind, _), v in self.issued.items() if kind == "recv"))

    def unreceived(self, where: str) -> str | None:
        """After the collective's barrier (every rank published): the error text if a message
        between this rank and a peer was sent but not asked for before the collective, else None.
        Both ranks of the pair see it (the sender from its count, the receiver from the ring)."""
        me, slot = self.comm.rank, self.rounds
        for peer, (out, inc) in self.rings.items():
            for src, dst, sent, wanted, ring in ((me, peer, self.issued.get(("send", peer), 0), int(out.wanted[slot]), out),
                                                 (peer, me, int(inc.posted[slot]), self.issued.get(("recv", peer), 0), inc)):
                if sent <= wanted:
                    continue
                if src == me:
                    kept = self.sizes.get(peer, ())
                    back = sent - wanted  # the first unreceived send, counted from the latest
                    nbytes = kept[-back] if back <= len(kept) else None
                else:
                    nbytes = ring.head() if not self.recvs.get(peer) else None
                size = f" of {nbytes} bytes" if nbytes is not None else ""
                return (f"{self.comm.name}: group rank {src} sent {sent - wanted} message(s) to group rank {dst} "
                        f"that it did not receive before {where} (send #{wanted + 1}{size} from {src} to {dst} "
                        "is unmatched; every send needs its receive before the group's next collective)")
        return None

    def at_exit(self, phase: int) -> None:
        """When the rank's function returned (launch.run, Ray; flight.py runs phase 1 of every
        check, then phase 2). 1: mark this rank's incoming rings closed, raise if a peer's message
        lies unreceived in one. 2: once each peer took this rank's messages or closed (at most the
        group's timeout), raise if one of them lies unreceived."""
        if phase == 1:
            for out, inc in self.rings.values():
                inc.closed[0] = 2 if self.broken else 1  # 2: a desync was raised here already
        if self.broken:
            return
        if phase == 2:
            self.wait_until(lambda: not any(self.sends.values()), "sends at exit")
        me = self.comm.rank
        for peer, (out, inc) in self.rings.items():
            src, dst, ring = (peer, me, inc) if phase == 1 else (me, peer, out)
            if phase == 2:
                self.wait_until(lambda: int(out.read[0]) == int(out.written[0]) or int(out.closed[0]),
                                f"exit: group rank {peer} to receive this rank's messages")
            if int(ring.written[0]) > int(ring.read[0]) and int(ring.closed[0]) != 2:
                size = ring.head() if not self.recvs.get(peer) else None
                raise RuntimeError(f"{self.comm.name}: group rank {src} sent group rank {dst} a message"
                                   f"{f' of {size} bytes' if size is not None else ''} that it never received "
                                   "(its function returned; every send needs its receive)")

    def wait_until(self, cond, what: str) -> None:
        shm_host.wait(cond, self.timeout_s, lambda: f"{self.comm.name}: shared-memory {what}: no progress "
                      "(did the peer issue the matching call?)", self.progress, self.comm.spin_s)


class RingPointToPoint:
    """SharedComm's isend / irecv / exchange through the rings. Mixed in before ``Comm``, so
    ``super()`` is the process group's point-to-point, which stays in use on a host without the
    shared-memory barrier's x86-64 ordering, in check mode (its headers ride the group), and on
    a group that is not gloo's (the set-up polls a gloo receive). Decided once, at first use."""

    _channels: Channels | None = None
    _rings_on: bool | None = None

    def _p2p(self) -> bool:
        if self._rings_on is None:
            self._rings_on = (self.host_barrier == "shm" and not self.flight.check
                              and dist.get_backend(self.group) == "gloo")
            if self._rings_on:
                self._channels = Channels(self, self.p2p_cap, self.timeout_s)
        return self._rings_on

    def _post(self, kind: str, t: torch.Tensor, peer: int) -> Op:
        if self._comm_thread is not None:  # after the collectives queued on the comm's thread
            self._comm_thread.hold()
        self.ledger.record(kind, self.name, *((_nbytes(t), 0) if kind == "send" else (0, _nbytes(t))))
        return self._channels.post(kind, t, peer, self.flight.enter(self, kind, (t,), None, peer))

    def isend(self, t: torch.Tensor, peer: int):
        """Non-blocking send to group rank ``peer`` through the pair's ring; ``t`` must stay
        unchanged until ``wait()``. Matched with the peer's receives in issue order."""
        return self._post("send", t.detach().contiguous(), peer) if self._p2p() else super().isend(t, peer)

    def irecv(self, t: torch.Tensor, peer: int):
        """Non-blocking receive into ``t`` (contiguous) of the earliest unreceived message from ``peer``."""
        return self._post("recv", t, peer) if self._p2p() else super().irecv(t, peer)

    def _p2p_publish(self, epoch: int, line: torch.Tensor) -> None:
        """Called by the shared-memory barrier ``epoch`` before this rank arrives
        (``shm._shm_barrier``): per pair into the rings, and this rank's totals into its ``line``."""
        if self._channels is not None:
            at = 8 + 2 * (epoch % 2)
            line[at], line[at + 1] = self._channels.publish(epoch)

    def _p2p_check(self, epoch: int, lines: list, where_fn) -> None:
        """Called once every rank arrived (``lines``: every rank's line): every rank raises if the
        group's ranks sent more messages than they asked for; the pair's ranks name it.
        ``where_fn()``: the collective, named only when it raises."""
        at = 8 + 2 * (epoch % 2)
        sent, wanted = sum(row[at] for row in lines), sum(row[at + 1] for row in lines)
        if sent == wanted:
            return
        where = where_fn()
        pair = self._channels.unreceived(where) if self._channels is not None else None
        if pair or sent > wanted:
            if self._channels is not None:
                self._channels.broken = True
            raise RuntimeError(pair or f"{self.name}: the group's ranks sent {sent} point-to-point messages but "
                               f"asked for {wanted} before {where}: a send has no matching receive (the ranks of "
                               "its pair name it)")

    @_recorded("barrier", lambda: ((), None))
    def barrier(self):
        """The counter barrier of the collectives (``shm._shm_barrier``) where the host has it, so
        a barrier too is compared with what the other ranks are in and checks for unreceived
        sends (the process group's would first wait for this rank's pending gloo sends: a ring
        name its peer never asked for). Else the process group's."""
        if self.size == 1 or self.host_barrier != "shm":
            return super().barrier()
        self._sig = shm_host.BARRIER
        with _disable_current_modes():
            self._sync()

    def exchange(self, sends=(), recvs=()) -> list:
        """Receives then sends, each list in its order, all queued before any is waited for (two
        ranks that send to each other progress both ways while they wait)."""
        if not self._p2p():
            return super().exchange(sends, recvs)
        return [self.irecv(t, peer) for t, peer in recvs] + [self.isend(t, peer) for t, peer in sends]
