"""One direction of a pair of ranks on the shared-memory transport's point-to-point (shm_p2p.py;
docs/collectives.md, "Shared-memory transport", Point-to-point): its byte ring (:class:`Ring`)
and, for CUDA tensors, its box (:class:`Box`): point-to-point without host staging.

A CUDA tensor sent between ranks sharing a GPU goes through a *box*: two slots of :data:`SLOT`
bytes in the sender's device memory, which the receiver opens from its CUDA IPC handle. The
pair's host ring carries only the message's header (its length, negated: a boxed message) and
then one 8-byte record per piece. Piece ``p`` of a direction (counted over all its messages)
uses slot ``p % 2``:

* the sender writes piece ``p`` once the receiver has consumed piece ``p - 2`` (the ring's
  ``consumed`` counter, on the receiver's line), then puts its record in the ring;
* the receiver, on a record, copies the slot into its buffer and raises ``consumed``.

On CUDA both copies run on the comm's p2p stream, ordered between the processes by
interprocess events per slot, never by a host wait: ``sent[s]`` is recorded after the sender's
copy and waited on by the receiver's stream before its copy; ``done[s]`` the other way. An event
is re-recorded only after the other side has waited on it (the sender re-uses slot ``s`` only
once ``consumed`` says the receiver queued its copy of the piece before; the receiver records
``done[s]`` for a piece only after the sender's record of it came). ``Op.wait()`` makes the
caller's stream wait for the op's last copy. The handles (box and ``sent`` events one way,
``done`` events the other) travel once per direction through the ring's set-up area.

Host tensors keep the ring itself, unless :data:`HOST_SLOT` is set: then they take the same path
through a box in the pair's file (no events: host copies are done when they return). That runs
the protocol on a CPU (the tests); on a GPU the slots are device memory.
"""
from __future__ import annotations

import pickle

import torch

SLOT = 32 << 20
"""Bytes of one slot of a CUDA box (two per direction, allocated at the first boxed message)."""
HOST_SLOT = 0
"""Bytes of one slot of a host box in the pair's file; 0: host tensors go through the ring."""
SETUP = 4096
"""Bytes of a ring's set-up area: the sender's handles (first half), the receiver's (second)."""
LINE = 64
"""Bytes: one counter per cache line."""


def encode(nbytes: int, boxed: bool) -> int:
    """A message header: its length, negated (minus one) when the data goes through the box."""
    return -nbytes - 1 if boxed else nbytes


def decode(head: int) -> tuple[int, bool]:
    return (-head - 1, True) if head < 0 else (head, False)


def host_box_bytes() -> int:
    return 2 * HOST_SLOT


def _put_blob(area: torch.Tensor, blob: bytes) -> None:
    """Write ``blob`` into ``area`` (a uint8 view): its bytes, then its length (8 bytes) first."""
    if len(blob) + 8 > area.numel():
        raise RuntimeError(f"point-to-point set-up: {len(blob)} bytes of handles do not fit {area.numel() - 8}")
    area[8:8 + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    area[:8].view(torch.int64)[0] = len(blob)  # published after the bytes (x86-64 store order)


def _get_blob(area: torch.Tensor) -> bytes | None:
    n = int(area[:8].view(torch.int64)[0])
    return bytes(area[8:8 + n].tolist()) if n else None


class Ring:
    """One direction of a pair: ``written`` / ``read`` byte counters and ``cap`` data bytes, and
    the messages each side had issued when it entered the group's latest two barriers (two
    slots by parity: a peer can be one barrier ahead): ``posted`` (sends, on the producer's
    line) and ``wanted`` (receives, on the consumer's)."""

    def __init__(self, buf: torch.Tensor, cap: int):
        ctr = buf[:2 * LINE].view(torch.int64)
        self.written, self.read = ctr[0:1], ctr[LINE // 8:LINE // 8 + 1]
        self.posted, self.wanted = ctr[1:3], ctr[LINE // 8 + 1:LINE // 8 + 3]
        self.closed = ctr[LINE // 8 + 3:LINE // 8 + 4]  # the consumer's function returned (1; 2: it raised a desync)
        self.consumed = ctr[LINE // 8 + 4:LINE // 8 + 5]  # pieces of boxed messages the consumer took (shm_pair.py)
        at = 2 * LINE + SETUP
        self.setup = buf[2 * LINE:at]  # the boxes' handles (shm_pair.py)
        self.data, self.cap = buf[at:at + cap], cap
        self.box = buf[at + cap:at + cap + host_box_bytes()]  # host tensors' box (shm_pair.HOST_SLOT)

    @staticmethod
    def nbytes(cap: int) -> int:
        return 2 * LINE + SETUP + cap + host_box_bytes()

    def room(self) -> int:
        return self.cap - (int(self.written[0]) - int(self.read[0]))

    def available(self) -> int:
        return int(self.written[0]) - int(self.read[0])

    def put(self, src: torch.Tensor, off: int) -> int:
        """Copy as many bytes of ``src[off:]`` as fit; returns how many."""
        w = int(self.written[0])
        n = min(src.numel() - off, self.cap - (w - int(self.read[0])))
        if n <= 0:
            return 0
        at = w % self.cap
        first = min(n, self.cap - at)
        self.data[at:at + first].copy_(src[off:off + first])
        if n > first:
            self.data[:n - first].copy_(src[off + first:off + n])
        self.written[0] = w + n  # publish after the data
        return n

    def head(self) -> int | None:
        """The length header of the earliest unreceived message, if it is in the ring (read when
        no receive from this ring is under way, so ``read`` is at a message boundary)."""
        r = int(self.read[0])
        if int(self.written[0]) - r < 8:
            return None
        at = [(r + i) % self.cap for i in range(8)]
        return decode(int(self.data[at].view(torch.int64)[0]))[0]

    def take(self, dst: torch.Tensor, off: int) -> int:
        """Copy as many available bytes as ``dst[off:]`` needs; returns how many."""
        r = int(self.read[0])
        n = min(dst.numel() - off, int(self.written[0]) - r)
        if n <= 0:
            return 0
        at = r % self.cap
        first = min(n, self.cap - at)
        dst[off:off + first].copy_(self.data[at:at + first])
        if n > first:
            dst[off + first:off + n].copy_(self.data[:n - first])
        self.read[0] = r + n  # release after the copy
        return n


class Box:
    """One direction of a pair (this rank sends, ``out``; or receives) and its slots."""

    def __init__(self, ring, out: bool, device: torch.device, stream):
        self.ring, self.out, self.device, self.stream = ring, out, device, stream
        self.pieces = 0  # pieces this side has handled in this direction
        self.slots: list[torch.Tensor] | None = None
        self.host = device.type != "cuda"
        self.mine: list = []    # events this side records (sender: sent; receiver: done)
        self.theirs: list = []  # the other side's, opened from their handles
        self.slot = HOST_SLOT if self.host else SLOT
        if self.host:
            self.slots = [ring.box[:HOST_SLOT], ring.box[HOST_SLOT:2 * HOST_SLOT]]

    # -- set-up (CUDA) -----------------------------------------------------------------------
    def _sender_setup(self) -> None:
        from torch.multiprocessing.reductions import reduce_tensor
        buf = torch.empty(2 * SLOT, dtype=torch.uint8, device=self.device)
        self.slots, self._own = [buf[:SLOT], buf[SLOT:]], buf
        self.mine = [torch.cuda.Event(interprocess=True) for _ in range(2)]
        for e in self.mine:
            e.record(self.stream)  # an event must have been recorded once to have a handle
        _, args = reduce_tensor(buf)
        _put_blob(self.ring.setup[:SETUP // 2], pickle.dumps((args, [e.ipc_handle() for e in self.mine])))

    def _receiver_setup(self) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        blob = _get_blob(self.ring.setup[:SETUP // 2])
        if blob is None:
            raise RuntimeError("point-to-point: a boxed message came before its box's handles")
        args, handles = pickle.loads(blob)
        buf = rebuild_cuda_tensor(*args)
        self.slots, self._own = [buf[:SLOT], buf[SLOT:]], buf
        self.theirs = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in handles]
        self.mine = [torch.cuda.Event(interprocess=True) for _ in range(2)]
        for e in self.mine:
            e.record(self.stream)
        _put_blob(self.ring.setup[SETUP // 2:], pickle.dumps([e.ipc_handle() for e in self.mine]))

    def _sender_peer_events(self) -> None:
        blob = _get_blob(self.ring.setup[SETUP // 2:])  # there once a piece was consumed
        self.theirs = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in pickle.loads(blob)]

    # -- moving pieces -----------------------------------------------------------------------
    def advance(self, op) -> int:
        """Move ``op``'s data (its header already went) as far as the slots and the ring allow;
        sets ``op.done`` at its end. Returns the bytes moved."""
        data = op.parts[1]  # the sent bytes, or the receive's buffer
        n, moved = data.numel(), 0
        if op.record is None:
            op.record = torch.zeros(1, dtype=torch.int64)
            op.record_bytes = op.record.view(torch.uint8)
        ring = self.ring
        while op.off < n:
            p, slot = self.pieces, self.pieces % 2
            if self.out:
                if (p >= 2 and int(ring.consumed[0]) < p - 1) or ring.room() < 8:
                    break  # the slot's last piece is still unread, or no room for the record
                if self.slots is None:
                    self._sender_setup()
                m = min(self.slot, n - op.off)
                self._copy(self.slots[slot][:m], data[op.off:op.off + m], slot, wait=p >= 2, op=op)
                op.record[0] = m
                ring.put(op.record_bytes, 0)
            else:
                if ring.available() < 8:
                    break
                ring.take(op.record_bytes, 0)
                m = int(op.record[0])
                if m != min(self.slot, n - op.off):
                    raise RuntimeError(f"point-to-point: a piece of {m} bytes where {min(self.slot, n - op.off)} "
                                       "were due (the ranks' box sizes differ)")
                if self.slots is None:
                    self._receiver_setup()
                self._copy(data[op.off:op.off + m], self.slots[slot][:m], slot, wait=True, op=op)
                ring.consumed[0] = p + 1  # after the copy (host) or its queueing (CUDA)
            self.pieces += 1
            op.off += m
            moved += m
        if op.off >= n:
            op.done = True
        return moved

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, slot: int, wait: bool, op) -> None:
        if self.host:
            dst.copy_(src)
            return
        if self.out and wait and not self.theirs:
            self._sender_peer_events()
        with torch.cuda.stream(self.stream):
            if op.ready is not None:  # the caller's work on the tensor before the post
                self.stream.wait_event(op.ready)
                op.ready = None
                if op.tensor.is_cuda:  # its memory is not handed out again before this stream is done
                    op.tensor.record_stream(self.stream)
            if wait:
                self.stream.wait_event(self.theirs[slot])
            dst.copy_(src)
            self.mine[slot].record(self.stream)
            if op.last is None:
                op.last = torch.cuda.Event()
            op.last.record(self.stream)
