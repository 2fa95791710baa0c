"""Auxiliary losses of stages before the last (MoE load balance and z-loss) in a pipeline.

One process computes ``loss = CE(head(h_L)) + sum over MoE layers of aux_l`` per micro-batch. In
a pipeline the last stage computes the cross-entropy and the aux losses of its own layers (the
model's forward adds them); an earlier stage's aux losses never reach it. Each earlier stage
therefore adds its own: after its forward F the stage's output is replaced by

    out' = AddLoss(out, aux, c)      forward: out' = out (identity)
                                     backward: d out = d out',  d aux = c

with ``c = loss_scale / m``, the weight every micro-batch's loss gets on the last stage. The
stage's B then runs backward from out' with the gradient received from the next stage, and
autograd adds ``c * d aux / d theta`` to the same parameters (router weights, and the inputs of
the stage through the router, so earlier stages receive that part with the activation gradient):
exactly the terms of the one-process gradient, in the same backward call (no extra message).
Split backward (zb-h1) works unchanged: B differentiates out' (aux included) with respect to the
input and the module outputs, W uses those gradients.

The reported loss adds ``aux.detach() / m`` of every earlier stage to the rank's local value; the
pipeline engine's ``global_loss`` sums the ranks over ``pp``.
"""
from __future__ import annotations

import torch


class AddLoss(torch.autograd.Function):
    """Identity on ``out``; the backward gives ``aux`` the constant gradient ``scale``."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale, ctx.aux_like = scale, (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def stage_aux(chunk) -> torch.Tensor | None:
    """The auxiliary losses of the stage's layers from its last forward, or None."""
    aux = chunk.aux_loss() if hasattr(chunk, "aux_loss") else 0.0
    return aux if torch.is_tensor(aux) else None


def attach(chunk, out: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """``out`` carrying the stage's aux losses (weight ``scale``) into its backward, and the
    detached aux value for the report (0.0 without MoE layers)."""
    aux = stage_aux(chunk)
    if aux is None:
        return out, 0.0
    return AddLoss.apply(out, aux, scale), float(aux.detach())
