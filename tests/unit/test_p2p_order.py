"""Point-to-point messages are matched by issue order, never by tag (NCCL ignores tags).

The pipeline relies on every schedule issuing, per (sender, receiver) pair, its receives in the
order of the sends: checked here for every schedule over a grid of sizes, and a schedule that
breaks it is refused with the reason. The Comm p2p API has no tag at all."""
import inspect
from itertools import product

import pytest

from shardlab.distributed.collectives import Comm
from shardlab.parallel.pipeline.schedule import SCHEDULES, Action, ScheduleError, build
from shardlab.parallel.pipeline.stage import check_p2p_order


def _schedules():
    for name, p, m, v in product(SCHEDULES, (2, 3, 4), (1, 2, 3, 4, 6, 8), (1, 2, 3)):
        if v > 1 and name != "interleaved":
            continue
        try:
            yield build(name, p, m, v)
        except ScheduleError:
            continue


def test_every_schedule_receives_in_send_order():
    scheds = list(_schedules())
    assert {s.name for s in scheds} == set(SCHEDULES) and any(s.v == 3 for s in scheds)
    for sched in scheds:
        check_p2p_order(sched)


def _swap_first_two(actions, peer):
    """Swap the first two RECV actions from ``peer`` (and nothing else) in one rank's list."""
    idx = [i for i, a in enumerate(actions) if a.kind.startswith("RECV") and a.peer == peer][:2]
    out = list(actions)
    out[idx[0]], out[idx[1]] = out[idx[1]], out[idx[0]]
    return out


def test_receives_out_of_send_order_are_refused():
    sched = build("1f1b", 2, 4)
    sched.ranks[1] = _swap_first_two(sched.ranks[1], 0)  # RECV_F of mb 1 before mb 0
    with pytest.raises(RuntimeError, match="issue order"):
        check_p2p_order(sched)
    # interleaved: rank 0 sends rank 1 both activations (stage 0 -> 1, 2 -> 3) and gradients
    # (stage 2 -> 1); posting one kind's receive ahead of the other's must be caught too
    sched = build("interleaved", 2, 4, 2)
    kinds = {(a.kind, a.stage) for a in sched.ranks[1] if a.kind.startswith("RECV") and a.peer == 0}
    assert {("RECV_F", 1), ("RECV_F", 3), ("RECV_B", 1)} <= kinds
    recvs = [i for i, a in enumerate(sched.ranks[1]) if a.kind.startswith("RECV") and a.peer == 0]
    first_b = next(i for i in recvs if sched.ranks[1][i].kind == "RECV_B")
    before = recvs[recvs.index(first_b) - 1]
    acts = list(sched.ranks[1])
    acts[before], acts[first_b] = acts[first_b], acts[before]
    sched.ranks[1] = acts
    with pytest.raises(RuntimeError, match="rank 0 sends rank 1"):
        check_p2p_order(sched)


def test_missing_receive_is_refused():
    sched = build("gpipe", 2, 2)
    sched.ranks[1] = [a for a in sched.ranks[1] if a != Action("RECV_F", 1, 1, 0)]
    with pytest.raises(RuntimeError, match="issue order"):
        check_p2p_order(sched)


def test_comm_point_to_point_has_no_tag():
    for fn in (Comm.isend, Comm.irecv, Comm.exchange):
        assert "tag" not in inspect.signature(fn).parameters, fn.__name__
