"""The one place that composes parallel modules, in a fixed order:

    TP(+SP) -> EP -> CP -> activation checkpointing / compile -> PP -> ZeRO/FSDP or DDP

(Checkpointing and compile wrap each block in place; pipeline stages are views over the same
blocks, so wrapping before the split equals wrapping after it, and the stages never need
rebuilding.) What each step needs to know about the model (its TP plan, blocks, attention cores,
pipeline ends, initialiser) comes from the architecture's ModelSpec (models/spec.py).

``parallelize(model, mesh, cfg)`` returns an Engine (parallel/engine.py): what the train loop drives.
"""
from __future__ import annotations

from torch import nn

from .config import whole_graph
from .distributed.mesh import Mesh
from .models.spec import get_spec
from .parallel.engine import Engine
from .parallel.materialize import materialize, model_init_fn


def parallelize(model: nn.Module, mesh: Mesh, cfg, init: bool = True) -> Engine:
    """Apply the parallelisms the config asks for, in the fixed order of the module doc.

    ``model`` may be on the meta device (``models.spec.meta_model``): every parallel module
    then works on meta tensors and, once placements are decided, each rank materialises only
    what it owns (parallel/materialize.py; FSDP its flat shards). ``init=False`` skips drawing
    the initial values (a checkpoint is loaded next)."""
    p = cfg.parallel
    spec = get_spec(cfg.model)
    init_fn = model_init_fn(cfg.model, cfg.train.seed)

    def own(m):  # materialise this rank's boxes of whatever is still on meta
        return materialize(m, init_fn, mesh.device, init)
    if p.tp > 1:
        from .parallel import tensor
        tensor.apply(model, mesh, cfg, spec.tp_plan)
    if cfg.model.n_experts > 0:  # EP: experts over ep, batch-wide MoE aux losses over dp_cp
        from .parallel import expert
        model = expert.apply(model, mesh, cfg)
    cp_shard = None
    if p.cp > 1:  # CP: ring attention; each rank keeps its load-balanced shard of every sequence
        from .parallel import context
        from .parallel import ulysses
        model = (ulysses if p.cp_impl != "ring" else context).apply(model, mesh, cfg, spec.attention(model))
        cp_shard = lambda x, y: context.shard_batch(x, y, mesh)  # noqa: E731
    # Activation checkpointing and compile wrap whole blocks in place (names unchanged).
    from .parallel import recompute
    recompute.apply(model, p.activation_checkpointing, spec)
    if p.compile:  # communication inside a compiled block runs eagerly from now on (distributed/eager.py)
        from .distributed.eager import prepare
        prepare()
    if p.compile and whole_graph(cfg):
        model.compile()  # one graph: embedding, blocks, head and loss (a plain torch.compile(model) loop's)
    elif p.compile:
        for block in spec.blocks(model).values():
            block.compile()
        _compile_loss(model, p)
    if p.pp > 1:  # after TP/EP/CP; gradients averaged over dp_cp, or ZeRO/FSDP inside the stages
        from .parallel.pipeline import apply as pipeline
        if p.zero_stage:  # stage-local sharding (pipeline/sharded.py); ZeRO-3 draws only its slices
            from functools import partial
            from .parallel.pipeline.sharded import ShardedPipelineEngine
            make = partial(ShardedPipelineEngine, init_fn=init_fn if init else None)
            keep = (lambda m: materialize(m, init_fn, mesh.device, init, frozen_only=True)) if p.zero_stage == 3 else own
            engine = pipeline(model, mesh, cfg, spec, materialize=keep, make_engine=make)
        else:
            engine = pipeline(model, mesh, cfg, spec, materialize=own)
    else:  # last: how data-parallel ranks share model state (parallel/ddp.py, zero.py, fsdp.py)
        from .parallel import ddp, fsdp, units, zero
        if p.zero_stage == 3:
            materialize(model, init_fn, mesh.device, init, frozen_only=True)  # frozen (LoRA base): replicated
            engine = fsdp.apply(model, mesh, cfg, units.wrap_policy(model, p.wrap_policy, spec),
                               init_fn=init_fn if init else None)
        else:
            own(model)
            if p.zero_stage in (1, 2):
                engine = zero.apply(model, mesh, cfg)
            elif mesh.size("dp_cp") > 1:
                engine = ddp.apply(model, mesh, cfg)
            else:
                engine = Engine(model, mesh, cfg)
    engine.shard_batch = cp_shard
    return engine


def _compile_loss(model: nn.Module, p) -> None:
    """``parallel.compile`` also compiles the model's loss module (``criterion``, the convention
    of the shipped architectures): its cross-entropy then runs as fused kernels instead of eager
    passes over the (tokens x vocab) logits (their fp32 copy, the log-softmax and its gradient:
    3.3 GB each for GPT-2 at 16 x 1024 tokens). Under tensor parallel the criterion is the
    vocabulary-parallel one, whose collectives stay eager."""
    loss = getattr(model, "criterion", None)
    if isinstance(loss, nn.Module) and p.tp == 1:
        loss.compile()

