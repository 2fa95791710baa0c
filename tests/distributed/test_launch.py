"""Launcher: results in rank order; a rank that raises or is killed stops the job with a clear
error, quickly, never a hang."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from shardlab import launch


def _sum_ranks(ctx, scale):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return (ctx.rank, ctx.world_size, t.item() * scale, torch.get_num_threads())


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank one")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here until it is stopped
    return "unreachable"


def _kill_rank1(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def test_results_in_rank_order():
    out = launch.run(_sum_ranks, 3, 2.0, timeout_s=30)
    assert [o[:3] for o in out] == [(r, 3, 6.0) for r in range(3)]
    assert all(o[3] >= 1 for o in out)


@pytest.mark.parametrize("worker,fragment", [(_raise_on_rank1, "ValueError: boom from rank one"),
                                             (_kill_rank1, "killed by signal 9")])
def test_failing_rank_stops_job(worker, fragment):
    t0 = time.time()
    with pytest.raises(launch.WorkerError) as e:
        launch.run(worker, 2, timeout_s=20)
    assert e.value.rank == 1
    assert fragment in str(e.value)
    assert time.time() - t0 < 20, "the job must stop well within the collective timeout"
