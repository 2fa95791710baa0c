"""Deferred weight gradients (the W of a split backward) computed directly, without autograd.

B (input gradient) gives, for every parameter-owning module, the gradient ``g`` of its output.
W then needs ``dL/dweight`` from ``g`` and what the module saw in forward. For the modules that
hold most weights this is one expression, so W costs a matmul per module instead of one
autograd call per module (graph task, node walk, accumulate), and B no longer needs to keep
the autograd graph alive for W (it frees it; only the inputs and ``g`` wait):

  nn.Linear      y = x A^T + b      dA = g^T x (rows flattened: one matmul, accumulated into
                                    .grad by the GEMM itself: addmm_), db = sum of g rows
  nn.Embedding   y = A[idx]         dA = index_add of g's rows at idx
  a module with  ``weight_grad(x, g) -> {param name: grad}`` (e.g. the models' RMSNorm)

Any other module (tensor-parallel linears whose forward communicates, LayerNorm, autocast,
parameters with gradient hooks, e.g. an FSDP shard) keeps the autograd path:
``backward(z, g, inputs=its params)``, and then B retains the graph.
"""
from __future__ import annotations

import torch
from torch import nn


def _linear(mod: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight gradient is a plain linear's (subclasses say so, e.g. the
    models' OutputHead, whose padding on CUDA changes no gradient)."""
    return type(mod) is nn.Linear or (isinstance(mod, nn.Linear) and getattr(mod, "plain_linear_grads", False))


def _plain_params(mod: nn.Module) -> bool:
    ps = [p for p in mod.parameters(recurse=False) if p.requires_grad]
    return bool(ps) and all(isinstance(p, nn.Parameter) and p.is_leaf and not p._backward_hooks
                            and getattr(p, "_post_accumulate_grad_hooks", None) is None for p in ps)


def direct_input(mod: nn.Module, args: tuple):
    """The input W will need if ``mod``'s weight gradient can be computed directly, else None."""
    if not args or not torch.is_tensor(args[0]) or not _plain_params(mod):
        return None
    x = args[0]
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return None
    if _linear(mod) and x.dtype == mod.weight.dtype:
        return x.detach()
    if (type(mod) is nn.Embedding and mod.padding_idx is None and mod.max_norm is None
            and not mod.sparse and not x.is_floating_point()):
        return x
    if callable(getattr(mod, "weight_grad", None)):
        return x.detach()
    return None


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.detach()
    else:
        p.grad.add_(g)


def weight_grads(mod: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    """Add ``mod``'s weight gradients for input ``x`` and output gradient ``g`` to ``.grad``."""
    if _linear(mod):
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        w = mod.weight
        if w.requires_grad:
            if w.grad is not None and w.grad.dtype == g2.dtype:
                w.grad.addmm_(g2.t(), x2)  # accumulate inside the GEMM (beta = 1): no separate pass
            else:
                _accumulate(w, g2.t() @ x2)
        if mod.bias is not None and mod.bias.requires_grad:
            _accumulate(mod.bias, g2.sum(0))
    elif type(mod) is nn.Embedding:
        dw = torch.zeros_like(mod.weight)
        dw.index_add_(0, x.reshape(-1), g.reshape(-1, g.shape[-1]).to(dw.dtype))
        _accumulate(mod.weight, dw)
    else:
        params = dict(mod.named_parameters(recurse=False))
        for name, dp in mod.weight_grad(x, g).items():
            if params[name].requires_grad:
                _accumulate(params[name], dp)


def held_bytes(entries: list) -> int:
    """Bytes of the distinct storages one micro-batch holds for its deferred W after B:
    ``entries = [(mod, z, x, g), ...]`` (modules sharing an input, e.g. wq/wk/wv, count it once)."""
    seen, total = set(), 0
    for entry in entries:
        for t in entry[2:]:
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total
