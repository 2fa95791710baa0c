"""Pipeline parallel: stages (stage.py), schedules as action lists (schedule.py), their
simulator (simulate.py) and the executor/engine (engine.py). ``apply(model, mesh, cfg, spec)``."""
from .engine import PipelineEngine  # noqa: F401
from .engine import apply as _apply
from .schedule import LAYOUT


def apply(model, mesh, cfg, spec, materialize=None, make_engine=None) -> PipelineEngine:
    """engine.apply, with dual.py's engine for the dualpipe schedule (two parameter copies per
    rank, gradients summed per pair) unless ``make_engine`` names one."""
    if make_engine is None and LAYOUT.get(cfg.parallel.pp_schedule) == "dual":
        from .dual import DualPipeEngine as make_engine
    return _apply(model, mesh, cfg, spec, materialize, make_engine)
