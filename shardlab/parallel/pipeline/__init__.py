"""Pipeline parallel: stages (stage.py), schedules as action lists (schedule.py), their
simulator (simulate.py) and the executor/engine (executor.py). ``apply(model, mesh, cfg, spec)``."""
from .executor import PipelineEngine  # noqa: F401
from .executor import apply as _apply
from .schedule import LAYOUT


def apply(model, mesh, cfg, spec, materialize=None, make_engine=None) -> PipelineEngine:
    """executor.apply, with dual_copies.py's engine for the dualpipe schedule (two parameter copies per
    rank, gradients summed per pair) unless ``make_engine`` names one."""
    if make_engine is None and LAYOUT.get(cfg.parallel.pp_schedule) == "dual":
        from .dual_copies import DualPipeEngine as make_engine
    return _apply(model, mesh, cfg, spec, materialize, make_engine)
