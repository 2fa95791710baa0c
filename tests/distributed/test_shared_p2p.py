"""Point-to-point on the shared-memory transport (shardlab/distributed/shm_p2p.py) at N = 3, CPU:
messages of many sizes and dtypes arrive in issue order and equal the sender's data (generated
independently from the sender's rank and the message index); messages far longer than a ring
stream through it, also when two ranks send each other such messages before either waits; a
receive of the wrong size fails naming both sizes; a non-contiguous group (ranks 0 and 2) uses
group-relative peers; the ledger records what the process group's Comm records.

Workers return their failures as strings."""
import torch
import torch.distributed as dist

from shardlab.distributed.collectives import Comm
from shardlab.distributed.ledger import Ledger
from shardlab.distributed.shm import SharedComm
from shardlab.launch import run

CAP = 4096  # small rings: most messages below stream through several times
SIZES = [(0, torch.float64), (1, torch.float64), (1000, torch.float64), (3 * CAP + 5, torch.float32),
         (257, torch.int64), (10 * CAP, torch.float64), (3, torch.bool)]


def _msg(sender: int, i: int) -> torch.Tensor:
    n, dtype = SIZES[i % len(SIZES)]
    g = torch.Generator().manual_seed(1000 * sender + i)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-10**9, 10**9, (n,), generator=g)


def _ring_checks(sh, errors, tag):
    """Each rank sends 2 x len(SIZES) messages to the next rank and receives as many from the
    previous one: all receives posted first, then the sends, then the waits."""
    n, r = sh.size, sh.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    count = 2 * len(SIZES)
    bufs = [torch.empty_like(_msg(prv, i)) for i in range(count)]
    recvs = [sh.irecv(b, prv) for b in bufs]
    sends = [sh.isend(_msg(r, i), nxt) for i in range(count)]
    for w in recvs + sends:
        w.wait()
    for i, b in enumerate(bufs):
        if not torch.equal(b, _msg(prv, i)):
            errors.append(f"{tag}: message {i} from group rank {prv} differs")


def _crossing_checks(sh, errors, tag):
    """Every rank sends 10 rings' worth to both neighbours and receives as much from both, all
    through ``exchange`` before waiting: each must drain its receives while its sends are stuck."""
    n, r = sh.size, sh.rank
    peers = sorted({(r + 1) % n, (r - 1) % n})
    out = {p: torch.full((10 * CAP // 8,), float(100 * r + p), dtype=torch.float64) for p in peers}
    inc = {p: torch.empty(10 * CAP // 8, dtype=torch.float64) for p in peers}
    works = sh.exchange([(out[p], p) for p in peers], [(inc[p], p) for p in peers])
    for w in works:
        w.wait()
    for p in peers:
        if not torch.equal(inc[p], torch.full_like(inc[p], float(100 * p + r))):
            errors.append(f"{tag}: exchange from group rank {p} differs")


def _ledger_checks(group, ranks, rank, errors):
    led = {"shared": Ledger(), "pg": Ledger()}
    comms = {"shared": SharedComm("g", group, ranks, rank, led["shared"], p2p_cap=CAP),
             "pg": Comm("g", group, ranks, rank, led["pg"])}
    n, me = len(ranks), ranks.index(rank)
    for c in comms.values():
        buf = torch.empty(300, dtype=torch.float32)
        works = [c.irecv(buf, (me - 1) % n), c.isend(torch.ones(300), (me + 1) % n)]
        works += c.exchange([(torch.ones(7, dtype=torch.int64), (me + 1) % n)],
                            [(torch.empty(7, dtype=torch.int64), (me - 1) % n)])
        for w in works:
            w.wait()
    a, b = ({k: (e.calls, e.bytes_sent, e.bytes_recv) for k, e in led[x].entries.items()} for x in ("shared", "pg"))
    if a != b:
        errors.append(f"ledger differs: shared {a} vs process group {b}")


def _worker(ctx):
    errors = []
    pair = dist.new_group([0, 2])  # non-contiguous: group-relative peers
    for group, ranks in ((dist.group.WORLD, list(range(ctx.world_size))), (pair, [0, 2])):
        if ctx.rank not in ranks:
            continue
        sh = SharedComm("g", group, ranks, ctx.rank, Ledger(), p2p_cap=CAP)
        tag = f"ranks {ranks}"
        _ring_checks(sh, errors, tag)
        _crossing_checks(sh, errors, tag)
        _ring_checks(sh, errors, tag + " again")  # rings reused after wrapping
        if sh._channels is None or sh._channels.setup:
            errors.append(f"{tag}: the rings were not set up")
        _ledger_checks(group, ranks, ctx.rank, errors)
    # a receive of the wrong size: the receiver fails naming both sizes (a fresh comm)
    sh = SharedComm("mismatch", dist.group.WORLD, list(range(ctx.world_size)), ctx.rank, Ledger(), p2p_cap=CAP)
    if ctx.rank == 0:
        sh.isend(torch.ones(8, dtype=torch.float64), 1).wait()
    elif ctx.rank == 1:
        try:
            sh.irecv(torch.empty(4, dtype=torch.float64), 0).wait()
            errors.append("a receive of 32 bytes took a 64-byte message")
        except RuntimeError as e:
            if "64 bytes" not in str(e) or "expects 32" not in str(e):
                errors.append(f"mismatch error does not name both sizes: {e}")
    dist.barrier()
    return errors


def test_shared_point_to_point_equals_sent_data():
    errors = run(_worker, 3, timeout_s=120)
    assert errors == [[], [], []]
