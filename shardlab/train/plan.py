"""The run plan: what the parent resolves once per (re)start of ``shardlab train`` and hands to
every rank in its ``RankContext.plan`` (docs/architecture.md, "The run plan")."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import save as ckpt
from ..config import Config


def checkpoint_dir(cfg: Config) -> Path:
    """``checkpoint.dir``, else ``<logging.run_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.logging.run_dir) / "checkpoints"


@dataclass(frozen=True)
class RunPlan:
    """One start of a training job, resolved in the parent; ranks read it and look nothing up."""

    config: Config
    """The resolved config: validated, paths absolute, ``checkpoint.resume`` set on a restart."""
    resume_from: Path | None = None
    """The checkpoint every rank loads before its first step: the newest valid one when the plan
    was made with ``checkpoint.resume`` (Ray Train's restored checkpoint replaces it in its
    workers); None: a fresh start (or ``checkpoint.base``)."""
    resume_step: int = 0
    """The step of ``resume_from`` as the parent found it (0 without one)."""
    restarts: int = 0
    """How many times the job was restarted before this start (``--max-restarts``)."""
    transport: str = "auto"
    """The transport of the ranks' Mesh (``parallel.comm_transport``; replica groups: process_group)."""
    test_hooks: dict = field(default_factory=dict)
    """TEST-ONLY: the parent's ``SHARDLAB_TEST_*`` variables (``launch.test_env``); empty in real runs."""

    @property
    def run_dir(self) -> Path:
        """``logging.run_dir``: metrics, plots, profiles, flight recorder dumps (``flight/``)."""
        return Path(self.config.logging.run_dir)

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints are written and looked up (:func:`checkpoint_dir`)."""
        return checkpoint_dir(self.config)


def make_plan(cfg: Config, restarts: int = 0, test_hooks: dict | None = None, warn=print) -> RunPlan:
    """The plan of one start of ``cfg``; with ``checkpoint.resume``, the one lookup of the newest
    valid checkpoint of this start (damaged newer ones reported through ``warn``)."""
    path = ckpt.latest_valid(checkpoint_dir(cfg), warn=warn) if cfg.checkpoint.resume else None
    step = int(path.name.removeprefix(ckpt.PREFIX)) if path is not None else 0  # save names it by its step
    return RunPlan(cfg, path, step, restarts, cfg.parallel.comm_transport, dict(test_hooks or {}))
