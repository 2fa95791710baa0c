"""Activation checkpointing (recomputation), applied by parallelize() after TP/EP/CP.

``full``: each block of the architecture (ModelSpec.blocks) keeps only its input; its activations are recomputed in
backward. ``selective`` (Megatron's): only the attention core (scores, softmax, weighted sum:
the large, cheap-to-recompute part) is recomputed; projections and the MLP keep theirs.
``op`` (torchtitan's per-operator policy): each block is checkpointed, but the outputs of its
attention kernel and of every other matrix product (the 1st, 3rd, ... ``mm``/``addmm`` of the
block's forward) are kept; everything else (norms, rotary, activations, the even-numbered
products) is recomputed in backward. :func:`op_keeps` is the rule; the planner's trace applies
the same function (analysis/shadow_ops.py, plan_activations.py).

The wrapper replaces the module's ``forward`` on the instance, so module and parameter names
(checkpoint keys, placements) do not change. Non-reentrant ``torch.utils.checkpoint`` runs
forward hooks again during recomputation, which the FSDP engine relies on to re-gather.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective", "op")
OP_MATMULS = ("mm", "addmm")
"""Operators the ``op`` policy counts as the block's matrix products (a Linear on any input)."""
OP_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
"""Attention kernels whose outputs (output, log-sum-exp) the ``op`` policy keeps."""


def is_product(func) -> bool:
    """Does the ``op`` policy count aten overload ``func`` as a matrix product? The functional
    ``mm``/``addmm`` only: an ``out=`` variant writes into a caller's buffer (the MoE kernels'
    per-expert segments), which a kept copy must not alias."""
    return func.overloadpacket.__name__ in OP_MATMULS and func._overloadname == "default"


def op_keeps(func, matmuls_so_far: int) -> bool:
    """The ``op`` policy: keep the output of aten overload ``func``? ``matmuls_so_far``: the
    block's matrix products (:func:`is_product`) dispatched so far, this one included. Attention
    kernels: kept; matrix products: the odd-numbered ones; anything else: recomputed."""
    if func.overloadpacket.__name__ in OP_ATTENTION:
        return True
    return is_product(func) and matmuls_so_far % 2 == 1


_observers: list = []


@contextlib.contextmanager
def observe_kept(fn):
    """Within: ``fn(tensor)`` for every output the ``op`` policy keeps during a forward (the
    calibration's measurement, analysis/calibrate.py)."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


def _op_policy(counts: dict, ctx, func, *args, **kwargs):
    mode = "recompute" if ctx.is_recompute else "forward"
    if is_product(func):
        counts[mode] += 1
    keep = op_keeps(func, counts[mode])
    if keep and _observers and not ctx.is_recompute:
        outs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
        for fn in _observers:
            for t in outs:
                if isinstance(t, torch.Tensor):
                    fn(t)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def op_contexts():
    """A fresh policy per checkpointed call: the matmul count restarts at each block."""
    return create_selective_checkpoint_contexts(functools.partial(_op_policy, {"forward": 0, "recompute": 0}))


def _wrap(module: nn.Module, per_op: bool = False) -> None:
    inner = module.forward
    extra = {"context_fn": op_contexts} if per_op else {}

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward


def apply(model: nn.Module, mode: str, spec) -> nn.Module:
    """mode: none, full (each of ``spec.blocks(model)``), selective (each of ``spec.attention(model)``)
    or op (each block, with :func:`op_keeps`) (config ``parallel.activation_checkpointing``)."""
    if mode == "none":
        return model
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
    if mode in ("full", "op"):
        targets = list(spec.blocks(model).values())
    else:
        targets = [getattr(owner, attr) for owner, attr in spec.attention(model)]
    checkpoint_modules(targets, mode)
    return model


def checkpoint_modules(modules, mode: str) -> None:
    """Recompute each of ``modules`` in backward: ``full`` keeps only its input, ``op`` also
    the outputs :func:`op_keeps` names (shardlab.initialize applies it to a user model's
    repeated blocks, units.repeated_blocks)."""
    for module in modules:
        _wrap(module, per_op=mode == "op")
