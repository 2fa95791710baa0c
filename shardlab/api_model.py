"""What ``shardlab.initialize`` does to a user model besides sharding it, and which config fields
cannot apply to one (docs/api.md, Recomputation and compile of your model; What is refused).

``parallel.activation_checkpointing`` (``full`` / ``op``) recomputes each of the model's repeated
blocks (units.repeated_blocks: the blocks ``wrap_policy = blocks`` shards), ``parallel.compile``
with ``compile_scope = blocks`` compiles each of them; ``model`` / ``auto`` compile the whole
module (api_deepspeed ``compile``, DeepSpeed's ``engine.compile``). What only shardlab's own
models or its training loop can do is refused by name instead of accepted and ignored.
``tag_groups`` marks the parameters of each user param group, which ZeRO packs apart.
"""
from __future__ import annotations

from torch import nn

from .config import Config
from .errors import ConfigError

_AC = "parallel.activation_checkpointing"


def check_user_config(cfg: Config) -> None:
    """Raise a ConfigError naming the first field a user model cannot honour."""
    p, t = cfg.parallel, cfg.train
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name) > 1:
            raise ConfigError(f"parallel.{name}", f"= {getattr(p, name)}: shardlab.initialize trains a user model "
                              "data-parallel only (it has no tensor/pipeline/context/expert plan); set it to 1")
    if p.activation_checkpointing == "selective":
        raise ConfigError(_AC, "= selective recomputes the attention cores of shardlab's own architectures, which a "
                               "user model does not name; use full or op (each repeated block)")
    if t.lora_rank > 0:
        raise ConfigError("train.lora_rank", f"= {t.lora_rank}: shardlab adds LoRA adapters to its own models "
                          "(shardlab train / finetune); add them to yours before initialize (frozen base weights "
                          "are fine) and set it to 0")
    if t.fault_tolerance != "off":
        raise ConfigError("train.fault_tolerance", f"= {t.fault_tolerance}: live recovery is shardlab train's loop "
                          "(docs/faults.md); set it to off")
    if t.detect_anomaly != "off":
        raise ConfigError("train.detect_anomaly", f"= {t.detect_anomaly}: the module hooks run in shardlab train's "
                          "loop; set it to off (in your loop: torch.autograd.set_detect_anomaly)")


def _blocks(model: nn.Module, field: str, value: str, fix: str) -> list[nn.Module]:
    from .parallel import units
    names = units.repeated_blocks(model)
    if not names:
        raise ConfigError(field, f"= {value}: {type(model).__name__} has no repeated blocks (a ModuleList / "
                                 f"Sequential of 2+ modules of one class with trainable parameters); {fix}")
    return [model.get_submodule(n) for n in names]


def recompute_blocks(model: nn.Module, mode: str) -> None:
    """``full`` / ``op``: recompute each repeated block in backward (parallel/recompute.py)."""
    if mode == "none":
        return
    from .parallel import recompute
    fix = ("set it to none and checkpoint inside your forward (torch.utils.checkpoint, transformers' "
           "gradient_checkpointing_enable())")
    recompute.checkpoint_modules(_blocks(model, _AC, mode, fix), mode)


def compile_blocks(model: nn.Module) -> None:
    """``compile_scope = blocks``: ``torch.compile`` each repeated block in place; shardlab's
    communication in their hooks runs eagerly (distributed/eager.py)."""
    blocks = _blocks(model, "parallel.compile_scope", "blocks", "use model (the whole module)")
    from .distributed.eager import prepare
    prepare()
    for block in blocks:
        block.compile()


def tag_groups(model: nn.Module, groups, weight_decay: float, tag: str = "_shardlab_user_group") -> None:
    """Mark each parameter with (its user group's index, that group's weight decay): ZeRO then
    packs each group's parameters into flats of their own (parallel/zero.py ``decay_groups``), so
    any grouping works at every stage, as in DeepSpeed. Without groups: earlier marks removed."""
    where = {pid: (k, float(s.get("weight_decay", weight_decay))) for k, (ids, s) in enumerate(groups or ())
             for pid in ids}
    for p in model.parameters():
        if id(p) in where:
            setattr(p, tag, where[id(p)])
        elif hasattr(p, tag):
            delattr(p, tag)
