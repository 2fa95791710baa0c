"""Pipeline schedules as data: for every pipeline rank, an ordered list of actions.

Stages and ranks. ``p`` ranks hold ``p * v`` stages (``v`` virtual stages per rank for the
interleaved schedule): global stage ``s`` lives on rank ``s % p`` as its chunk ``s // p``
(round-robin, Megatron's layout). Stage 0 owns the embedding, stage ``p*v - 1`` the head+loss.

Actions (``Action(kind, mb, stage, peer)``):
  F       forward of micro-batch ``mb`` through ``stage``
  B       backward: with ``split_bw`` only the input gradient (zero-bubble "B"), else the
          whole backward (input and weight gradients)
  W       weight gradient of ``mb`` at ``stage`` (only when the backward is split)
  SEND_F / RECV_F   the activation of ``mb`` leaving ``stage`` / entering ``stage`` (peer: rank)
  SEND_B / RECV_B   the gradient of that activation, travelling backwards

A schedule function only orders the compute actions (F/B/W) of each rank; :func:`with_comm`
inserts the point-to-point actions: a RECV right before the compute that needs the data, a
SEND right after the compute that made it. Sends never block (isend); a receive blocks until
the peer has sent: :mod:`.simulate` checks that such a program cannot deadlock.

Schedules (p ranks, m micro-batches):
  gpipe        all forwards, then all backwards                     bubble (p-1)/(m+p-1)
  1f1b         p-r-1 warm-up forwards, then one forward/one backward  same bubble, <= p in flight
  interleaved  1F1B over v chunks per rank, m % p == 0 (Megatron)    bubble (p-1)/(v*m+p-1)
  zb-h1        1F1B with backward split in B and W; W fills bubbles  idle (p-1)(F+B-W)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


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

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def stages_of(self, rank: int) -> list[int]:
        return [c * self.p + rank for c in range(self.v)]


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


# -- one small function per schedule: compute order per rank ---------------------------------------

def check_config(cfg) -> None:
    """Pipeline constraints (called by ``validate``)."""
    from ...checks import one_of, require
    m, p = cfg.model, cfg.parallel
    one_of(p.pp_schedule, SCHEDULES, "parallel.pp_schedule")
    require(p.pp_virtual == 1 or p.pp_schedule == "interleaved", "parallel.pp_virtual",
            "virtual stages > 1 need pp_schedule = 'interleaved'")
    if p.pp == 1:
        return
    require(m.n_layers >= p.pp * p.pp_virtual, "parallel.pp",
            f"{m.n_layers} layers cannot fill pp*pp_virtual={p.pp * p.pp_virtual} stages; lower pp or add layers")
    require(p.microbatches >= p.pp, "parallel.microbatches",
            f"{p.microbatches} micro-batches for pp={p.pp} stages leaves stages idle; use >= {p.pp}")
    if p.pp_schedule == "interleaved":
        require(p.microbatches % p.pp == 0, "parallel.microbatches",
                f"interleaved needs micro-batches divisible by pp={p.pp}")
    require(not m.tie_embeddings, "model.tie_embeddings",
            "the embedding (first stage) and the head (last stage) cannot share a weight across "
            "pipeline stages; set model.tie_embeddings = false or parallel.pp = 1")
    from .sharded import check_config as sharded_checks  # MoE and ZeRO/FSDP compose: aux.py, sharded.py
    sharded_checks(cfg)


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

def with_comm(compute: list[list[tuple]], p: int, v: int) -> list[list[Action]]:
    """Insert RECV before and SEND after every compute action that crosses a stage boundary."""
    last = p * v - 1
    out = []
    for ops in compute:
        acts = []
        for kind, mb, s in ops:
            if kind == "F" and s > 0:
                acts.append(Action("RECV_F", mb, s, (s - 1) % p))
            if kind == "B" and s < last:
                acts.append(Action("RECV_B", mb, s, (s + 1) % p))
            acts.append(Action(kind, mb, s))
            if kind == "F" and s < last:
                acts.append(Action("SEND_F", mb, s, (s + 1) % p))
            if kind == "B" and s > 0:
                acts.append(Action("SEND_B", mb, s, (s - 1) % p))
        out.append(acts)
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
    else:
        compute = zb_h1(p, m)
    return Schedule(name, p, m, v, name == "zb-h1", with_comm(compute, p, v))


def theoretical_bubble(name: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                       w: float = 1.0) -> float:
    """Idle fraction of the step from the closed forms (docs/pipeline.md), costs F, B, W per stage."""
    work = m * (f + b + w)
    if name in ("gpipe", "1f1b"):
        idle = (p - 1) * (f + b + w)
    elif name == "interleaved":
        idle = (p - 1) * (f + b + w) / v
    else:  # zb-h1
        idle = (p - 1) * max(f + b - w, 0.0)
    return idle / (work + idle)
