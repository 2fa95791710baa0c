"""Configuration: the typed sections and their loading (schema.py), per-field ranges (checks.py),
cross-field validation with the checks each module registers (validation.py), DeepSpeed JSON (deepspeed.py)."""
from ..errors import ConfigError  # noqa: F401
from .checks import allowed, check_ranges  # noqa: F401
from .schema import (SECTIONS, CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig,  # noqa: F401
                     ParallelConfig, TrainConfig, f, from_dict, load, parse_overrides)
from .validation import register_check, spread_over, validate, whole_graph  # noqa: F401
