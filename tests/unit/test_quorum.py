"""The replica quorum protocol's deadlines (shardlab/distributed/quorum.py; docs/faults.md,
"Live recovery"): no rank waits for the lighthouse without a deadline.

* finished replicas waiting for a replacement that has not asked are answered "ask again"
  after ``JOIN_WAIT * timeout_s``, not held;
* the job's first start answers the same way while a replica is still starting;
* a rank whose lighthouse is gone fails with ``QuorumTimeout`` within its stated wait;
* an active replica that stops asking and voting is reported ``silent``.
"""
import json
import time

import pytest
import torch.distributed as dist

from shardlab.distributed import quorum


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _ask(store, r, n, step, last, gen=0):
    store.set(f"req/{r}", json.dumps({"n": n, "gen": gen, "step": step, "last": last}))


def _both_asked(step=0, last=5):
    """A lighthouse of 2 replicas (1 s timeout, a controllable clock) after both asked, at
    ``step`` of ``last``."""
    store, clock = dist.HashStore(), Clock()
    lh = quorum.Lighthouse(store, 2, 1, 1.0, clock=clock)
    for r in (0, 1):
        _ask(store, r, 1, step, last)
    lh.poll()
    return store, clock, lh


def test_finished_replicas_waiting_for_a_replacement_are_told_to_ask_again():
    store, clock, lh = _both_asked()
    first = json.loads(store.get("resp/0/0/1"))
    assert first["members"] == [0, 1] and not first.get("retry")
    lh.mark_dead(1, "test")
    lh.spawned(1, 1)  # a replacement that never asks
    _ask(store, 0, 2, 5, 5)  # replica 0 has finished
    lh.poll()
    assert not store.check(["resp/0/0/2"])  # held while the replacement may still come
    clock.t += quorum.JOIN_WAIT * 1.0 + 0.01
    lh.poll()
    assert json.loads(store.get("resp/0/0/2")) == {"retry": True} and not lh.done
    _ask(store, 0, 3, 5, 5)  # asks again; the replacement asks at step 0: healed, then trains
    _ask(store, 1, 1, 0, 5, gen=1)
    lh.poll()
    q = json.loads(store.get("resp/1/1/1"))
    assert q["members"] == [0, 1] and q["heal"] == {"1": 0} and not q["done"]


def test_a_replacement_never_trains_alone_behind_a_live_replica():
    """A slow survivor at step 7 has not asked yet: the replacement (step 0) is not given a quorum
    of its own (it would train from its start); it is told to ask again, then healed."""
    store, clock = dist.HashStore(), Clock()
    lh = quorum.Lighthouse(store, 2, 1, 1.0, clock=clock)
    for r in (0, 1):
        _ask(store, r, 1, 7, 20)
    lh.poll()
    lh.mark_dead(1, "test")
    lh.spawned(1, 1)
    _ask(store, 1, 1, 0, 20, gen=1)
    lh.poll()
    clock.t += quorum.JOIN_WAIT * 1.0 + 0.01
    lh.poll()
    assert json.loads(store.get("resp/1/1/1")) == {"retry": True}
    _ask(store, 1, 2, 0, 20, gen=1)
    _ask(store, 0, 2, 7, 20)
    lh.poll()
    assert json.loads(store.get("resp/1/1/2"))["heal"] == {"1": 0}


def test_first_start_answers_ask_again_while_a_replica_is_still_starting():
    store, clock = dist.HashStore(), Clock()
    lh = quorum.Lighthouse(store, 2, 1, 2.0, clock=clock)
    _ask(store, 0, 1, 0, 5)
    lh.poll()
    clock.t += quorum.JOIN_WAIT * 2.0 - 0.1
    lh.poll()
    assert not store.check(["resp/0/0/1"])
    clock.t += 0.2
    lh.poll()
    assert json.loads(store.get("resp/0/0/1")) == {"retry": True}


def test_a_rank_whose_lighthouse_is_gone_fails_within_its_wait(monkeypatch):
    monkeypatch.setattr(quorum, "SLACK_S", 0.5)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    member = quorum.Member(master.port, 0, 0, 0, 1, timeout_s=0.1)
    try:
        t0 = time.monotonic()
        with pytest.raises(quorum.QuorumTimeout, match="no answer from the lighthouse on a quorum within 1.3 s"):
            member.quorum(0, 5)  # nobody answers
        assert time.monotonic() - t0 < 5
        member.timeout_s = 0.01  # a decision's wait is DECISION_WAIT timeouts: about 1.6 s here, not 11
        t0 = time.monotonic()
        with pytest.raises(quorum.QuorumTimeout, match="decision on step"):
            member.vote({"id": 1}, "step", True)
        assert time.monotonic() - t0 < 5
    finally:
        member.close()


def test_an_active_replica_that_stops_asking_is_silent():
    store, clock, lh = _both_asked()
    clock.t += lh.silent_s - 1
    _ask(store, 0, 2, 1, 5)
    lh.poll()
    assert lh.silent() == []
    clock.t += 2
    assert lh.silent() == [1]


def test_every_holder_of_the_state_gone_is_an_error_not_a_silent_restart():
    store, clock, lh = _both_asked(7, 20)
    for r in (0, 1):
        lh.mark_dead(r, "test")
        lh.spawned(r, 1)
        _ask(store, r, 1, 0, 20, gen=1)
    lh.poll()
    assert "every replica holding step 7 failed at once" in lh.lost and not store.check(["resp/0/1/1"])
