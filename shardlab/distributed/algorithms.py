"""shardlab's own collective algorithms, built only on point-to-point sends and receives.

Each algorithm is a plain function ``f(link, x, ...)`` working on a flat (1-D, contiguous)
tensor ``x`` in place, where ``link`` is a :class:`Link`: the group's size, this rank's index
in it, and ``exchange(sends, recvs)`` (post every send and receive of one step together with
``batch_isend_irecv``, then wait). The Link counts the bytes this rank really sends and
receives; :class:`~shardlab.distributed.collectives.Comm` records them in the ledger.

Notation for costs (docs/collectives.md draws each algorithm): N ranks, M bytes per rank,
alpha = latency of one message, beta = seconds per byte, gamma = seconds per byte reduced.

=====================  =========================  =======================================
algorithm              rounds (alpha terms)       bytes sent per rank (beta terms)
=====================  =========================  =======================================
ring all-reduce        2(N-1)                     2M(N-1)/N
tree all-reduce        2 log2(N) (+ chunks)       <= 3M (inner nodes), M (leaves)
rhd all-reduce         2 log2(p) (+2 if N != p)   2M(p-1)/p (+M for folded ranks)
ring all-gather        N-1                        M(N-1)/N  (M = gathered output)
ring reduce-scatter    N-1                        M(N-1)/N  (M = full input)
pairwise all-to-all    N-1                        what leaves the rank (uneven splits)
binomial broadcast     ceil(log2 N)               <= M log2 N (the root)
chain broadcast        N-1 (+ chunks)             M (every rank but the last)
=====================  =========================  =======================================

Any world size (rhd folds the ranks beyond the largest power of two p into partners first),
any dtype the backend can send (reductions run in that dtype), any element count including
fewer than N and zero (empty pieces are skipped by both sides, which agree on every size).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Messages up to this many bytes use tree all-reduce under ``algorithm = "auto"``, larger ones
# ring. Measured with `shardlab bench comm` on the 2-core CPU machine (docs/collectives.md):
# tree beat ring up to 1 MiB at N = 4 and N = 8; ring won from 4 MiB (N = 4) / 16 MiB (N = 8).
AUTO_CROSSOVER_BYTES = 1 << 20
# Tree all-reduce and chain broadcast pipeline large messages in pieces of this size.
PIPELINE_BYTES = 512 * 1024

ALGORITHMS = ("backend", "ring", "tree", "rhd", "auto")


class Link:
    """Point-to-point exchanges inside one group (peers are indices in the group)."""

    def __init__(self, group, ranks: list[int], rank: int):
        self.group, self.ranks, self.rank, self.size = group, list(ranks), rank, len(ranks)
        self.sent = 0
        self.recv = 0
        self.pending = []

    def post(self, sends=(), recvs=()):
        """Post ``[(tensor, peer), ...]`` sends and receives together; -> (send works, recv works).
        Receives go first, so that a peer's send finds its receive already posted. With a
        backend that coalesces the batch into one work (NCCL), that work counts as a receive."""
        ops = []
        for t, peer in recvs:
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, self.ranks[peer], self.group))
                self.recv += t.numel() * t.element_size()
        n_recvs = len(ops)
        for t, peer in sends:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, self.ranks[peer], self.group))
                self.sent += t.numel() * t.element_size()
        if not ops:
            return [], []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            return [], works
        return works[n_recvs:], works[:n_recvs]

    def exchange(self, sends=(), recvs=(), defer_sends: bool = False):
        """Post sends and receives at once and wait for all of them. ``defer_sends``: wait only
        for the receives; the sends complete by :meth:`flush` (the caller promises not to
        modify those tensors before it)."""
        send_works, recv_works = self.post(sends, recvs)
        if defer_sends:
            self.pending += send_works
        else:
            recv_works = send_works + recv_works
        for work in recv_works:
            work.wait()

    def flush(self):
        for work in self.pending:
            work.wait()
        self.pending = []


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: str):
    """dst <- op(dst, src) in place; "avg" reduces as a sum (the caller divides once at the end)."""
    if op in ("sum", "avg"):
        dst.add_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    else:
        raise ValueError(f"unknown reduction {op!r}; use sum, avg, max or min")


def bounds(m: int, n: int) -> list[tuple[int, int]]:
    """Split m elements into n contiguous pieces as even as possible (first m % n get one more)."""
    q, rem = divmod(m, n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (i < rem)
        out.append((start, end))
        start = end
    return out


def _pieces(m: int, elem_size: int) -> list[tuple[int, int]]:
    step = max(1, PIPELINE_BYTES // elem_size)
    return [(a, min(a + step, m)) for a in range(0, m, step)]


# -- ring ----------------------------------------------------------------------------------------
def ring_reduce_scatter_(link: Link, x: torch.Tensor, chunks: list[tuple[int, int]], op: str):
    """N-1 steps; in step s rank r sends chunk r-1-s to its right neighbour and adds the chunk
    r-2-s arriving from its left one. Afterwards chunk r of ``x`` holds the full reduction."""
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    buf = torch.empty(max(b - a for a, b in chunks), dtype=x.dtype, device=x.device)
    for s in range(n - 1):
        (sa, sb), (ra, rb) = chunks[(r - 1 - s) % n], chunks[(r - 2 - s) % n]
        link.exchange([(x[sa:sb], right)], [(buf[: rb - ra], left)], defer_sends=True)
        reduce_(x[ra:rb], buf[: rb - ra], op)
    link.flush()  # chunks sent above are never written in this phase: only waited for here


def ring_all_gather_(link: Link, x: torch.Tensor, chunks: list[tuple[int, int]]):
    """N-1 steps; rank r starts owning chunk r; in step s it forwards chunk r-s to the right
    and receives chunk r-s-1 from the left, straight into place."""
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        (sa, sb), (ra, rb) = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        link.exchange([(x[sa:sb], right)], [(x[ra:rb], left)], defer_sends=True)
    link.flush()


def ring_all_reduce_(link: Link, x: torch.Tensor, op: str = "sum"):
    """Reduce-scatter then all-gather around the ring: 2(N-1) steps of about M/N bytes each."""
    chunks = bounds(x.numel(), link.size)
    ring_reduce_scatter_(link, x, chunks, op)
    ring_all_gather_(link, x, chunks)


# -- tree ----------------------------------------------------------------------------------------
def tree_all_reduce_(link: Link, x: torch.Tensor, op: str = "sum"):
    """Binary tree rooted at group rank 0 (children of r: 2r+1, 2r+2). Reduce up: each rank adds
    its children's pieces and passes the sum to its parent; broadcast down: the root's result
    flows back. Large messages go in pieces so that the levels of the tree work concurrently."""
    n, r = link.size, link.rank
    parent = (r - 1) // 2 if r else None
    children = [c for c in (2 * r + 1, 2 * r + 2) if c < n]
    pieces = _pieces(x.numel(), x.element_size())
    if not pieces:
        return
    step = pieces[0][1] - pieces[0][0]
    bufs = [torch.empty(step, dtype=x.dtype, device=x.device) for _ in children]
    for a, b in pieces:
        if children:
            link.exchange(recvs=[(buf[: b - a], c) for buf, c in zip(bufs, children)])
            for buf in bufs:
                reduce_(x[a:b], buf[: b - a], op)
        if parent is not None:  # a piece that went up is not written again before the flush
            link.exchange(sends=[(x[a:b], parent)], defer_sends=True)
    link.flush()
    for a, b in pieces:
        if parent is not None:
            link.exchange(recvs=[(x[a:b], parent)])
        if children:
            link.exchange(sends=[(x[a:b], c) for c in children], defer_sends=True)
    link.flush()


# -- recursive halving-doubling (Rabenseifner) ---------------------------------------------------
def rhd_all_reduce_(link: Link, x: torch.Tensor, op: str = "sum"):
    """Let p be the largest power of two <= N and e = N - p. Fold: ranks 2i and 2i+1 (i < e) add
    up on the odd one, the even one idles. The p remaining ranks (virtual ranks 0..p-1) run
    recursive halving, a reduce-scatter in which partners at distance p/2, p/4, ..., 1 swap
    halves of their current range, and then recursive doubling, the mirror-image all-gather.
    Unfold: every odd rank 2i+1 sends the result back to 2i."""
    n, r, m = link.size, link.rank, x.numel()
    p = 1 << (n.bit_length() - 1)
    e = n - p
    if r < 2 * e and r % 2 == 0:                       # folded away: hand over, wait for result
        link.exchange(sends=[(x, r + 1)])
        link.exchange(recvs=[(x, r + 1)])
        return
    if r < 2 * e:
        buf = torch.empty_like(x)
        link.exchange(recvs=[(buf, r - 1)])
        reduce_(x, buf, op)
    vr = r // 2 if r < 2 * e else r - e

    def real(v):
        return 2 * v + 1 if v < e else v + e

    lo, hi, ranges, d = 0, m, [], p // 2
    buf = torch.empty((m + 1) // 2, dtype=x.dtype, device=x.device)
    while d >= 1:                                       # recursive halving
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if vr & d == 0 else ((mid, hi), (lo, mid))
        k = keep[1] - keep[0]
        link.exchange([(x[give[0]:give[1]], real(vr ^ d))], [(buf[:k], real(vr ^ d))])
        reduce_(x[keep[0]:keep[1]], buf[:k], op)
        ranges.append((lo, hi, mid))
        lo, hi = keep
        d //= 2
    d = 1
    while ranges:                                       # recursive doubling
        plo, phi, mid = ranges.pop()
        other = (mid, phi) if vr & d == 0 else (plo, mid)
        link.exchange([(x[lo:hi], real(vr ^ d))], [(x[other[0]:other[1]], real(vr ^ d))])
        lo, hi = plo, phi
        d *= 2
    if r < 2 * e:
        link.exchange(sends=[(x, r - 1)])


# -- broadcast -----------------------------------------------------------------------------------
def binomial_broadcast_(link: Link, x: torch.Tensor, src: int = 0):
    """Round k: every rank that has the data (virtual rank v < 2^k, v = r - src mod N) sends it
    to v + 2^k. ceil(log2 N) rounds."""
    n = link.size
    v = (link.rank - src) % n
    mask = 1
    while mask < n:
        if v & mask:
            link.exchange(recvs=[(x, (v - mask + src) % n)])
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            link.exchange(sends=[(x, (v + mask + src) % n)])
        mask >>= 1


def chain_broadcast_(link: Link, x: torch.Tensor, src: int = 0):
    """src -> src+1 -> ... -> src-1, piece by piece, so that all links stream at once."""
    n = link.size
    v = (link.rank - src) % n
    for a, b in _pieces(x.numel(), x.element_size()):
        if v > 0:
            link.exchange(recvs=[(x[a:b], (link.rank - 1) % n)])
        if v < n - 1:
            link.exchange(sends=[(x[a:b], (link.rank + 1) % n)], defer_sends=True)
    link.flush()


# -- all-to-all ----------------------------------------------------------------------------------
def pairwise_all_to_all(link: Link, x: torch.Tensor, out: torch.Tensor,
                        in_splits: list[int], out_splits: list[int]):
    """Rows ``in_splits[t]`` of ``x`` go to rank t; ``out`` receives ``out_splits[s]`` rows from s.
    N-1 steps; in step s rank r sends to r+s and receives from r-s (each pair meets once)."""
    n, r = link.size, link.rank
    ins = [0]
    outs = [0]
    for a in in_splits:
        ins.append(ins[-1] + a)
    for a in out_splits:
        outs.append(outs[-1] + a)
    out[outs[r]:outs[r + 1]].copy_(x[ins[r]:ins[r + 1]])
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        link.exchange([(x[ins[dst]:ins[dst + 1]], dst)], [(out[outs[src]:outs[src + 1]], src)])


def select(op: str, algorithm: str, nbytes: int) -> str:
    """The algorithm that runs ``op`` when ``algorithm`` is asked for (see docs/collectives.md).

    all_reduce: ring | tree | rhd as asked; auto -> tree up to AUTO_CROSSOVER_BYTES, else ring.
    all_gather / reduce_scatter: ring for every own choice. all_to_all: pairwise.
    broadcast: ring -> chain; tree, rhd, auto -> binomial."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; parallel.comm_algorithm "
                         f"must be one of {', '.join(ALGORITHMS)}")
    if algorithm == "backend":
        return "backend"
    small = nbytes <= AUTO_CROSSOVER_BYTES
    if op == "all_reduce":
        return ("tree" if small else "ring") if algorithm == "auto" else algorithm
    if op == "broadcast":  # auto: binomial at every size (the chain lost at 4 MiB here too)
        return "chain" if algorithm == "ring" else "binomial"
    if op == "all_to_all":
        return "pairwise"
    return "ring"


ALL_REDUCE = {"ring": ring_all_reduce_, "tree": tree_all_reduce_, "rhd": rhd_all_reduce_}
BROADCAST = {"binomial": binomial_broadcast_, "chain": chain_broadcast_}
