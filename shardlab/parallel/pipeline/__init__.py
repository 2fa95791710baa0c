"""Pipeline parallel: stages (stage.py), schedules as action lists (schedule.py), their
simulator (simulate.py) and the executor/engine (engine.py). ``apply(model, mesh, cfg)``."""
from .engine import PipelineEngine, apply  # noqa: F401
