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


def _lanes_worker(ctx):
    from shardlab.distributed.autograd import sum_over_ranks
    from shardlab.distributed.lanes import Lanes
    n, r = ctx.world_size, ctx.rank
    out = []
    for cls in (Comm, SharedComm):
        comm = cls("world", dist.group.WORLD, list(range(n)), r, Ledger())
        xs = [torch.full((3,), 10.0 * r + lane, dtype=torch.float64, requires_grad=True) for lane in (0, 1)]

        def lane(i):
            y = sum_over_ranks(xs[i] * (i + 1), comm)     # sum_s (10 s + i) (i + 1)
            (y * y).sum().backward()                      # d/dx_r = (i + 1) * sum_s 2 y_s = (i + 1) 2 n y
            return y.detach()
        lanes = Lanes()
        ys = lanes.run(lambda: lane(0), lambda: lane(1))
        want = [torch.full((3,), sum(10.0 * s + i for s in range(n)) * (i + 1), dtype=torch.float64) for i in (0, 1)]
        grads_ok = all(torch.allclose(xs[i].grad, (i + 1) * 2 * n * want[i]) for i in (0, 1))
        out.append((cls.__name__, all(torch.equal(y, w) for y, w in zip(ys, want)), grads_ok, lanes.switches))
    return out


def test_sum_over_ranks_in_lanes_passes_the_baton():
    """The routing statistics' all-reduce inside lanes (lanes.reduce): started, the other lane runs,
    then waited for; forward and backward equal the sums over every rank's values."""
    for rank_out in run(_lanes_worker, 3, timeout_s=120):
        for name, values, grads, switches in rank_out:
            assert values and grads, name
            assert switches >= 2, (name, switches)  # each lane gave way at its forward all-reduce
