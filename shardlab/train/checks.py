"""The config checks that ask the ModelSpec or the image loader, registered with config/validation.py;
importing this module imports every module that registers one, which ``validate`` requires."""
from __future__ import annotations

from ..config import register_check
from ..errors import one_of, require
from ..models.spec import add_adapters, get_spec, meta_model
from ..parallel import context, expert, tensor, ulysses, zero  # noqa: F401  (each registers its check_config)
from ..parallel.pipeline import schedule, sharded  # noqa: F401
from .images import DATASETS


@register_check
def check_model(cfg) -> None:
    """An unknown architecture, the parallelisms its spec does not provide, the spec's own check."""
    p, spec = cfg.parallel, get_spec(cfg.model.arch)
    a = spec.name
    require(p.tp == 1 or spec.tp_plan is not None, "parallel.tp",
            f"model.arch={a} has no tensor-parallel plan; set parallel.tp = 1 (use data parallel / ZeRO)")
    require(not p.sequence_parallel or spec.tp_plan is not None, "parallel.sequence_parallel",
            f"model.arch={a} has no tensor-parallel plan; set parallel.sequence_parallel = false")
    require(p.cp == 1 or spec.attention is not None, "parallel.cp",
            f"model.arch={a} has no attention to split over the sequence; set parallel.cp = 1")
    require(p.pp == 1 or spec.pp_first is not None, "parallel.pp",
            f"model.arch={a} has no pipeline split; set parallel.pp = 1")
    require(p.activation_checkpointing != "selective" or spec.attention is not None,
            "parallel.activation_checkpointing",
            f"selective recomputation wraps attention cores and model.arch={a} has none; use full or none")
    require((p.ep == 1 and cfg.model.n_experts == 0) or spec.moe, "model.n_experts",
            f"model.arch={a} has no Mixture-of-Experts blocks; set model.n_experts = 0 and parallel.ep = 1")
    if spec.check is not None:
        spec.check(cfg)


@register_check
def check_task(cfg) -> None:
    """A language model's sequence fits its positions; an image model's dataset is one images.py reads."""
    m, t = cfg.model, cfg.train
    if get_spec(m.arch).task == "lm":
        require(t.seq_len <= m.max_seq_len, "train.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    else:
        one_of(cfg.data.dataset, DATASETS, "data.dataset")


@register_check
def check_adapters(cfg) -> None:
    """LoRA targets that match no linear: found on the meta model, before any rank starts."""
    if cfg.train.lora_rank:
        add_adapters(meta_model(cfg.model), cfg.train)
