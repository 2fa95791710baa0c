"""shardlab: every parallelism of large-model training from torch.distributed primitives.

``shardlab.initialize(model, config=...)`` (api.py) wraps any ``nn.Module`` for data-parallel
training, like ``deepspeed.initialize``; imported on first use so that ``import shardlab`` stays light.
"""

__all__ = ["initialize", "ModelEngine", "add_config_arguments", "init_distributed"]


def __getattr__(name):
    if name == "zero":  # DeepSpeed's deepspeed.zero.GatheredParameters (api_zero.py)
        from . import api_zero
        return api_zero
    if name in ("add_config_arguments", "init_distributed"):  # DeepSpeed's module functions (api_deepspeed.py)
        from . import api_deepspeed
        return getattr(api_deepspeed, name)
    if name in __all__:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")
