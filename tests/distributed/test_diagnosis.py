"""Hang and desync diagnosis (docs/faults.md, Hangs and desyncs): seeded communication bugs on 2
ranks, each run through ``launch.run`` with a 3 s collective timeout, on the process group (gloo)
and on the shared-memory transport.

* without check mode every run fails within the timeout and the launcher's flight-recorder
  report names the rank and the operation (the bugs where gloo silently computes something are
  the check-mode cases below);
* with ``check_collectives`` the mismatches raise CollectiveMismatch at once, one line naming
  both sides, long before the timeout;
* on the shared-memory transport the mismatches a barrier can see (another collective, size,
  dtype, reduce op, a send its receiver never asked for) raise at once even without check mode.

The runs are independent, so they go through a thread pool (each waits mostly on a timeout)."""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shardlab import launch
from shardlab.distributed import flight
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology

TIMEOUT = 3.0


def _mesh(check, transport):
    return Mesh.build(Topology(tp=2), "cpu", check_collectives=check, transport=transport)


def _bug(ctx, name, check, transport="process_group"):
    mesh = _mesh(check, transport)
    tp, r = mesh.comm("tp"), ctx.rank
    x = torch.ones(4)
    t0 = time.perf_counter()
    try:
        tp.all_reduce(torch.ones(2))  # one good collective first: seq 1
        if name == "skip":
            if r == 0:
                tp.all_reduce(x)
        elif name == "shapes":
            tp.all_reduce(torch.ones(4 if r == 0 else 8))
        elif name == "order":
            if r == 0:
                tp.all_reduce(x), tp.all_gather(x)
            else:
                tp.all_gather(x), tp.all_reduce(x)
        elif name == "dtypes":
            tp.all_reduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64))
        elif name == "send_no_recv":
            if r == 0:
                tp.isend(x, 1).wait()
            tp.all_gather(x)   # the send stays unmatched: its data desynchronises what follows
            tp.barrier()
        elif name == "recv_no_send":
            if r == 1:
                tp.irecv(torch.empty(4), 0).wait()
        elif name == "barrier":
            if r == 0:
                tp.barrier()
        elif name == "wrong_group":
            mesh.comm("tp" if r == 0 else "dp").all_reduce(x)
            tp.barrier()
        elif name == "reduce_op":
            tp.all_reduce(x, op="sum" if r == 0 else "max")
        elif name == "extra":
            tp.all_reduce(x)
            if r == 0:
                tp.all_reduce(x)
        elif name == "grow":  # rank 1's message needs a bigger arena: compared before it grows
            tp.all_reduce(torch.ones(4 if r == 0 else 100_000))
        elif name == "same_bytes":  # equal byte counts, different shapes
            tp.all_gather(torch.ones((4, 2) if r == 0 else (8,)))
        elif name == "a2a_splits":
            t = torch.ones(4, 3)
            tp.all_to_all(t, [1, 3] if r == 0 else [2, 2], [1, 2] if r == 0 else [2, 2])
        elif name == "p2p_shapes":
            if r == 0:
                tp.isend(torch.ones(4), 1).wait()
            else:
                tp.irecv(torch.empty(6), 0).wait()
        else:
            raise ValueError(name)
    except flight.CollectiveMismatch as e:
        if check:
            return "caught", str(e), time.perf_counter() - t0
        raise
    return "ran", [o[2] for o in mesh.flight.entries], time.perf_counter() - t0


def _run(name, check, transport="process_group"):
    t0 = time.perf_counter()
    try:
        out = launch.run(_bug, 2, name, check, transport, timeout_s=TIMEOUT)
    except launch.WorkerError as e:
        return "error", str(e), time.perf_counter() - t0
    return "ok", out, time.perf_counter() - t0


# name -> what the launcher's report must say (no check mode)
HANGS = {
    "skip": ["rank(s) [1] missing from all_reduce seq 2"],
    "order": ["ranks disagree at seq 2: rank 0 all_reduce(float32[4], sum)", "rank 1 all_gather(float32[4])"],
    "send_no_recv": ["rank 1 is missing recv #1 from rank 0"],
    "recv_no_send": ["rank 0 is missing send #1 to rank 1", "rank 1: last op tp recv(float32[4]) from rank 0"],
    "barrier": ["rank(s) [1] missing from barrier seq 2"],
    "wrong_group": ["ranks disagree at seq 2: rank 0 all_reduce(float32[4], sum)", "rank 1 barrier()"],
    "extra": ["rank(s) [1] missing from all_reduce seq 3"],
}
# name -> (one-line check-mode message parts)
MISMATCHES = {
    "shapes": "rank 1 all_reduce(float32[8], sum) seq 2 at test_diagnosis.py",
    "order": "rank 1 all_gather(float32[4]) seq 2",
    "dtypes": "rank 1 all_reduce(float64[4], sum) seq 2",
    "reduce_op": "rank 1 all_reduce(float32[4], max) seq 2",
    "a2a_splits": "rank 0 all_to_all(float32[4, 3]",
    "p2p_shapes": "rank 1 recv(float32[6]) #1 from rank 0",
}

# The shared-memory transport (the default for CPU ranks on one x86-64 host) without check mode:
# its barriers compare what each rank is in, so these raise at once, one line naming both sides
SHARED_MISMATCHES = {
    "order": "group rank 0 in all_reduce(float32, 16 bytes, sum), group rank 1 in all_gather(float32, 16 bytes)",
    "shapes": "group rank 0 in all_reduce(float32, 16 bytes, sum), group rank 1 in all_reduce(float32, 32 bytes, sum)",
    "dtypes": "group rank 0 in all_reduce(float32, 16 bytes, sum), group rank 1 in all_reduce(float64, 32 bytes, sum)",
    "reduce_op": "group rank 0 in all_reduce(float32, 16 bytes, sum), group rank 1 in all_reduce(float32, 16 bytes, max)",
    "grow": "group rank 0 in all_reduce(float32, 16 bytes, sum), group rank 1 in all_reduce(float32, 400000 bytes, sum)",
    "same_bytes": "group rank 0 in all_gather(float32, 32 bytes, 2-d shape #",
    "wrong_group": "group rank 0 in all_reduce(float32, 16 bytes, sum), group rank 1 in barrier()",  # the counter barrier
}


@pytest.fixture(scope="module")
def runs():
    jobs = list(dict.fromkeys([(n, False, tr) for n in HANGS for tr in ("process_group", "shared")]
                              + [(n, True, tr) for n in MISMATCHES for tr in ("process_group", "shared")]
                              + [(n, False, "shared") for n in SHARED_MISMATCHES]))
    with ThreadPoolExecutor(8) as pool:
        res = list(pool.map(lambda j: _run(*j), jobs))
    return dict(zip(jobs, res))


@pytest.mark.parametrize("transport", ["process_group", "shared"])
@pytest.mark.parametrize("name", list(HANGS))
def test_hang_is_diagnosed(runs, name, transport):
    status, text, elapsed = runs[(name, False, transport)]
    if transport == "shared" and name == "send_no_recv":  # the all_gather's barrier names it at once
        assert status == "error", text
        assert ("tp: group rank 0 sent 1 message(s) to group rank 1 that it did not receive before its "
                "all_gather(float32, 16 bytes) (send #1 of 16 bytes from 0 to 1 is unmatched") in text, text
        assert "did not arrive" not in text and "no progress" not in text, text
        return
    assert status == "error", (name, text)
    assert "communication at the failure (flight recorder)" in text and "full dumps: " in text, text
    for part in HANGS[name]:
        assert part in text, (part, text)
    assert elapsed < 75, elapsed  # 14 ranks spawned at once on 2 cores


@pytest.mark.parametrize("transport", ["process_group", "shared"])
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_check_mode_catches_mismatch_at_once(runs, name, transport):
    status, out, elapsed = runs[(name, True, transport)]
    assert status == "ok", out
    caught = [o for o in out if o[0] == "caught"]
    assert caught, out
    for _, msg, dt in caught:
        assert "\n" not in msg and "mismatch" in msg, msg
        assert MISMATCHES[name] in msg, msg
        assert dt < TIMEOUT / 4, dt


@pytest.mark.parametrize("name", list(SHARED_MISMATCHES))
def test_shared_transport_names_a_mismatch_at_once(runs, name):
    status, text, elapsed = runs[(name, False, "shared")]
    assert status == "error", text
    assert f"tp: shared-memory collective mismatch: {SHARED_MISMATCHES[name]}" in text, text
    assert "did not arrive" not in text and "timed out" not in text.lower(), text  # not the timeout


def _subgroup_hang(ctx):
    """tp 2 x dp 2 on gloo: the tp groups are subgroups of the world, created by the Mesh."""
    from shardlab.distributed.shm_host import collective_timeout
    mesh = Mesh.build(Topology(tp=2, dp_replicate=2), "cpu", transport="process_group")
    tp = mesh.comm("tp")
    assert collective_timeout(mesh.group("tp")).total_seconds() == TIMEOUT  # torch's own default: 1800
    tp.all_reduce(torch.ones(2))
    if ctx.rank == 0:
        tp.all_reduce(torch.ones(4))
    else:
        tp.barrier()


def test_hang_inside_a_subgroup_is_reported_at_the_timeout():
    """A hang in a group smaller than the world (the tp group of tp 2 x dp 2): torch gives a new
    group its backend's default timeout (30 minutes for gloo), so this run once waited 30 minutes;
    the Mesh's groups take the launcher's collective timeout (mesh.subgroup)."""
    t0 = time.perf_counter()
    with pytest.raises(launch.WorkerError) as info:
        launch.run(_subgroup_hang, 4, timeout_s=TIMEOUT)
    text = str(info.value)
    assert "group tp: ranks disagree at seq 2: rank 0 all_reduce(float32[4], sum)" in text, text
    assert "rank 1 barrier()" in text and "full dumps: " in text, text
    assert time.perf_counter() - t0 < 75


def _pipeline_recv_hang(ctx):
    """pp 2 x dp 2 on gloo: each pp group's second rank waits for a send that never comes."""
    mesh = Mesh.build(Topology(pp=2, dp_replicate=2), "cpu", transport="process_group")
    pp = mesh.comm("pp")
    pp.barrier()
    if mesh.members["pp"].index(ctx.rank) == 1:
        pp.irecv(torch.empty(4), 0).wait()
    else:
        time.sleep(300)  # alive, never sending: only the receive's timeout ends the run


def test_pipeline_receive_hang_in_a_subgroup_is_reported_at_the_timeout():
    """A point-to-point hang inside the pp groups (subgroups of the world): gloo's receive waits
    under the timeout its group was created with (30 minutes before mesh.subgroup)."""
    t0 = time.perf_counter()
    with pytest.raises(launch.WorkerError) as info:
        launch.run(_pipeline_recv_hang, 4, timeout_s=TIMEOUT)
    text = str(info.value)
    assert "Timed out waiting 3000ms for recv" in text, text  # the group's timeout, not 30 minutes
    assert "rank 2: last op pp recv(float32[4]) from rank 0 seq 1" in text, text
    assert "rank 3: last op pp recv(float32[4]) from rank 1 seq 1" in text, text
    assert time.perf_counter() - t0 < 75


def test_report_of_dumps(tmp_path):
    """diagnose() on hand-made dumps: a rank behind in a group, a disagreement, a lost message."""
    def op(seq, g, o, t, done=True, **kw):
        return dict(seq=seq, group=g, members=[0, 1], op=o, tensors=t, site="x.py:1 in f", time=0, done=done, **kw)
    dumps = {
        0: {"rank": 0, "groups": {"tp": [0, 1]}, "seq": {"tp": 2, "tp:0->1": 1},
            "ops": [op(1, "tp", "all_reduce", ["float32[2]"]), op(1, "tp", "send", ["float32[4]"], peer=1),
                    op(2, "tp", "all_reduce", ["float32[4]"], done=False)]},
        1: {"rank": 1, "groups": {"tp": [0, 1]}, "seq": {"tp": 1}, "ops": [op(1, "tp", "all_reduce", ["float32[2]"])]},
    }
    lines = "\n".join(flight.diagnose(dumps, 2))
    assert "rank 0: last op tp all_reduce(float32[4]) seq 2 at x.py:1 in f (did not return)" in lines
    assert "rank(s) [1] missing from all_reduce seq 2" in lines
    assert "rank 1 is missing recv #1 from rank 0" in lines
