"""Materialise a model built on the meta device: each rank creates only the tensors it owns.

``parallelize`` runs TP, EP, CP and the pipeline split on the meta model: they replace global
parameters by meta parameters of their local shape and attach a Placement (which box of which
global tensor the local tensor is). :func:`materialize` then gives every remaining meta
parameter its storage, filled with exactly its box of the global initial value
(models/init.py streams it: no full copy of a sharded tensor ever exists on the rank). ZeRO-3 /
FSDP does not call this: it builds its flat shards from the meta parameters directly
(parallel/fsdp.py, :func:`init_flat_range`).

``init=False`` allocates without drawing (the values come from a checkpoint next).
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.placement import get_placement
from ..distributed.regions import flat_boxes, placement_box, sub_box


def _sites(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(param) -> every (module, attribute) holding it (two for tied embeddings)."""
    out: dict[int, list] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, attr))
    return out


def local_value(init_fn, name: str, p: torch.Tensor, device, offsets=None, sizes=None, init=True) -> torch.Tensor:
    """The local tensor of parameter ``p`` (meta, with its Placement), or the local box
    ``[offsets, offsets+sizes)`` of it: padding rows (beyond the global size) are zeros."""
    pl = get_placement(p, name)
    local_shape = tuple(p.shape)
    offsets = (0,) * p.dim() if offsets is None else tuple(offsets)
    sizes = local_shape if sizes is None else tuple(sizes)
    out = torch.zeros(sizes, dtype=p.dtype, device=device)
    outer = placement_box(pl, local_shape)
    # the valid part of the requested local box, in global coordinates
    lo = list(offsets)
    hi = [o + s for o, s in zip(offsets, sizes)]
    if pl.dim is not None:
        hi[pl.dim] = min(hi[pl.dim], outer[1][pl.dim])
    if any(h <= l for l, h in zip(lo, hi)) and p.dim() > 0:
        return out
    want = sub_box(outer, (tuple(lo), tuple(h - l for l, h in zip(lo, hi))))
    if init:
        value = init_fn(pl.name, pl.global_shape, want[0], want[1], p.dtype, device)
    else:
        value = torch.empty(want[1], dtype=p.dtype, device=device)
    out[tuple(slice(0, s) for s in want[1])] = value
    return out


def init_flat_range(init_fn, name: str, p: torch.Tensor, lo: int, hi: int, device, init=True) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened local tensor of meta parameter ``p`` (1-D)."""
    parts = [local_value(init_fn, name, p, device, o, s, init).reshape(-1) for o, s in flat_boxes(p.shape, lo, hi)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=p.dtype, device=device)


@torch.no_grad()
def materialize(model: nn.Module, init_fn, device, init: bool = True, frozen_only: bool = False) -> nn.Module:
    """Replace every meta parameter by a real one holding this rank's box (placement kept).
    ``init_fn(name, global_shape, offsets, sizes, dtype, device)`` draws a box of a global tensor.
    ``frozen_only``: only parameters that do not require gradients (FSDP shards the others itself)."""
    sites = _sites(model)
    done: set[int] = set()
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if not p.is_meta or id(p) in done or (frozen_only and p.requires_grad):
            continue
        done.add(id(p))
        new = nn.Parameter(local_value(init_fn, name, p, device, init=init), requires_grad=p.requires_grad)
        pl = getattr(p, "_shardlab_placement", None)
        if pl is not None:
            new._shardlab_placement = pl
        for mod, attr in sites[id(p)]:
            mod._parameters[attr] = new
    for mod in model.modules():
        for key, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                raise RuntimeError(f"materialize: buffer {key} of {type(mod).__name__} is on the meta device "
                                   "and has no initialiser; register it in the model's init")
    return model


def model_init_fn(model_cfg, seed: int):
    """The configured architecture's initialiser as an ``init_fn`` for :func:`materialize`."""
    from ..models.spec import init_tensor

    def fn(name, global_shape, offsets, sizes, dtype, device):
        return init_tensor(name, global_shape, model_cfg, seed, dtype, offsets, sizes, device)
    return fn
