"""LoRA (Hu et al. 2021): ``y = x W^T + b + (alpha / r) * dropout(x) A^T B^T`` on chosen linears,
the base frozen under its own names, adapters ``<linear>.lora_A`` / ``.lora_B``; applied to the
(meta) model before ``parallelize`` (docs/lora.md).
"""
from __future__ import annotations

import math
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-``r`` update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=dev, dtype=dt))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, device=dev, dtype=dt))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(self.dropout(x), self.lora_A),
                                                              self.lora_B) * self.scale


def init_std(name: str, shape) -> float | None:
    """Initial std of an adapter parameter by global name, or None when ``name`` is not one."""
    if name.endswith(".lora_A"):
        return 1.0 / math.sqrt(shape[-1])
    if name.endswith(".lora_B"):
        return 0.0
    return None


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def apply(model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str]) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the ``nn.Linear`` modules whose names match a
    pattern of ``targets`` (fnmatch, e.g. ``layers.*.attention.wq``). Returns the wrapped names."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and any(fnmatchcase(name, t) for t in targets):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, LoRALinear(mod, rank, alpha, dropout))
            wrapped.append(name)
    return wrapped


@torch.no_grad()
def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """The dense weight with the adapter folded in: ``W + scale * B A`` (the product in at least
    float32, float64 for float64 weights)."""
    dt = torch.promote_types(weight.dtype, torch.float32)
    return (weight.to(dt) + scale * (lora_b.to(dt) @ lora_a.to(dt))).to(weight.dtype)
