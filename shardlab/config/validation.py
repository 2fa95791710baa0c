"""``validate(cfg, world_size)``: the cross-field rules, after each field's declared range
(checks.py), before any process starts. Each rule is registered by the module that owns it
(``register_check``); one line per problem (docs/configuration.md, Validation)."""
from __future__ import annotations

from ..errors import require

CHECKS: dict = {}
"""The registered cross-field checks by name (``parallel.tensor.check_config``); see register_check."""
ORDER = ("train.checks.check_model", *(f"parallel.{m}.check_config" for m in (
    "tensor", "context", "ulysses", "expert", "pipeline.schedule", "pipeline.sharded", "zero")),
    "config.validation.check_dtypes", "train.checks.check_task", "config.validation.check_batch", "train.checks.check_adapters")
"""The checks ``validate`` requires, in the order it runs them (the first failure is raised)."""


def register_check(fn):
    """Decorator: ``validate`` calls ``fn(cfg)``, which raises ConfigError. Each parallel module
    registers its ``check_config`` when imported; ``shardlab.train.checks`` registers the ModelSpec's
    and imports all the others."""
    CHECKS[f"{fn.__module__.removeprefix('shardlab.')}.{fn.__name__}"] = fn
    return fn


def validate(cfg, world_size: int | None = None) -> None:
    """The cross-field rules (after ``check_ranges``): the world size, then every registered check."""
    missing = [name for name in ORDER if name not in CHECKS]
    if missing:  # never skipped silently: whoever validates imports shardlab.train.checks first
        raise RuntimeError(f"config checks not registered: {', '.join(missing)}; import shardlab.train.checks "
                           "(it imports every module that registers one) before validating")
    p = cfg.parallel
    if world_size is not None:
        require(p.world_size == world_size, "parallel",
                f"dp_replicate*dp_shard*cp*tp*pp = {p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp}*{p.pp} = "
                f"{p.world_size} but the job has {world_size} processes; set --nproc {p.world_size} "
                f"or change the degrees so their product is {world_size}")
    for name in (*ORDER, *(n for n in CHECKS if n not in ORDER)):
        CHECKS[name](cfg)


def spread_over(cfg, world_size: int | None):
    """``cfg`` with its degrees filled for ``world_size`` ranks when it gives none (all 1, as a
    single-process config or a DeepSpeed JSON, whose data parallelism is the job's ranks): data
    parallel over every rank, on the sharded axis under ZeRO (else ``zero_stage = 3`` would shard
    over groups of one rank: no memory saved). What ``shardlab train``, ``memory`` and ``config
    show --nproc`` run; degrees that are given are left for ``validate`` to check."""
    p = cfg.parallel
    if world_size and world_size != p.world_size and p.world_size == 1:
        setattr(p, "dp_shard" if p.zero_stage else "dp_replicate", world_size)
    return cfg


def whole_graph(cfg) -> bool:
    """Whether ``parallel.compile`` compiles the whole model as one graph (``compile_scope``):
    only where no parallel module hooks into it (one rank: no tp, cp, pp, data parallel, ZeRO or
    experts), so the blocks are not units of anything (docs/gpu.md, Single device)."""
    p = cfg.parallel
    alone = p.world_size == 1 and p.zero_stage == 0 and cfg.model.n_experts == 0
    return p.compile_scope != "blocks" and alone


@register_check
def check_dtypes(cfg) -> None:
    """What no single module owns: DDP's reduce dtype, the whole-graph compile."""
    p, t = cfg.parallel, cfg.train
    require(not t.reduce_dtype or p.zero_stage != 0 or (p.tp == 1 and p.pp == 1 and cfg.model.n_experts == 0),
            "train.reduce_dtype", "with zero_stage 0 (DDP) it covers plain data parallel only, not TP, PP or MoE "
            "experts (a rank would refuse it after launch); leave it empty, or use zero_stage 3 (FSDP "
            "reduce-scatters in it)")
    require(p.compile_scope != "model" or whole_graph(cfg), "parallel.compile_scope",
            "'model' compiles the model as one graph, which only one rank without ZeRO or experts allows; "
            "use auto (model where allowed) or blocks")


@register_check
def check_batch(cfg) -> None:
    """The global batch over data-parallel ranks and micro-batches; LoRA's options."""
    p, t = cfg.parallel, cfg.train
    per_step = p.dp * p.microbatches
    require(t.global_batch % per_step == 0, "train.global_batch",
            f"{t.global_batch} is not divisible by dp*microbatches = {p.dp}*{p.microbatches} = {per_step}; "
            f"use a multiple of {per_step}")
    require(t.lora_dropout == 0 or p.tp == 1, "train.lora_dropout",
            "adapter dropout under tensor parallel would draw different masks per tp rank; set it to 0")
    require(t.lora_rank == 0 or bool(t.lora_targets), "train.lora_targets", "name at least one pattern, e.g. layers.*")
