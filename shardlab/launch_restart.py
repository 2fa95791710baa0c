"""Automatic restart of a training job (``shardlab train --max-restarts K [--elastic MIN:MAX]``).

``run_with_restarts(cfg, nproc, start, max_restarts, elastic)`` calls ``start(cfg, n)`` (which
launches ``n`` ranks through ``launch.run``). When a rank fails, ``launch.run`` has already stopped
every rank and raises :class:`launch.WorkerError`; the job is then started again from the newest
valid checkpoint (``checkpoint.resume = True``), at most ``max_restarts`` times.

Elastic (``elastic = (MIN, MAX)``, plain data parallel only): when a restart fails again before
saving a newer checkpoint (it failed at start: a rank that cannot come back), the next restart
runs on fewer ranks, the largest ``n`` in ``[MIN, current)`` whose layout validates
(``dp_replicate = n``; ``train.global_batch`` must stay divisible, sizes that do not fit are
refused with one line and the next smaller one is tried). The sharded checkpoint loads under any
world size, so resharding is just the resume.

Every restart prints one line and writes a metrics record ``{"kind": "restart", "step", "restart",
"lost_steps", "failed_rank", "world_size", "resumed_from"}`` (metrics.jsonl and TensorBoard).
``lost_steps`` = the last step the failed attempt logged (metrics.jsonl, every ``log_every``)
minus the checkpoint's step: the steps that are trained again.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

from . import launch
from .config import Config, ConfigError
from .checkpoint.save import Reader, latest_valid, remove_interrupted
from .train.metrics import MetricsWriter, read_metrics


def parse_elastic(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` -> (MIN, MAX), 1 <= MIN <= MAX; ConfigError otherwise."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError("--elastic", f"expected MIN:MAX (e.g. 2:4), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ConfigError("--elastic", f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def plain_data_parallel(cfg: Config) -> bool:
    p = cfg.parallel
    return p.dp_shard == p.tp == p.pp == p.cp == p.ep == 1


def check_elastic(cfg: Config, nproc: int, elastic: tuple[int, int] | None) -> None:
    """Refuse (ConfigError) an elastic range that cannot apply to this job."""
    if elastic is None:
        return
    lo, hi = elastic
    if not lo <= nproc <= hi:
        raise ConfigError("--elastic", f"the job starts on {nproc} ranks, outside MIN:MAX = {lo}:{hi}")
    if not plain_data_parallel(cfg):
        raise ConfigError("--elastic", "only plain data parallel (dp_replicate = world size; dp_shard, tp, pp, cp "
                                       "and ep all 1) can change its world size")


def resized(cfg: Config, n: int) -> Config:
    """A copy of ``cfg`` laid out as plain data parallel on ``n`` ranks; ConfigError if it does not fit."""
    from .train import checks  # noqa: F401  (registers every config check validate runs)
    out = copy.deepcopy(cfg)
    out.parallel.dp_replicate = n
    out.validate(world_size=n)
    return out


def _checkpoint(cfg: Config) -> tuple[Path | None, int]:
    from .train.loop import checkpoint_dir
    path = latest_valid(checkpoint_dir(cfg), warn=lambda *_: None) if cfg.checkpoint.save else None
    if path is None:
        return None, 0
    reader = Reader(path)
    try:
        return path, int(reader.step)
    finally:
        reader.close()


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


def run_with_restarts(cfg: Config, nproc: int, start, max_restarts: int,
                      elastic: tuple[int, int] | None = None, say=None):
    """``start(cfg, n)``'s result, restarting after a rank failure (module doc)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_elastic(cfg, nproc, elastic)
    run_dir = Path(cfg.logging.run_dir)
    n, restarts = nproc, 0
    _, before = _checkpoint(cfg)
    while True:
        try:
            return start(cfg, n)
        except launch.WorkerError as err:
            if restarts >= max_restarts:
                raise
            path, step = _checkpoint(cfg)
            reached = _last_logged_step(run_dir)
            lost = max(0, reached - step) if reached is not None else 0
            failed_at_start = restarts > 0 and step <= before
            restarts += 1
            if elastic and failed_at_start:
                nxt = _smaller(cfg, n, elastic[0], say)
                if nxt is None:
                    say(f"shardlab: elastic: no world size in {elastic[0]}:{n - 1} fits; giving up")
                    raise
                cfg, n = nxt
            remove_interrupted(_ckpt_dir(cfg))  # a rank killed while saving leaves a staging dir
            cfg = copy.deepcopy(cfg)
            cfg.checkpoint.resume = True
            reason = str(err).splitlines()[1] if len(str(err).splitlines()) > 1 else str(err)
            say(f"shardlab: restart {restarts}/{max_restarts}: rank {err.rank} failed ({reason.strip()[:160]}); "
                f"resuming from {path if path else 'the start (no checkpoint yet)'} at step {step} on {n} "
                f"rank(s), {lost} step(s) to redo")
            writer = MetricsWriter(run_dir, cfg.logging.tensorboard)
            writer.write({"kind": "restart", "step": step, "restart": restarts, "lost_steps": lost,
                          "failed_rank": err.rank, "world_size": n, "resumed_from": str(path) if path else None})
            writer.close()
            before = step


def _ckpt_dir(cfg: Config) -> Path:
    from .train.loop import checkpoint_dir
    return checkpoint_dir(cfg)
