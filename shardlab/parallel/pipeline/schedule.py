"""Pipeline schedules as data: for every pipeline rank, an ordered list of ``Action(kind, mb,
stage, peer)`` (F, B, W and the SEND/RECV that ``with_comm`` inserts); gpipe, 1f1b, interleaved,
zb-h1, dualpipev, dualpipe and their stage layouts (docs/pipeline.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ...config import register_check
from ...errors import require

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev", "dualpipe")
EXECUTABLE = SCHEDULES
"""What the executor runs (all; ``dualpipe``'s two parameter copies: dual_copies.py)."""
LAYOUT = {"dualpipev": "v", "dualpipe": "dual"}


class ScheduleError(ValueError):
    """A schedule that cannot run (bad micro-batch count, deadlock...). ``str`` says why and the fix."""


class Action(NamedTuple):
    kind: str
    mb: int
    stage: int
    peer: int | None = None

    def __str__(self):
        return f"{self.kind}{self.mb}" + (f"s{self.stage}" if self.kind in "FBW" else f"s{self.stage}>r{self.peer}")


@dataclass
class Schedule:
    name: str
    p: int
    m: int
    v: int = 1
    split_bw: bool = False
    ranks: list = field(default_factory=list)
    """``ranks[r]`` = the ordered list of :class:`Action` of pipeline rank ``r``."""

    layout: str = "loop"
    """``loop``: stage s on rank s % p; ``v`` / ``dual``: the DualPipe layouts (module docstring)."""

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        if self.layout == "loop":
            return stage % self.p
        return stage if stage < self.p else 2 * self.p - 1 - stage

    def stages_of(self, rank: int) -> list[int]:
        return sorted(s for s in range(self.n_stages) if self.rank_of(s) == rank)

    def prev_stage(self, stage: int) -> int | None:
        """The stage whose output is this stage's input (None: the stage takes the tokens)."""
        return None if stage == 0 or (self.layout == "dual" and stage == self.p) else stage - 1

    def next_stage(self, stage: int) -> int | None:
        """The stage taking this stage's output (None: the stage computes the loss)."""
        end = stage == self.n_stages - 1 or (self.layout == "dual" and stage == self.p - 1)
        return None if end else stage + 1

    def path(self, mb: int) -> range:
        """The stages micro-batch ``mb`` runs through (dualpipe: one direction's)."""
        if self.layout == "dual":
            return range(self.p) if mb < self.m // 2 else range(self.p, 2 * self.p)
        return range(self.n_stages)


def check_counts(name: str, p: int, m: int, v: int = 1) -> None:
    """Clear errors for micro-batch / stage counts a schedule cannot use (before anything runs)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"pp={p}, microbatches={m}, virtual={v}: all must be >= 1")
    if p > 1 and m < p:
        raise ScheduleError(f"microbatches={m} < pp={p}: stages would idle and 1F1B cannot fill the "
                            f"pipeline; use microbatches >= {p}")
    if name == "interleaved" and m % p:
        raise ScheduleError(f"interleaved needs microbatches divisible by pp={p} (got {m}); "
                            f"use {p * ((m + p - 1) // p)}")
    if name != "interleaved" and v != 1:
        raise ScheduleError(f"virtual stages (v={v}) need the interleaved schedule; set v=1 for {name}")
    if name in LAYOUT and m < 2 * p:
        raise ScheduleError(f"{name} needs microbatches >= 2*pp = {2 * p} (got {m}); use {2 * p}")
    if name == "dualpipe" and (p % 2 or m % 2):
        raise ScheduleError(f"dualpipe needs an even pp and even microbatches (got pp={p}, "
                            f"microbatches={m}): half the micro-batches enter at each end")


# -- one small function per schedule: compute order per rank ---------------------------------------

@register_check
def check_config(cfg) -> None:
    """Pipeline constraints (called by ``validate``)."""
    m, p = cfg.model, cfg.parallel
    require(p.pp_virtual == 1 or p.pp_schedule == "interleaved", "parallel.pp_virtual",
            "virtual stages > 1 need pp_schedule = 'interleaved'")
    require(not p.pp_overlap or (p.pp > 1 and p.pp_schedule in LAYOUT), "parallel.pp_overlap",
            "the F&B overlap pairs DualPipe's forwards and backwards; use pp > 1 with pp_schedule = dualpipe or dualpipev")
    require(p.pp > 1 or p.pp_split == "balanced", "parallel.pp_split",
            "ends cuts the model into pipeline stages; use it with pp > 1 or leave pp_split = 'balanced'")
    if p.pp == 1:
        return
    if p.pp_split == "ends":
        require(p.pp_schedule not in LAYOUT, "parallel.pp_split",
                f"{p.pp_schedule} runs each part of the model twice; use pp_split = 'balanced' with it")
        require(p.pp * p.pp_virtual >= 3, "parallel.pp_split",
                "ends gives the embedding and the head stages of their own and needs pp*pp_virtual >= 3 stages; "
                "raise pp or pp_virtual, or use pp_split = 'balanced'")
        require(m.n_layers >= p.pp * p.pp_virtual - 2, "parallel.pp",
                f"{m.n_layers} layers cannot fill the {p.pp * p.pp_virtual - 2} stages between the ends; "
                "lower pp or pp_virtual, or add layers")
    else:
        require(m.n_layers >= p.pp * p.pp_virtual, "parallel.pp",
                f"{m.n_layers} layers cannot fill pp*pp_virtual={p.pp * p.pp_virtual} stages; lower pp or add layers")
    require(p.microbatches >= p.pp, "parallel.microbatches",
            f"{p.microbatches} micro-batches for pp={p.pp} stages leaves stages idle; use >= {p.pp}")
    if p.pp_schedule == "interleaved":
        require(p.microbatches % p.pp == 0, "parallel.microbatches",
                f"interleaved needs micro-batches divisible by pp={p.pp}")
    if p.pp_schedule in LAYOUT:
        require(p.microbatches >= 2 * p.pp, "parallel.microbatches",
                f"{p.pp_schedule} needs micro-batches >= 2*pp = {2 * p.pp}; use {2 * p.pp}")
    if p.pp_schedule == "dualpipev":
        require(m.n_layers >= 2 * p.pp, "parallel.pp",
                f"dualpipev cuts the model into 2*pp = {2 * p.pp} stages but it has {m.n_layers} "
                "layers; lower pp or add layers")
    if p.pp_schedule == "dualpipe":
        require(p.pp % 2 == 0, "parallel.pp",
                f"dualpipe pairs rank r with rank pp-1-r and needs an even pp (got {p.pp}); use {p.pp + 1}")
        require(p.microbatches % 2 == 0, "parallel.microbatches",
                f"dualpipe sends half the micro-batches each way and needs an even number (got "
                f"{p.microbatches}); use {p.microbatches + 1}")
        require(p.zero_stage == 0, "parallel.zero_stage",
                "dualpipe keeps two copies of every stage, not implemented with ZeRO/FSDP inside the "
                "stages; set --parallel.zero_stage=0 or use pp_schedule = 'dualpipev'")
    require(not m.tie_embeddings, "model.tie_embeddings",
            "the embedding (first stage) and the head (last stage) cannot share a weight across "
            "pipeline stages; set model.tie_embeddings = false or parallel.pp = 1")


def gpipe(p: int, m: int) -> list[list[tuple]]:
    return [[("F", j, r) for j in range(m)] + [("B", j, r) for j in range(m)] for r in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[tuple]]:
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops = [("F", j, r) for j in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i, r), ("B", i, r)]
        ops += [("B", j, r) for j in range(m - warm, m)]
        out.append(ops)
    return out


def interleaved(p: int, m: int, v: int) -> list[list[tuple]]:
    """Megatron's interleaved 1F1B: micro-batches go through a rank's chunks in groups of p."""
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:  # k-th forward/backward -> (mb, chunk)
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, (v - 1 - chunk) if backward else chunk

    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        ops = []
        for k in range(warm):
            mb, c = unit(k, False)
            ops.append(("F", mb, c * p + r))
        for i in range(total - warm):
            mb, c = unit(warm + i, False)
            ops.append(("F", mb, c * p + r))
            mb, c = unit(i, True)
            ops.append(("B", mb, c * p + r))
        for i in range(total - warm, total):
            mb, c = unit(i, True)
            ops.append(("B", mb, c * p + r))
        out.append(ops)
    return out


def zb_h1(p: int, m: int) -> list[list[tuple]]:
    """ZB-H1, built greedily in unit time slots (F = B = W = 1). Each slot rank r runs, by
    priority: the next B whose output gradient has arrived; else the next F whose input has
    arrived, if fewer than p - r micro-batches wait for their B (1F1B's activation bound) and
    fewer than 2p - r - 1 wait for their W; else the oldest pending W; else it idles.
    The deferred W's (at most p - r - 1 beyond 1F1B's) fill the cool-down bubbles."""
    done: dict[tuple, int] = {}  # (kind, mb, rank) -> slot it finished in
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    out: list[list[tuple]] = [[] for _ in range(p)]
    t = 0
    while min(nw) < m:
        for r in range(p):
            ready = lambda k, j, rr: done.get((k, j, rr), t) < t  # noqa: E731 (finished before slot t)
            if nb[r] < nf[r] and (r == p - 1 or ready("B", nb[r], r + 1)):
                act = ("B", nb[r], r)
                nb[r] += 1
            elif (nf[r] < m and nf[r] - nb[r] < p - r and nf[r] - nw[r] < 2 * p - r - 1
                  and (r == 0 or ready("F", nf[r], r - 1))):
                act = ("F", nf[r], r)
                nf[r] += 1
            elif nw[r] < nb[r]:
                act = ("W", nw[r], r)
                nw[r] += 1
            else:
                continue
            done[act] = t
            out[r].append(act)
        t += 1
    return out


# -- communication ----------------------------------------------------------------------------

def with_comm(compute: list[list[tuple]], sched: Schedule) -> list[list[Action]]:
    """Insert RECV before and SEND after every compute action that crosses a stage boundary to
    another rank (a boundary inside one rank, e.g. the turn of the V, is handed over locally)."""
    out = []
    for r, ops in enumerate(compute):
        acts = []
        for kind, mb, s in ops:
            prv, nxt = sched.prev_stage(s), sched.next_stage(s)
            prv = None if prv is None or sched.rank_of(prv) == r else sched.rank_of(prv)
            nxt = None if nxt is None or sched.rank_of(nxt) == r else sched.rank_of(nxt)
            if kind == "F" and prv is not None:
                acts.append(Action("RECV_F", mb, s, prv))
            if kind == "B" and nxt is not None:
                acts.append(Action("RECV_B", mb, s, nxt))
            acts.append(Action(kind, mb, s))
            if kind == "F" and nxt is not None:
                acts.append(Action("SEND_F", mb, s, nxt))
            if kind == "B" and prv is not None:
                acts.append(Action("SEND_B", mb, s, prv))
        out.append(acts)
    return _order_sends(out, sched)


def _msg(a: Action, sched: Schedule) -> tuple:
    """(kind, micro-batch, sending stage) of a SEND or RECV action."""
    if a.kind.startswith("SEND"):
        return a.kind[-1], a.mb, a.stage
    return a.kind[-1], a.mb, sched.prev_stage(a.stage) if a.kind == "RECV_F" else sched.next_stage(a.stage)


def _order_sends(ranks: list[list[Action]], sched: Schedule) -> list[list[Action]]:
    """Messages are matched by issue order: where a rank computes two messages for one peer in
    the other order than the peer receives them (DualPipe: an activation and a gradient both
    going to rank r+1), hold the earlier-computed one back until the peer's earlier receive has
    its send. The receiver waits for the held-back message's predecessor anyway, so no receive
    completes later; the loop schedules already agree and stay unchanged."""
    want = {}  # (sender, receiver) -> messages in the receiver's order
    for b, acts in enumerate(ranks):
        for x in acts:
            if x.kind.startswith("RECV"):
                want.setdefault((x.peer, b), []).append(_msg(x, sched))
    out = []
    for a, acts in enumerate(ranks):
        nxt, ready, new = {}, {}, []
        for x in acts:
            if not x.kind.startswith("SEND"):
                new.append(x)
                continue
            ready.setdefault(x.peer, {})[_msg(x, sched)] = x
            order, i = want.get((a, x.peer), []), nxt.get(x.peer, 0)
            while i < len(order) and order[i] in ready[x.peer]:
                new.append(ready[x.peer].pop(order[i]))
                i += 1
            nxt[x.peer] = i
        new += [x for peer in ready.values() for x in peer.values()]  # unmatched: the simulator says so
        out.append(new)
    return out


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The action lists of schedule ``name`` (checked for counts; simulate before running)."""
    check_counts(name, p, m, v)
    if name == "gpipe":
        compute = gpipe(p, m)
    elif name == "1f1b":
        compute = one_f_one_b(p, m)
    elif name == "interleaved":
        compute = interleaved(p, m, v)
    elif name == "zb-h1":
        compute = zb_h1(p, m)
    else:
        from .dualpipe import dualpipe, dualpipev
        compute = (dualpipev if name == "dualpipev" else dualpipe)(p, m)
        v = 2
    sched = Schedule(name, p, m, v, name in ("zb-h1",) + tuple(LAYOUT), layout=LAYOUT.get(name, "loop"))
    sched.ranks = with_comm(compute, sched)
    return sched


def theoretical_bubble(name: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                       w: float = 1.0) -> float:
    """Idle fraction of the step from the closed forms (docs/pipeline.md), costs F, B, W per stage."""
    work = m * (f + b + w)
    if name in ("gpipe", "1f1b"):
        idle = (p - 1) * (f + b + w)
    elif name == "interleaved":
        idle = (p - 1) * (f + b + w) / v
    elif name == "zb-h1":
        idle = (p - 1) * max(f + b - w, 0.0)
    else:
        from .dualpipe import dual_idle
        idle = dual_idle(name, p, f, b, w)
    return idle / (work + idle)
