"""``validate(cfg, world_size)``: reject an inconsistent config before any process starts.

One line per problem, naming the field and the fix (ConfigError, exit code 2). This module only
dispatches: the architecture checks its own shape (``ModelSpec.check``), each parallel module
checks its own constraints (``check_config`` in tensor.py, context.py, expert.py,
pipeline/schedule.py, zero.py), and what no single module owns is checked here.
"""
from __future__ import annotations

from ..errors import one_of, require


def whole_graph(cfg) -> bool:
    """Whether ``parallel.compile`` compiles the whole model as one graph (``compile_scope``):
    only where no parallel module hooks into it (one rank: no tp, cp, pp, data parallel, ZeRO or
    experts), so the blocks are not units of anything. Inductor then also fuses the embedding,
    the final norm, the head's casts and the loss, as in a plain ``torch.compile(model)`` loop
    (docs/gpu.md, Single device)."""
    p = cfg.parallel
    alone = p.world_size == 1 and p.zero_stage == 0 and cfg.model.n_experts == 0
    return p.compile_scope != "blocks" and alone


def validate(cfg, world_size: int | None = None) -> None:
    from ..models.spec import get_spec
    from ..parallel import context, expert, recompute, tensor, ulysses, zero
    from ..parallel.pipeline import schedule, sharded
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "microbatches", "pp_virtual"):
        require(getattr(p, name) >= 1, f"parallel.{name}", "must be >= 1")
    if world_size is not None:
        require(p.world_size == world_size, "parallel",
                f"dp_replicate*dp_shard*cp*tp*pp = {p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp}*{p.pp} = "
                f"{p.world_size} but the job has {world_size} processes; set --nproc {p.world_size} "
                f"or change the degrees so their product is {world_size}")
    spec = get_spec(m.arch)  # unknown arch: ConfigError naming model.arch
    _supported(spec, cfg)
    if spec.check is not None:
        spec.check(cfg)
    tensor.check_config(cfg)
    context.check_config(cfg)
    ulysses.check_config(cfg)
    expert.check_config(cfg)
    schedule.check_config(cfg)
    sharded.check_config(cfg)  # MoE and ZeRO/FSDP inside pipeline stages (aux.py, sharded.py)
    zero.check_config(cfg)
    require(not t.reduce_dtype or p.zero_stage != 0 or (p.tp == 1 and p.pp == 1 and m.n_experts == 0),
            "train.reduce_dtype", "with zero_stage 0 (DDP) it covers plain data parallel only, not TP, PP or MoE "
            "experts (a rank would refuse it after launch); leave it empty, or use zero_stage 3 (FSDP "
            "reduce-scatters in it)")
    one_of(p.comm_algorithm, ("backend", "ring", "tree", "rhd", "auto"), "parallel.comm_algorithm")
    one_of(p.activation_checkpointing, recompute.MODES, "parallel.activation_checkpointing")
    require(p.compile_scope != "model" or whole_graph(cfg), "parallel.compile_scope",
            "'model' compiles the model as one graph, which only one rank without ZeRO or experts allows; "
            "use auto (model where allowed) or blocks")
    one_of(t.precision, ("fp32", "fp64", "bf16", "fp16"), "train.precision")
    if spec.task == "lm":
        require(t.seq_len <= m.max_seq_len, "train.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    else:
        from ..train.images import DATASETS
        one_of(cfg.data.dataset, DATASETS, "data.dataset")
        for name in ("limit_train", "limit_test"):
            require(getattr(cfg.data, name) >= 0, f"data.{name}", "must be >= 0 (0 = the whole split)")
    per_step = p.dp * p.microbatches
    require(t.global_batch % per_step == 0, "train.global_batch",
            f"{t.global_batch} is not divisible by dp*microbatches = {p.dp}*{p.microbatches} = {per_step}; "
            f"use a multiple of {per_step}")
    require(t.lora_rank >= 0, "train.lora_rank", "must be >= 0 (0 = no adapters)")
    require(t.lora_dropout == 0 or p.tp == 1, "train.lora_dropout",
            "adapter dropout under tensor parallel would draw different masks per tp rank; set it to 0")
    require(t.lora_rank == 0 or bool(t.lora_targets), "train.lora_targets", "name at least one pattern, e.g. layers.*")
    if t.lora_rank:  # targets that match no linear: found on the meta model, before any rank starts
        from ..models.spec import add_adapters, meta_model
        add_adapters(meta_model(m), t)
    require(t.steps >= 1, "train.steps", "must be >= 1")
    require(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    require(t.lr > 0, "train.lr", "must be > 0")
    one_of(t.device, ("auto", "cpu", "cuda"), "train.device")
    require(0 < cfg.data.val_fraction < 1, "data.val_fraction", "must be between 0 and 1")
    require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")


def _supported(spec, cfg) -> None:
    """Parallelisms the architecture's spec does not provide are refused, naming the field."""
    p, a = cfg.parallel, spec.name
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
