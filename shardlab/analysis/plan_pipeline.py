"""What a pipeline rank holds, read off the engine's own schedule (parallel/pipeline/schedule.py):
the stages it owns, and its activation peak found by walking its action list in order as the
executor runs it (docs/planner.md, Memory model, "Pipeline ranks")."""
from __future__ import annotations

import functools


def layout(cfg):
    """A ``Schedule`` carrying only the layout (no action lists): p, v, rank_of, path."""
    from ..parallel.pipeline.schedule import LAYOUT, Schedule
    p = cfg.parallel
    v = 2 if p.pp_schedule in LAYOUT else p.pp_virtual
    return Schedule(p.pp_schedule, p.pp, p.microbatches, v, p.pp_schedule in ("zb-h1",) + tuple(LAYOUT),
                    layout=LAYOUT.get(p.pp_schedule, "loop"))


def n_parts(cfg) -> int:
    """How many pieces the model is cut into (DualPipe: p, held twice; otherwise p*v)."""
    sched = layout(cfg)
    return sched.p if sched.layout == "dual" else sched.n_stages


@functools.lru_cache(maxsize=512)
def compute_order(name: str, p: int, m: int, v: int) -> tuple:
    """Per rank, the (kind, micro-batch, stage) compute actions of schedule ``name`` in order:
    the schedule's own order functions (schedule.build without the sends and receives, which
    do not change what a rank holds)."""
    from ..parallel.pipeline import schedule as S
    if name == "gpipe":
        order = S.gpipe(p, m)
    elif name == "1f1b":
        order = S.one_f_one_b(p, m)
    elif name == "interleaved":
        order = S.interleaved(p, m, v)
    elif name == "zb-h1":
        order = S.zb_h1(p, m)
    else:
        from ..parallel.pipeline.dualpipe import dualpipe, dualpipev
        order = (dualpipev if name == "dualpipev" else dualpipe)(p, m)
    return tuple(tuple(r) for r in order)


def walk_peak(cfg, pp_rank: int, act: dict, stash: dict, graph_kept: bool) -> tuple[float, float]:
    """(peak saved-activation bytes, peak W-stash bytes) of pipeline rank ``pp_rank``.
    ``act[s]``, ``stash[s]``: bytes of one micro-batch of stage s."""
    p = cfg.parallel
    split = layout(cfg).split_bw
    held = peak = st = st_peak = 0.0
    for kind, _, stage in compute_order(p.pp_schedule, p.pp, p.microbatches, p.pp_virtual)[pp_rank]:
        if kind == "F":
            held += act[stage]
            peak = max(peak, held)
        elif kind == "B":
            if not split or not graph_kept:
                held -= act[stage]
            if split:
                st += stash[stage]
                st_peak = max(st_peak, st)
        elif kind == "W":
            if graph_kept:
                held -= act[stage]
            st -= stash[stage]
    return peak, st_peak

