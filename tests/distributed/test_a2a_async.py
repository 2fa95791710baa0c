"""``Comm.all_to_all_async`` (process group, issued without waiting) and SharedComm's (done when
issued on the CPU): the rows each rank receives equal what every sender's chunk for it holds,
uneven splits, and the ledger counts them as the blocking call does."""
import torch
import torch.distributed as dist

from shardlab.distributed.collectives import Comm
from shardlab.distributed.ledger import Ledger
from shardlab.distributed.shm import SharedComm
from shardlab.launch import run


def _rows(i, n):  # rank i's input: chunk j (for rank j) has i + j + 1 rows of 3, valued by (i, j, row)
    parts = [torch.tensor([[100 * i + 10 * j + k] * 3 for k in range(i + j + 1)], dtype=torch.float64)
             for j in range(n)]
    return torch.cat(parts), [i + j + 1 for j in range(n)]


def _worker(ctx):
    n, r = ctx.world_size, ctx.rank
    out = []
    for cls in (Comm, SharedComm):
        ledger = Ledger()
        comm = cls("world", dist.group.WORLD, list(range(n)), r, ledger)
        x, ins = _rows(r, n)
        outs = [i + r + 1 for i in range(n)]
        got = comm.all_to_all_async(x, ins, outs).wait()
        want = torch.cat([_rows(i, n)[0].split(_rows(i, n)[1])[r] for i in range(n)])
        sent = sum(e.bytes_sent for e in ledger.entries.values())
        ledger.reset()
        comm.all_to_all(x, ins, outs)
        out.append((cls.__name__, torch.equal(got, want), sent, sum(e.bytes_sent for e in ledger.entries.values())))
    return out


def test_all_to_all_async_equals_the_senders_chunks():
    for rank_out in run(_worker, 3, timeout_s=120):
        for name, equal, sent_async, sent_sync in rank_out:
            assert equal, name
            assert sent_async == sent_sync > 0, (name, sent_async, sent_sync)
