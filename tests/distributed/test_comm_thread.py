"""The communication thread of the shared-memory transport (``parallel.comm_thread``,
distributed/shm_thread.py): queued asynchronous collectives give the independently computed
results, in order with the comm's other calls; a failure reaches ``wait()``; DDP and ZeRO-2/3
training with it equal one process (float64)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab.analysis.verify import plain_run
from shardlab.distributed.ledger import Ledger
from shardlab.distributed.shm import X86, SharedComm
from shardlab.launch import run

from tests.distributed.test_data_parallel import batches, make_cfg

pytestmark = pytest.mark.skipif(not X86, reason="the shared-memory barrier needs x86-64")


def _data(seed: int, n: int) -> torch.Tensor:
    from tests.distributed.test_shared_comm import _data as shaped
    return shaped(seed, (n,), torch.float64)


def _inputs(n: int) -> tuple:
    """Every rank's inputs of the queued all-reduce, all-gather, reduce-scatter and blocking all-reduce."""
    return ([_data(10 + s, 1000) for s in range(n)], [_data(20 + s, 300) for s in range(n)],
            [_data(30 + s, 40 * n) for s in range(n)], [_data(40 + s, 77) for s in range(n)])


def _comm(ctx, name="t"):
    return SharedComm(name, dist.group.WORLD, list(range(ctx.world_size)), ctx.rank, Ledger(), comm_thread=True)


def _order_worker(ctx):
    n, r = ctx.world_size, ctx.rank
    sh = _comm(ctx)
    first = sh.all_reduce_async(_data(r, 64))  # no arena yet: runs on this thread, as before
    assert sh._comm_thread is None and first.work is None
    sh.all_reduce(torch.ones(4096, dtype=torch.float64))  # sets the arena up
    a, b, c, d = _inputs(n)
    pa = sh.all_reduce_async(a[r].clone())
    out = torch.empty(300 * n, dtype=torch.float64)
    pb = sh.all_gather_async(b[r], out=out)
    pc = sh.reduce_scatter_async(c[r].clone())
    pa2 = sh.all_reduce_async(a[r] * 3, op="avg")  # queued behind the others; avg divides at wait()
    got_d = sh.all_reduce(d[r].clone())  # blocking: after the queued calls, on this thread
    queued = sh._comm_thread.ran
    res = dict(a=pa.wait(), b=pb.wait(), c=pc.wait(), a2=pa2.wait(), d=got_d, queued=queued)
    peer = (r + 1) % n  # point-to-point after queued calls: held first
    pe = sh.all_reduce_async(a[r].clone())
    buf = torch.empty(5, dtype=torch.float64)
    for w in sh.exchange([(_data(50 + r, 5), peer)], [(buf, (r - 1) % n)]):
        w.wait()
    res.update(e=pe.wait(), p2p=buf, after_p2p=sh.all_reduce_async(d[r].clone()).work is None)
    return res


def test_queued_collectives_equal_independent_results():
    n = 2
    out = run(_order_worker, n, timeout_s=120)
    a, b, c, d = _inputs(n)
    for r, got in enumerate(out):
        # the blocking call waited for all four queued ones before it ran
        assert got["queued"] == 4, got["queued"]
        torch.testing.assert_close(got["a"], a[0] + a[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["b"], torch.cat(b), rtol=0, atol=0)
        torch.testing.assert_close(got["c"], (c[0] + c[1]).chunk(n)[r], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["a2"], (a[0] * 3 + a[1] * 3) / n, rtol=0, atol=1e-12)
        torch.testing.assert_close(got["d"], d[0] + d[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["e"], a[0] + a[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["p2p"], _data(50 + (r - 1) % n, 5), rtol=0, atol=0)
        assert got["after_p2p"], "a comm with point-to-point rings open must not queue (their counts ride its barrier)"


def _failure_worker(ctx):
    sh = _comm(ctx)
    sh.timeout_s = 20.0
    sh.all_reduce(torch.ones(4096, dtype=torch.float64))
    bad = sh.all_reduce_async(torch.ones(8 + 8 * ctx.rank, dtype=torch.float64))  # sizes differ
    msgs = []
    for call in (bad.wait, lambda: sh.all_reduce(torch.ones(3, dtype=torch.float64))):
        try:
            call()
            msgs.append(None)
        except RuntimeError as e:
            msgs.append(str(e))
    return msgs


def test_a_failed_queued_collective_raises_at_wait_and_after():
    for wait_msg, next_msg in run(_failure_worker, 2, timeout_s=120):
        assert wait_msg and "all_reduce" in wait_msg, wait_msg
        assert next_msg and "an earlier asynchronous collective failed" in next_msg, next_msg


LAYOUTS = [dict(zero_stage=0, bucket_cap_mb=0.001), dict(zero_stage=2), dict(zero_stage=3)]


def _train_worker(ctx, cfgs):
    from tests.distributed.test_shared_comm import _train
    return [_train(ctx, cfg, "shared", comm_thread=True) for cfg in cfgs]


def test_training_with_the_comm_thread_matches_one_process():
    cfgs = [make_cfg(2, **layout) for layout in LAYOUTS]
    out = run(_train_worker, 2, cfgs, timeout_s=240)
    for cfg, layout, (losses, _, ran) in zip(cfgs, LAYOUTS, out[0]):
        assert ran > 0, f"{layout}: no collective ran on the comm thread"
        ref = plain_run(cfg, batches(cfg))[0]
        assert len(losses) == len(ref) and max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-10, (layout, losses, ref)


def _gpu_worker(ctx):
    from tests.distributed.test_shared_comm import _check_gpu_streams
    errors = []
    sh = SharedComm("t", dist.group.WORLD, list(range(ctx.world_size)), ctx.rank, Ledger(), device=ctx.device,
                    comm_thread=True)
    sh.all_reduce(torch.ones(4096, device=ctx.device))  # the arena and the peers' events
    _check_gpu_streams(sh, ctx.device, errors)  # the same checks as without the thread
    if sh._comm_thread is None or sh._comm_thread.ran < 4:
        errors.append(f"cuda: the asynchronous collectives did not run on the comm thread: {sh._comm_thread}")
    return errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_comm_thread_on_one_gpu():
    """On CUDA the queued collectives wait for the caller's stream as it was at the call, run on
    the comm stream from the thread, and the caller's stream waits for them at ``wait()``."""
    errors = run(_gpu_worker, 2, device="cuda", timeout_s=120)
    assert errors == [[], []], errors


def test_queued_call_on_cuda_orders_streams_by_events(monkeypatch):
    """The CUDA branch of a queued call, with torch.cuda's streams and events replaced by
    recorders (the same branch runs on a GPU in ``test_comm_thread_on_one_gpu``): the comm stream
    waits for an event recorded on the caller's stream at the call, the collective runs on the
    comm stream from the thread, and ``wait()`` makes the caller's stream wait for the event
    recorded after it; a fresh result is marked as used on the caller's stream."""
    import threading
    from types import SimpleNamespace

    from shardlab.distributed import shm_thread

    log, local = [], threading.local()

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.id))

    class Event:
        count = 0

        def __init__(self, *a, **k):
            Event.count += 1
            self.id = Event.count

        def record(self, stream):
            log.append(("record", stream.name, self.id))

    class On:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.old, local.cur = getattr(local, "cur", None), self.s

        def __exit__(self, *a):
            local.cur = self.old

    caller = Stream("caller")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", On)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: getattr(local, "cur", None) or caller)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(("mark", s.name, t.numel())),
                        raising=False)
    order = SimpleNamespace(stream=Stream("comm"), active=False, peers=[None, []])
    comm = SimpleNamespace(_order=order, _comm_thread=None, device=torch.device("cuda", 0), name="t")
    comm._hold = lambda: None
    comm._queueable = lambda kind, t: True
    seen = []

    def run():
        seen.append((torch.cuda.current_stream().name, order.active, threading.current_thread().name))
        return torch.zeros(3)
    given = torch.ones(5)
    pending = shm_thread.ThreadedAsync._issue(comm, "all_reduce", run, given, (given,))
    res = pending.wait()
    ready, done = 1, 2  # the events, in the order they were made
    assert log[:2] == [("record", "caller", ready), ("mark", "comm", 5)], log
    assert log[2:4] == [("wait", "comm", ready), ("record", "comm", done)], log
    assert log[4:] == [("wait", "caller", done), ("mark", "caller", 3)], log
    assert seen == [("comm", True, "shardlab-comm-t")] and not order.active, seen
    assert res.numel() == 3 and comm._comm_thread.ran == 1
