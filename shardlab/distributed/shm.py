"""SharedComm: collectives through shared memory for the ranks of one host (docs/collectives.md,
"Shared-memory transport", which gives the region protocol and its ordering argument).

Every rank owns two regions ``a`` and ``b`` of a shared arena and maps the others'. A collective
writes the rank's input into its region, passes a host barrier, then reads or reduces what it
needs straight from the others' regions (all_reduce: a reduce-scatter into the other region, a
second barrier, an all-gather). The region written first alternates between calls
(``self._free``), so no call needs a barrier at its end. CPU: one /dev/shm file; CUDA: device
regions opened from IPC handles, on a comm stream (shm_cuda.py). Messages over the chunk size go
in chunks, one barrier each; the arena grows collectively; the host barrier also checks that no
point-to-point message (shm_p2p.py) was left unreceived.
"""
from __future__ import annotations

import math
import os
import platform
import uuid

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .collectives import Comm, _nbytes, _recorded, _t_a2a, _t_dim, _t_op, _t_rs, _t_src
from . import shm_host
from .shm_cuda import CHUNK as CUDA_CHUNK, StreamOrder, streamed
from .shm_host import X86, _reduce_into, _round, _spans, modes_off as _modes_off
from .shm_p2p import RingPointToPoint
from .shm_thread import ThreadedAsync

class SharedComm(ThreadedAsync, RingPointToPoint, Comm):
    """A :class:`Comm` whose collectives run through memory shared by the group's ranks (all on
    one host). Same interface and results as the process-group ``Comm``; ``algorithm`` is ignored
    (the transport replaces the algorithm choice). Constructing one is local; the first
    collective sets up the arena (collectively). A tensor on another kind of device than
    ``device`` goes through the process group instead (the base class)."""

    def __init__(self, name, group, ranks, rank, ledger, algorithm="backend", flight=None,
                 device: torch.device | str = "cpu", host_barrier: str = "auto", p2p_cap: int = 16 << 20,
                 cuda_streams: bool = True, one_shot_ranks: int | None = None, comm_thread: bool = False):
        """``host_barrier``: "shm" (flags in shared memory, x86-64 only), "process_group"
        (``dist.barrier``) or "auto" (shm on x86-64). ``p2p_cap``: bytes of each point-to-point
        ring (per pair and direction; longer messages stream through it). ``cuda_streams=False``:
        the first CUDA version (the stream drained at every barrier, host-sized chunks), kept to
        be measured against (``shardlab bench comm --transport shared_sync``). ``one_shot_ranks``:
        groups up to this size (default 2) all-reduce in one phase (every rank sums every region:
        one barrier instead of two), and groups up to 4 for chunks up to
        ``shm_host.ONE_SHOT_BYTES``; 0: always two phases (docs/collectives.md, "On a GPU").
        ``comm_thread``: queue the asynchronous collectives on a thread of this comm (shm_thread.py)."""
        super().__init__(name, group, ranks, rank, ledger, algorithm, flight)
        if host_barrier not in ("auto", "shm", "process_group"):
            raise ValueError(f"host_barrier: {host_barrier!r}; choose auto, shm or process_group")
        if host_barrier == "shm" and not X86:
            raise ValueError(f"host_barrier='shm' relies on x86-64 memory ordering; this is {platform.machine()}")
        self.host_barrier = "shm" if host_barrier == "auto" and X86 else host_barrier
        self._epoch, self.device = 0, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._token, self._gen, self._ctl_buf = None, 0, None
        self._sig = (0, 0, 0)  # the collective this rank is in (shm_host.signature), checked at each barrier
        self.cap, self._free = 0, 0  # _free: which region (0: a, 1: b) this rank may write before a call's first barrier
        self._regions: list[tuple[torch.Tensor, torch.Tensor]] = []  # per group rank: (a, b), uint8
        self.p2p_cap = p2p_cap  # point-to-point (RingPointToPoint, shm_p2p.py)
        self.timeout_s = shm_host.group_timeout(group)  # how long a barrier or a ring may wait
        self.spin_s = shm_host.spin_seconds(self.size)  # how long a wait yields before napping
        cuda = self.device.type == "cuda"
        streams = cuda and cuda_streams and self.size > 1
        self._order = StreamOrder(self.device) if streams else None  # shm_cuda.py
        self._chunk = CUDA_CHUNK if streams else shm_host.chunk_bytes(self.size)  # bytes per rank per phase
        self._one_shot = 2 if one_shot_ranks is None else one_shot_ranks
        self.comm_thread = comm_thread

    # -- the arena -----------------------------------------------------------------------------
    # Created lazily by the first collective (constructing a Comm is not collective: Mesh.comm()
    # builds them in whatever order a rank first asks for them).
    @property
    def _ctl(self) -> torch.Tensor:
        """The host control arena: row i = (bytes of rank i's all_to_all input, its in_splits,
        its out_splits); then per rank two 64-byte lines: its barrier counter, two signatures of
        3 words, then two (messages sent, asked for) pairs (shm_p2p.py), by barrier parity."""
        if self._ctl_buf is None:
            n = self.size
            buf = self._host(n * (2 * n + 1) * 8 + n * 128).view(torch.int64)
            self._ctl_buf = buf[:n * (2 * n + 1)].view(n, 2 * n + 1)
            self._lines = buf[n * (2 * n + 1):].view(n, 16).numpy()  # numpy: a store or a poll without dispatch
            self._flags = self._lines[:, 0]
        return self._ctl_buf

    def _shm_barrier(self):
        """Each rank publishes how many barriers it has entered and waits until every counter has
        reached its own: single-writer counters, no atomics. Correct on x86-64's ordering (stores
        are seen in program order; loads are not moved before earlier loads or after later
        stores), hence x86-64 only. Waits by yielding, then sleeping (shm_host.wait; 2 cores, up
        to 8 ranks), at most the group's timeout."""
        self._ctl  # created collectively on first use
        self._epoch += 1
        epoch = self._epoch
        at = 1 + 3 * (epoch % 2)  # this collective's signature (shm_host.signature) before the counter;
        self._lines[self.rank, at:at + 3] = self._sig  # a peer can be one barrier ahead
        self._p2p_publish(epoch, self._lines[self.rank])  # the messages it sent and asked for (shm_p2p.py)
        self._flags[self.rank] = epoch
        shm_host.wait(lambda: int(self._flags.min()) >= epoch, self.timeout_s,
                      lambda: f"{self.name}: shared-memory barrier: group ranks "
                              f"{[i for i in range(self.size) if int(self._flags[i]) < epoch]} did not arrive",
                      spin_s=self.spin_s)
        lines = self._lines.tolist()
        bad = shm_host.mismatch(self.name, [row[at:at + 3] for row in lines])
        if bad:
            raise RuntimeError(bad)
        self._p2p_check(epoch, lines, lambda: f"its {shm_host.describe(self._sig)}")

    def _host(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` mapped by every rank of the group (collective)."""
        if self._token is None:  # group rank 0 names the group's files
            token = [uuid.uuid4().hex if self.rank == 0 else None]
            dist.broadcast_object_list(token, src=self.ranks[0], group=self.group)
            self._token = f"shardlab-{os.getuid()}-{token[0]}"
        path = f"/dev/shm/{self._token}-{self._gen}"
        self._gen += 1
        failed = [None]
        if self.rank == 0:
            try:
                shm_host.reserve(path, nbytes)
            except ConfigError as e:  # no room: every rank raises it, none maps a short file
                failed[0] = f"{self.name}: {e.detail}"
        try:
            dist.broadcast_object_list(failed, src=self.ranks[0], group=self.group)
            if failed[0]:
                raise ConfigError("parallel.comm_transport", failed[0])
            buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            dist.barrier(group=self.group)  # every rank has it mapped: the name can go
        finally:
            if self.rank == 0 and os.path.exists(path):
                os.unlink(path)
        return buf

    def _device_regions(self, cap: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """CUDA: this rank's 2*cap bytes on its device, the others' opened from IPC handles."""
        from torch.multiprocessing.reductions import reduce_tensor

        mine = torch.empty(2 * cap, dtype=torch.uint8, device=self.device)
        self._own_alloc = mine  # keep it alive while others map it
        rebuild, handle = reduce_tensor(mine)
        handles = [None] * self.size
        dist.all_gather_object(handles, handle, group=self.group)
        bufs = [mine if i == self.rank else rebuild(*h) for i, h in enumerate(handles)]
        if self._order is not None:
            self._order.exchange(self.group, self.rank, self.size)  # the peers' events (once)
        return [(b[:cap], b[cap:]) for b in bufs]

    def _ensure(self, nbytes: int):
        """Grow every rank's regions to hold ``nbytes`` (collective; every rank passes the same).
        A barrier first compares the ranks' signatures: a rank in another collective (or the same
        with another size) raises there, instead of the growth's own collectives hanging."""
        if nbytes <= self.cap:
            return
        self._sync()
        cap = _round(max(nbytes, 2 * self.cap))
        self._regions = []  # drop the old mappings before making the new ones
        if self.device.type == "cuda":
            self._regions = self._device_regions(cap)
        else:
            arena = self._host(2 * self.size * cap)
            self._regions = [(arena[2 * i * cap:(2 * i + 1) * cap], arena[(2 * i + 1) * cap:(2 * i + 2) * cap])
                             for i in range(self.size)]
        self.cap, self._free = cap, 0

    def _region(self, i: int, which: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        es = torch.empty((), dtype=dtype).element_size()
        return self._regions[i][which][:numel * es].view(dtype)

    def _sync(self):
        """The host barrier. On CUDA each rank's stream work before it is marked by an event, and
        the stream waits for every peer's after it (shm_cuda.py); before the events are exchanged
        (the first barrier) the stream is drained instead."""
        events = self._order is not None and self._order.peers
        if events:
            self._order.arrive()
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self.host_barrier == "shm":
            self._shm_barrier()
        else:
            dist.barrier(group=self.group)
        if events:
            self._order.depart()

    def _write(self, t: torch.Tensor) -> int:
        """Copy ``t`` into this rank's free region; return the region written."""
        which = self._free
        self._region(self.rank, which, t.dtype, t.numel()).view(t.shape).copy_(t)
        return which

    def _elsewhere(self, t: torch.Tensor) -> bool:
        return t.device.type != self.device.type

    def _inputs(self, which: int, dtype, numel: int) -> list[torch.Tensor]:
        return [self._region(i, which, dtype, numel) for i in range(self.size)]

    # -- collectives ---------------------------------------------------------------------------
    @_recorded("all_reduce", _t_op)
    @_modes_off
    @streamed
    def all_reduce(self, t: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> torch.Tensor:
        """In place: t <- op over the group. ``op``: sum, avg, max, min."""
        self._check_avg("all_reduce", t, op)
        if self.size == 1 or self._elsewhere(t):
            return super().all_reduce(t, op, "backend")
        self._in_place("all_reduce", t, op, lambda chunk: self._all_reduce_chunk(chunk, op))
        return t.div_(self.size) if op == "avg" else t

    def _in_place(self, name: str, t: torch.Tensor, key, one_chunk):
        """The frame of an in-place collective: count and sign the call, run ``one_chunk`` on each
        region-sized chunk of ``t`` flattened, copy back when ``t`` was not contiguous."""
        self._count(name, _nbytes(t))
        self._sig = shm_host.signature(name, t, _nbytes(t), key)
        if t.numel() == 0:
            return t
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()
        spans = _spans(flat.numel(), 1, t.element_size(), self._chunk)
        self._ensure(_nbytes(flat[:spans[0][1]]))
        for lo, hi in spans:
            one_chunk(flat[lo:hi])
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view(t.shape))
        return t

    def _all_reduce_chunk(self, flat: torch.Tensor, op: str):
        """One chunk: a reduce-scatter into the other region, a barrier, an all-gather of the parts;
        or, one-shot, a barrier, then every rank reduces every rank's region (in rank order, so
        every rank gets the same bits); the next write goes to the other region."""
        m, n = flat.numel(), self.size
        inp = self._write(flat)
        if n <= self._one_shot or (self._one_shot and n <= 4 and _nbytes(flat) <= shm_host.ONE_SHOT_BYTES):
            self._sync()
            _reduce_into(flat, self._inputs(inp, flat.dtype, m), op)
            self._free = 1 - inp  # peers may still read ``inp``; ``1 - inp`` was last read before this barrier
            return
        out = 1 - inp
        bounds = [(i * m // n, (i + 1) * m // n) for i in range(n)]
        self._sync()
        lo, hi = bounds[self.rank]
        _reduce_into(self._region(self.rank, out, flat.dtype, hi - lo),
                     [x[lo:hi] for x in self._inputs(inp, flat.dtype, m)], op)
        self._sync()
        for i, (a, b) in enumerate(bounds):
            flat[a:b].copy_(self._region(i, out, flat.dtype, b - a))
        # the last phase read region ``out``: the next chunk may write ``inp`` first (_free unchanged)

    @_recorded("all_gather", _t_dim)
    def all_gather(self, t: torch.Tensor, dim: int = 0, algorithm: str | None = None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (equal shapes)."""
        return self._gather(t, dim)

    @_modes_off
    @streamed
    def _gather(self, t: torch.Tensor, dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """all_gather, written into ``out`` when given (no fresh result to allocate and fault in)."""
        if self.size == 1 or self._elsewhere(t):
            res = super().all_gather(t, dim, "backend")
            return res if out is None else out.copy_(res)
        self._count("all_gather", _nbytes(t) * self.size)
        self._sig = shm_host.signature("all_gather", t, _nbytes(t))
        if t.numel() == 0:
            res = torch.cat([t] * self.size, dim=dim)
            return res if out is None else out.copy_(res)
        if dim == 0 and _nbytes(t) > self._chunk and (out is None or out.is_contiguous()):
            return self._gather_chunks(t, out)
        self._ensure(_nbytes(t))
        inp = self._write(t)
        self._sync()
        res = torch.cat([x.view(t.shape) for x in self._inputs(inp, t.dtype, t.numel())], dim=dim, out=out)
        self._free = 1 - inp
        return res

    def _gather_chunks(self, t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """A dim-0 all_gather in chunks of ``t``'s flat elements (row i of the result is rank i's)."""
        res = out if out is not None else t.new_empty((t.shape[0] * self.size,) + tuple(t.shape[1:]))
        flat, rows = t.reshape(-1), res.view(self.size, -1)
        spans = _spans(flat.numel(), 1, t.element_size(), self._chunk)
        self._ensure(_nbytes(flat[:spans[0][1]]))
        for lo, hi in spans:
            inp = self._write(flat[lo:hi])
            self._sync()
            for i, x in enumerate(self._inputs(inp, t.dtype, hi - lo)):
                rows[i, lo:hi].copy_(x)
            self._free = 1 - inp
        return res

    @_recorded("reduce_scatter", _t_rs)
    @_modes_off
    @streamed
    def reduce_scatter(self, t: torch.Tensor, dim: int = 0, op: str = "sum",
                       algorithm: str | None = None) -> torch.Tensor:
        """Reduce over the group and keep this rank's 1/size slice of ``dim``."""
        self._check_avg("reduce_scatter", t, op)
        if self.size == 1 or self._elsewhere(t):
            return super().reduce_scatter(t, dim, op, "backend")
        self._check_divisible(t, dim)
        self._count("reduce_scatter", _nbytes(t))
        self._sig = shm_host.signature("reduce_scatter", t, _nbytes(t), op)
        x = t.movedim(dim, 0)
        shape = (x.shape[0] // self.size,) + tuple(x.shape[1:])
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
        if t.numel() > 0:
            c, n = out.numel(), self.size
            rows, spans = x.reshape(n, c), _spans(c, n, t.element_size(), self._chunk)
            self._ensure(n * spans[0][1] * t.element_size())
            for lo, hi in spans:  # chunk (lo, hi) of every rank's part: n x (hi - lo) elements
                k, inp = hi - lo, self._free
                self._region(self.rank, inp, t.dtype, n * k).view(n, k).copy_(rows[:, lo:hi])
                self._sync()
                _reduce_into(out.view(-1)[lo:hi], [p[self.rank * k:(self.rank + 1) * k]
                                                   for p in self._inputs(inp, t.dtype, n * k)], op)
                self._free = 1 - inp
            if op == "avg":
                out.div_(self.size)
        return out if dim == 0 else out.movedim(0, dim).contiguous()

    @_recorded("all_to_all", _t_a2a)
    @_modes_off
    @streamed
    def all_to_all(self, t: torch.Tensor, in_splits: list[int] | None = None,
                   out_splits: list[int] | None = None, algorithm: str | None = None) -> torch.Tensor:
        """Exchange dim-0 chunks: chunk i of ``t`` goes to rank i (uneven splits allowed)."""
        if self.size == 1 or self._elsewhere(t):
            return super().all_to_all(t, in_splits, out_splits, "backend")
        n = self.size
        in_splits, out_splits = self._a2a_splits(t, in_splits, out_splits)
        self._count_a2a(t, in_splits, out_splits)
        self._sig = shm_host.signature("all_to_all", t, 0)
        # Phase 1: agree on the arena size and learn where each sender put each receiver's rows.
        self._ctl[self.rank, 0] = _nbytes(t)
        self._ctl[self.rank, 1:] = torch.tensor(in_splits + out_splits, dtype=torch.int64)
        self._sync()
        ctl = self._ctl.clone()
        need = int(ctl[:, 0].max())
        sends, expects = ctl[:, 1:n + 1], ctl[:, n + 1:]
        if not torch.equal(sends, expects.t()):  # every rank sees every mismatch: all raise together
            bad = next((i, j) for i in range(n) for j in range(n) if sends[i, j] != expects[j, i])
            raise ValueError(f"all_to_all: group rank {bad[0]} sends {int(sends[bad])} rows to rank {bad[1]}, "
                             f"which expects {int(expects[bad[1], bad[0]])}")
        self._ensure(need)
        inp = self._free
        if t.numel():
            self._write(t)
        self._sync()  # phase 2 (also after an all-empty phase 1: ctl is rewritten by the next call)
        rest = tuple(t.shape[1:])
        out = t.new_empty((sum(out_splits),) + rest)
        if need:
            width, at = math.prod(rest), 0
            for i in range(n):
                start, rows = int(ctl[i, 1:1 + self.rank].sum()), out_splits[i]
                src = self._region(i, inp, t.dtype, (start + rows) * width)[start * width:]
                out[at:at + rows].copy_(src.view((rows,) + rest))
                at += rows
        self._free = 1 - inp
        return out

    @_recorded("broadcast", _t_src)
    @_modes_off
    @streamed
    def broadcast(self, t: torch.Tensor, src: int = 0, algorithm: str | None = None) -> torch.Tensor:
        """In place from group rank ``src``."""
        if self.size == 1 or self._elsewhere(t):
            return super().broadcast(t, src, "backend")
        return self._in_place("broadcast", t, src, lambda chunk: self._broadcast_chunk(chunk, src))

    def _broadcast_chunk(self, chunk: torch.Tensor, src: int):
        inp = self._free
        if self.rank == src:
            self._write(chunk)
        self._sync()
        if self.rank != src:
            chunk.copy_(self._region(src, inp, chunk.dtype, chunk.numel()))
        self._free = 1 - inp
