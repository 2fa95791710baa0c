"""Simulate a schedule's action lists: deadlock or not, per-rank timeline, bubble, memory.

Model (the same rules the executor follows): every rank runs its list in order; a compute
action takes its cost (per full stage F, B, W; a chunk of an interleaved or DualPipeV rank
costs 1/v of it, a DualPipe chunk is a whole stage; an unsplit backward costs B + W); a SEND is posted at once and never blocks; a RECV
blocks until the matching SEND has been posted (plus ``comm`` time). If no rank can advance
and some are unfinished, the program deadlocks, and the reason names the first blocked
receive. Every schedule is simulated (:func:`check`) before the executor runs it.

Shared cores (``cores``, optional): the p ranks time-share ``cores`` processors. A compute
action's cost is then its duration with a core to itself; while k ranks are in a compute
action, each progresses at rate min(1, cores / k) (processor sharing), so an action's span
stretches and, as in a measured timeline, the stretched span counts as busy. Event-driven:
time advances to the next completion or the next receive that comes due. ``sharing="fifo"``
is the other extreme: an action that gets a core runs to completion at full speed; a rank
ready to compute while all cores are busy waits (in order of readiness, then rank), and that
wait is idle, as in a measured timeline, where the action is time-stamped once it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .schedule import Action, Schedule, ScheduleError


@dataclass
class SimResult:
    ok: bool
    reason: str = ""
    timeline: list = field(default_factory=list)
    """``timeline[r]`` = [(Action, start, end)] of the compute actions of rank r."""
    makespan: float = 0.0
    bubble: float = 0.0
    """Idle fraction of all ranks over the step: 1 - sum(busy) / (p * makespan)."""
    peak_inflight: list = field(default_factory=list)
    """Per rank: most micro-batches whose forward ran and whose backward (B) did not."""
    peak_held: list = field(default_factory=list)
    """Per rank: most micro-batches whose forward ran and whose W (or unsplit B) did not."""


def costs(sched: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> dict[str, float]:
    v = 1 if sched.layout == "dual" else sched.v  # dualpipe: each chunk is a whole stage of p
    return {"F": f / v, "B": (b if sched.split_bw else b + w) / v, "W": w / v}


def simulate(sched: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0,
             comm: float = 0.0, stage_costs: dict | None = None, cores: int | None = None,
             sharing: str = "ps") -> SimResult:
    """``stage_costs``: optional {stage: {"F": t, "B": t, "W": t}} durations of one action at
    that stage (e.g. measured), overriding the uniform f, b, w. ``cores``: None = one core per
    rank; else the ranks share that many cores (module docstring) and the timeline, makespan
    and bubble are those of the shared run (memory peaks depend only on the order: unchanged);
    ``sharing``: "ps" (processor sharing) or "fifo" (run to completion), module docstring."""
    p = sched.p
    uniform = costs(sched, f, b, w)
    cost = (lambda a: stage_costs[a.stage][a.kind]) if stage_costs else (lambda a: uniform[a.kind])  # noqa: E731
    pos, clock = [0] * p, [0.0] * p
    posted: dict[tuple, tuple[float, int]] = {}   # message key -> (time, receiver rank)
    received: set = set()
    done: set = set()                              # (kind, mb, stage) computed
    timeline: list[list] = [[] for _ in range(p)]
    inflight, held = [0] * p, [0] * p
    peak_in, peak_held = [0] * p, [0] * p

    def invalid(r, a, why):
        return SimResult(False, f"rank {r} action {pos[r]} ({a}): {why}", timeline)

    while any(pos[r] < len(sched.ranks[r]) for r in range(p)):
        progress = False
        for r in range(p):
            acts = sched.ranks[r]
            while pos[r] < len(acts):
                a: Action = acts[pos[r]]
                if a.kind in ("F", "B", "W") and sched.rank_of(a.stage) != r:
                    return invalid(r, a, f"stage {a.stage} lives on rank {sched.rank_of(a.stage)}")
                if a.kind.startswith("RECV"):
                    key = _recv_key(sched, a)
                    src = key[2]
                    if key not in posted:
                        break  # blocked until the peer sends
                    t, dst = posted[key]
                    if src is None or dst != r or a.peer != sched.rank_of(src):
                        return invalid(r, a, f"message {key} was sent to rank {dst}, not matched here")
                    clock[r] = max(clock[r], t + comm)
                    received.add(key)
                elif a.kind.startswith("SEND"):
                    key = (a.kind[-1], a.mb, a.stage)
                    nxt = sched.next_stage(a.stage) if a.kind == "SEND_F" else sched.prev_stage(a.stage)
                    if (a.kind[-1], a.mb, a.stage) not in done:
                        return invalid(r, a, "sends data that was not computed yet")
                    if key in posted or nxt is None or a.peer != sched.rank_of(nxt):
                        return invalid(r, a, "duplicate send or wrong peer")
                    posted[key] = (clock[r], a.peer)
                else:
                    why = _missing_input(a, done, received, sched)
                    if why:
                        return invalid(r, a, why)
                    start = clock[r]
                    clock[r] += cost(a)
                    timeline[r].append((a, start, clock[r]))
                    done.add((a.kind, a.mb, a.stage))
                    if a.kind == "F":
                        inflight[r] += 1
                        held[r] += 1
                    elif a.kind == "B":
                        inflight[r] -= 1
                        held[r] -= 0 if sched.split_bw else 1
                    else:
                        held[r] -= 1
                    peak_in[r], peak_held[r] = max(peak_in[r], inflight[r]), max(peak_held[r], held[r])
                pos[r] += 1
                progress = True
        if not progress:
            stuck = [f"rank {r} waits at action {pos[r]} ({sched.ranks[r][pos[r]]})"
                     for r in range(p) if pos[r] < len(sched.ranks[r])]
            return SimResult(False, "deadlock: " + "; ".join(stuck), timeline)
    unmatched = sorted(set(posted) - received)
    if unmatched:
        return SimResult(False, f"unmatched send {unmatched[0]} (no rank receives it)", timeline)
    need = {"F", "B", "W"} if sched.split_bw else {"F", "B"}
    expected = {(k, j, s) for k in need for j in range(sched.m) for s in sched.path(j)}
    if done != expected:
        miss = sorted(expected - done)
        return SimResult(False, f"incomplete: {miss[0] if miss else 'extra actions'} never runs", timeline)
    if cores is not None:
        timeline = _shared(sched, cost, comm, cores, sharing)
        clock = [tl[-1][2] if tl else 0.0 for tl in timeline]
    makespan = max(clock)
    busy = sum(end - start for tl in timeline for _, start, end in tl)
    bubble = 1.0 - busy / (p * makespan) if makespan else 0.0
    return SimResult(True, "", timeline, makespan, bubble, peak_in, peak_held)


def _recv_key(sched: Schedule, a: Action) -> tuple:
    """The message a RECV action waits for: (F or B, micro-batch, the sending stage)."""
    src = sched.prev_stage(a.stage) if a.kind == "RECV_F" else sched.next_stage(a.stage)
    return a.kind[-1], a.mb, src


def _shared(sched: Schedule, cost, comm: float, cores: int, sharing: str) -> list:
    """Timeline of an already validated schedule when its ranks share ``cores`` cores."""
    if cores < 1 or sharing not in ("ps", "fifo"):
        raise ValueError(f"need cores >= 1 and sharing 'ps' or 'fifo', got {cores}, {sharing!r}")
    p, now = sched.p, 0.0
    pos, posted = [0] * p, {}
    running: dict[int, list] = {}                 # rank -> [action, start, remaining work]
    queue: dict[int, tuple] = {}                  # rank -> (ready since, action) waiting for a core
    timeline: list[list] = [[] for _ in range(p)]
    while True:
        due = []                                  # times at which a waiting receive comes due
        moved = True
        while moved:                              # run non-compute actions until all wait/compute
            moved = False
            for r in range(p):
                acts = sched.ranks[r]
                while r not in running and r not in queue and pos[r] < len(acts):
                    a = acts[pos[r]]
                    if a.kind.startswith("SEND"):
                        posted[(a.kind[-1], a.mb, a.stage)] = now
                    elif a.kind.startswith("RECV"):
                        t = posted.get(_recv_key(sched, a))
                        if t is None or t + comm > now:
                            if t is not None:
                                due.append(t + comm)
                            break
                    else:
                        queue[r] = (now, a)
                    pos[r] += 1
                    moved = True
        while queue and (sharing == "ps" or len(running) < cores):
            r = min(queue, key=lambda q: (queue[q][0], q))  # longest waiting, then lowest rank
            a = queue.pop(r)[1]
            running[r] = [a, now, cost(a)]
        if not running and not due:
            return timeline                       # validated: every rank has finished
        rate = min(1.0, cores / len(running)) if running else 1.0
        step = min([rem / rate for _, _, rem in running.values()] + [t - now for t in due])
        now += step
        for r in list(running):
            a, start, rem = running[r]
            rem -= rate * step
            if rem <= 1e-12 * (1.0 + now):
                timeline[r].append((a, start, now))
                del running[r]
            else:
                running[r][2] = rem


def _missing_input(a: Action, done: set, received: set, sched: Schedule) -> str:
    """Why ``a`` cannot run yet ('' if it can). Data from a stage on the same rank needs only
    to have been computed; from another rank it must have been received."""
    split = sched.split_bw
    if a.stage not in sched.path(a.mb):
        return f"micro-batch {a.mb} does not run through stage {a.stage}"

    def have(kind, stage):
        local = sched.rank_of(stage) == sched.rank_of(a.stage)
        return (kind, a.mb, stage) in (done if local else received)
    prv, nxt = sched.prev_stage(a.stage), sched.next_stage(a.stage)
    if a.kind == "F" and prv is not None and not have("F", prv):
        return "forward before its input activation was received"
    if a.kind == "B":
        if ("F", a.mb, a.stage) not in done:
            return "backward before its forward"
        if nxt is not None and not have("B", nxt):
            return "backward before its output gradient was received"
    if a.kind == "W":
        if not split:
            return "W in a schedule whose backward is not split"
        if ("B", a.mb, a.stage) not in done:
            return "weight gradient before the input gradient (B)"
    if (a.kind, a.mb, a.stage) in done:
        return "runs twice"
    return ""


def check(sched: Schedule, **cost_kw) -> SimResult:
    """Simulate; raise :class:`ScheduleError` with the reason if the schedule cannot run."""
    res = simulate(sched, **cost_kw)
    if not res.ok:
        raise ScheduleError(f"schedule {sched.name} (pp={sched.p}, microbatches={sched.m}, "
                            f"v={sched.v}) refused: {res.reason}")
    return res
