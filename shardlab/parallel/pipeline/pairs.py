"""DualPipe's F&B pairs: a forward and a backward of two different micro-batches run together,
one's all-to-alls travelling while the other computes (``parallel.pp_overlap``;
docs/expert-parallel.md, "Lanes").

In an action list (schedule.py) a pair reads ``RECV_F F SEND_F RECV_B B [W] SEND_B``; to run F
and B together :func:`pair` moves both receives before and both sends after
(``RECV_F RECV_B F B [W] SEND_F SEND_B``) for every forward whose next compute action is a
backward of another (micro-batch, stage), wherever the simulator (simulate.py) still finds no
deadlock; a rank's receives keep their order, and so do its sends, so issue-order matching holds.
The executor (executor.py) runs F in lane 0 and B with its W in lane 1 (distributed/lanes.py).
"""
from __future__ import annotations

from dataclasses import replace

from .schedule import Schedule
from .simulate import simulate

COMPUTE = ("F", "B", "W")


def is_pair(actions: list, i: int) -> bool:
    """Whether ``actions[i]`` is a forward followed directly by a backward of another
    (micro-batch, stage): the two can run as lanes."""
    if i + 1 >= len(actions):
        return False
    a, b = actions[i], actions[i + 1]
    return a.kind == "F" and b.kind == "B" and (a.mb, a.stage) != (b.mb, b.stage)


def pair(sched: Schedule) -> Schedule:
    """``sched`` with its F&B pairs made adjacent (module doc). Returns a new Schedule."""
    ranks = [list(acts) for acts in sched.ranks]
    for r in range(sched.p):
        i = 0
        while i < len(ranks[r]):
            acts = ranks[r]
            if acts[i].kind != "F":
                i += 1
                continue
            j = next((j for j in range(i + 1, len(acts)) if acts[j].kind in COMPUTE), None)
            if j is None or acts[j].kind != "B" or (acts[j].mb, acts[j].stage) == (acts[i].mb, acts[i].stage):
                i += 1
                continue
            between = acts[i + 1:j]
            recvs = [x for x in between if x.kind.startswith("RECV")]
            moved = acts[:i] + recvs + [acts[i], acts[j]] + [x for x in between if x.kind.startswith("SEND")]
            moved += acts[j + 1:]
            trial = replace(sched, ranks=ranks[:r] + [moved] + ranks[r + 1:])
            if simulate(trial).ok:
                ranks[r] = moved
                i += len(recvs) + 2
            else:
                i += 1
    return replace(sched, ranks=ranks)


def count_pairs(sched: Schedule) -> list[int]:
    """Per rank, how many F&B pairs the executor will run as lanes."""
    return [sum(is_pair(acts, i) for i in range(len(acts))) for acts in sched.ranks]
