"""Automatic restart of a training job (``shardlab train --max-restarts K [--elastic MIN:MAX]``).

``run_with_restarts(plan, nproc, start, max_restarts, elastic)`` calls ``start(plan, n)``; after a
rank failure (:class:`launch.WorkerError`) it makes the next start's run plan (the newest valid
checkpoint, looked up once; restart count + 1; with ``elastic``, fewer ranks when a restart failed
again before saving), prints one line and writes a ``restart`` metrics record. Docs:
docs/faults.md, "Automatic restart"."""
from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

from . import launch
from .config import Config, ConfigError
from .checkpoint.save import remove_interrupted
from .train.metrics import MetricsWriter, read_metrics
from .train.plan import RunPlan, make_plan


def parse_elastic(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` -> (MIN, MAX), 1 <= MIN <= MAX; ConfigError otherwise."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError("--elastic", f"expected MIN:MAX (e.g. 2:4), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ConfigError("--elastic", f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def check_elastic(cfg: Config, nproc: int, elastic: tuple[int, int] | None) -> None:
    """Refuse (ConfigError) an elastic range that cannot apply to this job."""
    if elastic is None:
        return
    lo, hi = elastic
    if not lo <= nproc <= hi:
        raise ConfigError("--elastic", f"the job starts on {nproc} ranks, outside MIN:MAX = {lo}:{hi}")
    p = cfg.parallel
    if not p.dp_shard == p.tp == p.pp == p.cp == p.ep == 1:
        raise ConfigError("--elastic", "only plain data parallel (dp_replicate = world size; dp_shard, tp, pp, cp "
                                       "and ep all 1) can change its world size")


def resized(cfg: Config, n: int) -> Config:
    """A copy of ``cfg`` laid out as plain data parallel on ``n`` ranks; ConfigError if it does not fit."""
    from .train import checks  # noqa: F401  (registers every config check validate runs)
    out = copy.deepcopy(cfg)
    out.parallel.dp_replicate = n
    out.validate(world_size=n)
    return out


def _last_logged_step(run_dir: Path) -> int | None:
    """The newest step that the failed attempt logged (records after the last ``start``); None
    when it wrote no record (the last one is a ``restart``: it failed at start)."""
    try:
        records = read_metrics(run_dir)
    except (OSError, ValueError):
        return None
    marks = [i for i, r in enumerate(records) if r.get("kind") in ("start", "restart")]
    if not marks or records[marks[-1]]["kind"] == "restart":  # it failed before its first record
        return None
    steps = [r.get("step", 0) for r in records[marks[-1]:] if r.get("kind") in ("train", "val")]
    return max(steps, default=records[marks[-1]].get("step"))


def _smaller(cfg: Config, n: int, lo: int, say) -> tuple[Config, int] | None:
    """The largest world size in [lo, n) whose layout validates, with its config; None if none does."""
    for m in range(n - 1, lo - 1, -1):
        try:
            return resized(cfg, m), m
        except ConfigError as e:
            say(f"shardlab: elastic: {m} rank(s) refused: {e}")
    return None


def run_with_restarts(plan: RunPlan, nproc: int, start, max_restarts: int,
                      elastic: tuple[int, int] | None = None, say=None):
    """``start(plan, n)``'s result, restarting after a rank failure (module doc)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_elastic(plan.config, nproc, elastic)
    n = nproc
    while True:
        try:
            return start(plan, n)
        except launch.WorkerError as err:
            if plan.restarts >= max_restarts:
                raise
            cfg = copy.deepcopy(plan.config)
            cfg.checkpoint.resume = True
            remove_interrupted(plan.checkpoint_dir)  # a rank killed while saving leaves a staging dir
            nxt = make_plan(cfg, plan.restarts + 1, plan.test_hooks)  # the one lookup of this restart
            step = nxt.resume_step
            if elastic and plan.restarts > 0 and step <= plan.resume_step:  # failed again before saving
                smaller = _smaller(cfg, n, elastic[0], say)
                if smaller is None:
                    say(f"shardlab: elastic: no world size in {elastic[0]}:{n - 1} fits; giving up")
                    raise
                nxt, n = replace(nxt, config=smaller[0]), smaller[1]
            reason = str(err).splitlines()[1] if len(str(err).splitlines()) > 1 else str(err)
            record_restart(nxt, max_restarts, err.who, reason, n, err.rank, say)
            plan = nxt


def record_restart(plan: RunPlan, max_restarts: int, who: str, reason: str, n: int, failed_rank=None, say=None) -> None:
    """One line and a ``restart`` metrics record for the start ``plan`` (``plan.restarts`` >= 1,
    resuming ``plan.resume_from``): shardlab's --max-restarts, Ray Train's restarts (rank 0 of the
    restarted group), a torchrun restart (rank 0)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path, step = plan.resume_from, plan.resume_step
    reached = _last_logged_step(plan.run_dir)
    lost = max(0, reached - step) if reached is not None else 0
    say(f"shardlab: restart {plan.restarts}/{max_restarts}: {who} failed ({reason.strip()[:160]}); "
        f"resuming from {path if path else 'the start (no checkpoint yet)'} at step {step} on {n} "
        f"rank(s), {lost} step(s) to redo")
    writer = MetricsWriter(plan.run_dir, plan.config.logging.tensorboard)
    writer.write({"kind": "restart", "step": step, "restart": plan.restarts, "lost_steps": lost,
                  "failed_rank": failed_rank, "world_size": n, "resumed_from": str(path) if path else None})
    writer.close()


# -- torchrun's restarts (torchrun --max-restarts K ... shardlab train) ---------------------------

def torchrun_restart(cfg: Config) -> int:
    """Under a torchrun restart (TORCHELASTIC_RESTART_COUNT >= 1): the run resumes from its newest
    valid checkpoint (or starts over where none was saved yet), as after shardlab's own
    --max-restarts, with no --resume; returns the restart count (0: a first start)."""
    count, _ = launch.elastic_restarts()
    if count >= 1:
        cfg.checkpoint.resume = True
    return count


def may_start_fresh() -> bool:
    """--resume where the checkpoint directory does not exist yet starts fresh (instead of being
    refused as a mistyped path) only under a torchrun restart policy (TORCHELASTIC_MAX_RESTARTS >= 1):
    every start of such a job may be passed --resume, the first one included."""
    count, most = launch.elastic_restarts()
    return count >= 1 or most >= 1


def note_torchrun_restart(plan: RunPlan, nproc: int) -> None:
    """Rank 0 of a torchrun restart: the line and ``restart`` record of :func:`record_restart`."""
    count, most = launch.elastic_restarts()
    if count:
        record_restart(replace(plan, restarts=count), most, "a rank", "torchrun restarted the job", nproc)
