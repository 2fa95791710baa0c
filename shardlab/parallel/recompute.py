"""Activation checkpointing (recomputation), applied by parallelize() after TP/EP/CP.

``full``: each block of the architecture (ModelSpec.blocks) keeps only its input; its activations are recomputed in
backward. ``selective`` (Megatron's): only the attention core (scores, softmax, weighted sum:
the large, cheap-to-recompute part) is recomputed; projections and the MLP keep theirs.

The wrapper replaces the module's ``forward`` on the instance, so module and parameter names
(checkpoint keys, placements) do not change. Non-reentrant ``torch.utils.checkpoint`` runs
forward hooks again during recomputation, which the FSDP engine relies on to re-gather.
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


def _wrap(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply(model: nn.Module, mode: str, spec) -> nn.Module:
    """mode: none, full (each of ``spec.blocks(model)``) or selective (each of ``spec.attention(model)``)
    (config ``parallel.activation_checkpointing``)."""
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing must be none, full or selective, got {mode!r}")
    if mode == "full":
        targets = list(spec.blocks(model).values())
    else:
        targets = [getattr(owner, attr) for owner, attr in spec.attention(model)]
    for module in targets:
        _wrap(module)
    return model
