"""Architectures. ``models/spec.py`` is the plug-in point; each sub-package registers one ModelSpec."""
from .spec import (ModelSpec, build_model, count_params, get_spec, init_tensor, init_weights, meta_model,
                   register, specs)

__all__ = ["ModelSpec", "build_model", "count_params", "get_spec", "init_tensor", "init_weights", "meta_model",
           "register", "specs"]
