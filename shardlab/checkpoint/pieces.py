"""An engine's state in global coordinates: the pieces it writes, and loading from any layout.

Saving: every rank lists :class:`~shardlab.distributed.regions.Piece` s -- boxes of global
tensors (``model.<name>``, ``optim.<name>.<state>``) -- for the parameters and optimizer states it
holds; of identical replicas only one rank lists a piece (:func:`writes_piece`). Loading: every
rank asks a *reader* (checkpoint/save.Reader, or :class:`DictReader` over global tensors) for
exactly the boxes it needs, so a checkpoint written under one layout loads under any other and no
rank reads more than it holds.

Two shapes of engine state:
* per parameter (replicated engine, DDP, TP, PP, EP): a local tensor is one box (its placement);
* flat shards (ZeRO-1/2/3): a rank's slice of a flat buffer covers a flat element range of
  several local parameters, each cut into boxes by :func:`flat_boxes`.
"""
from __future__ import annotations

import math

import torch

from ..distributed.placement import get_placement
from .reader import TensorSource
from ..distributed.regions import Piece, flat_boxes, intersect, placement_box, sub_box, writes_piece


class DictReader:
    """The reader interface over a dict of global tensors (``load_full_state``)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def keys(self):
        return list(self.state)

    def has(self, key: str) -> bool:
        return key in self.state

    def global_shape(self, key: str) -> tuple:
        return tuple(self.state[key].shape)

    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor:
        t = self.state[key]
        if offsets is not None:
            t = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return t.to(dtype) if dtype is not None else t


class WithInitial:
    """A reader that supplies the initial values of parameters the checkpoint lacks, for the
    names in ``shapes`` ({global name: global shape}, e.g. LoRA adapters added on top of a base
    checkpoint); everything else reads through to ``reader``. ``init_fn(name, global_shape,
    offsets, sizes, dtype, device)`` draws a box (parallel/materialize.py)."""

    def __init__(self, reader, init_fn, shapes: dict[str, tuple]):
        self.reader, self.init_fn = reader, init_fn
        self.initial = {f"model.{n}": tuple(sh) for n, sh in shapes.items() if not reader.has(f"model.{n}")}

    def __getattr__(self, name):  # meta, step, world_size, ... of the wrapped reader
        return getattr(self.reader, name)

    def keys(self):
        return list(self.reader.keys()) + list(self.initial)

    def has(self, key: str) -> bool:
        return key in self.initial or self.reader.has(key)

    def global_shape(self, key: str) -> tuple:
        return self.initial[key] if key in self.initial else self.reader.global_shape(key)

    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor:
        if key not in self.initial:
            return self.reader.read(key, offsets, sizes, dtype)
        shape = self.initial[key]
        offsets = (0,) * len(shape) if offsets is None else offsets
        sizes = shape if sizes is None else sizes
        return self.init_fn(key[len("model."):], shape, offsets, sizes, dtype or torch.float32, "cpu")


def _check(reader, key: str, global_shape) -> None:
    if not reader.has(key):
        raise RuntimeError(f"checkpoint has no tensor {key} (saved from another model?)")
    got = tuple(reader.global_shape(key))
    if got != tuple(global_shape):
        raise RuntimeError(f"checkpoint: {key} has shape {got}, this model expects {tuple(global_shape)} "
                           "(a different model shape?)")


def model_mismatch(reader, cfg) -> str | None:
    """Why the checkpoint of ``reader`` cannot load into the model of config ``cfg`` (its LoRA
    adapters included), found in the parent before any rank starts (else a rank fails inside
    ``load_param_pieces``): another architecture, or the first parameter both have whose global
    shapes differ, with the saved fields that differ. None when they agree."""
    from ..models.spec import add_adapters, meta_model
    saved = reader.meta.get("config") or {}
    differ = ", ".join([f"{k}={v!r}" for k, v in (saved.get("model") or {}).items() if getattr(cfg.model, k, v) != v]
                       + [f"train.{k}={v!r}" for k, v in (saved.get("train") or {}).items()
                          if k.startswith("lora_") and getattr(cfg.train, k, v) != v])
    arch = (saved.get("model") or {}).get("arch", cfg.model.arch)
    if arch != cfg.model.arch:
        return f"it holds a {arch} model, this config a {cfg.model.arch} ({differ})"
    model = meta_model(cfg.model)
    if cfg.train.lora_rank:
        add_adapters(model, cfg.train)
    params = dict(model.named_parameters())
    adapter = (".lora_A", ".lora_B")
    saved_lora = sorted(k for k in reader.keys() if k.startswith("model.") and k.endswith(adapter))
    mine_lora = [n for n in params if n.endswith(adapter)]
    if saved_lora and not mine_lora:  # a LoRA run resumed as a full one would drop its adapters, silently
        return f"it holds LoRA adapters ({saved_lora[0]}, ...), this run none" + (f"; it was saved with {differ}"
                                                                                   if differ else "")
    # (adapters added to a checkpoint without them is a documented start: docs/lora.md, base checkpoint)
    saved_with = f"; it was saved with {differ}" if differ else ""
    for name, p in params.items():
        key = f"model.{name}"
        if reader.has(key) and tuple(reader.global_shape(key)) != tuple(p.shape):
            return f"{key} is {tuple(reader.global_shape(key))} there, {tuple(p.shape)} in this model" + saved_with
    # Fewer layers, an untied head, ... would load what both have and drop the rest, silently (and
    # the next saves prune the checkpoints that held it); more would fail inside a rank.
    mine = {f"model.{n}" for n in params if not n.endswith(adapter)}
    theirs = {k for k in reader.keys() if k.startswith("model.") and not k.endswith(adapter)}
    missing = [] if reader.meta.get("base") else sorted(mine - theirs)  # adapter-only: the rest is its base's
    for what, keys, other in (("this model has", missing, "the checkpoint"),
                              ("it holds", sorted(theirs - mine), "this model")):
        if keys:
            extra = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            return f"{what} {keys[0]}{extra}, {other} not" + saved_with
    m = saved.get("model") or {}
    if "n_heads" in m and (m["n_heads"], m.get("n_kv_heads") or m["n_heads"]) != \
            (cfg.model.n_heads, cfg.model.n_kv_heads or cfg.model.n_heads):  # the same shapes, other heads
        return f"the same shapes cut into other heads ({differ})"
    rope = ("rope_factor", "rope_low_freq", "rope_high_freq", "rope_original_len") \
        if m.get("rope_scaling", "none") != "none" else ()
    other = [k for k in (*SAME_FUNCTION, *rope) if k in m and getattr(cfg.model, k, m[k]) != m[k]]
    if other:  # the same tensors, another function of them
        return "the same tensors computed another way: " + ", ".join(
            f"{k}={m[k]!r} there, {getattr(cfg.model, k)!r} here" for k in other)
    return None


SAME_FUNCTION = ("rope_theta", "rope_scaling", "norm_eps", "moe_top_k", "moe_node_groups", "moe_max_nodes")
"""Model fields that leave every tensor's shape alone and change what the model computes: a
resume must keep them (the shapes compare the rest; dropout, max_seq_len, the attention and
expert kernels and the MoE loss weights may change; docs/training.md)."""


def optim_keys(reader, name: str) -> list[str]:
    """The optimizer-state names saved for global parameter ``name`` (e.g. exp_avg, step)."""
    prefix = f"optim.{name}."
    return sorted(k[len(prefix):] for k in reader.keys() if k.startswith(prefix) and "." not in k[len(prefix):])


def _state_device(v_dim: int, p: torch.Tensor):
    """Optimizer state lives with its parameter; AdamW's scalar ``step`` stays on the CPU except
    for the fused CUDA kernel, which wants it on the GPU."""
    return p.device if v_dim > 0 or p.device.type == "cuda" else torch.device("cpu")


# -- per-parameter engines ---------------------------------------------------------------------

def param_pieces(named, optimizer, mesh, replicate_groups) -> list[Piece]:
    """``named``: (name, local parameter); ``replicate_groups(placement)`` -> group names over
    which that parameter is replicated."""
    out = []
    for name, p in named:
        pl = get_placement(p, name)
        if not writes_piece(pl, mesh, replicate_groups(pl)):
            continue
        offsets, _ = placement_box(pl, p.shape)
        out.append(Piece(f"model.{pl.name}", tuple(pl.global_shape), offsets, pl.valid(p.detach())))
        for k, v in (optimizer.state.get(p, {}) if optimizer is not None else {}).items():
            if not torch.is_tensor(v):
                continue
            if v.shape == p.shape and v.dim() > 0:
                out.append(Piece(f"optim.{pl.name}.{k}", tuple(pl.global_shape), offsets, pl.valid(v.detach())))
            else:
                out.append(Piece(f"optim.{pl.name}.{k}", tuple(v.shape), (0,) * v.dim(), v.detach()))
    return out


def fill(reader, key: str, offsets, sizes, out: torch.Tensor) -> None:
    """``out[...] = reader.read(key, offsets, sizes)``, read straight into ``out`` when the
    reader's class offers ``read_into`` (checkpoint/save.Reader: one copy, checksummed while
    read). Looked up on the class, not the instance: a wrapping reader whose ``__getattr__``
    forwards to the reader it wraps (LoRA merging, initial values) must go through its ``read``."""
    read_into = getattr(type(reader), "read_into", None)
    if read_into is not None:
        read_into(reader, key, offsets, sizes, out)
    else:
        out.copy_(reader.read(key, offsets, sizes, out.dtype))


def _read_local(reader, key, pl, local_shape, dtype, device) -> torch.Tensor:
    """The local tensor for placement ``pl`` from ``reader`` (padding zero-filled)."""
    offsets, sizes = placement_box(pl, local_shape)
    part = reader.read(key, offsets, sizes, dtype)
    if tuple(sizes) == tuple(local_shape):
        return part.to(device)
    out = torch.zeros(local_shape, dtype=dtype, device=device)
    out[tuple(slice(0, s) for s in sizes)] = part
    return out


def _load_local(reader, key, pl, target: torch.Tensor) -> None:
    """Fill local tensor ``target`` for placement ``pl``: straight into it when the whole local
    box is valid and ``target`` is a contiguous CPU tensor, else through ``_read_local``."""
    offsets, sizes = placement_box(pl, target.shape)
    if tuple(sizes) == tuple(target.shape) and target.device.type == "cpu" and target.is_contiguous():
        fill(reader, key, offsets, sizes, target)
    else:
        target.copy_(_read_local(reader, key, pl, target.shape, target.dtype, target.device))


@torch.no_grad()
def load_param_pieces(named, reader: TensorSource, optimizer) -> None:
    for name, p in named:
        pl = get_placement(p, name)
        key = f"model.{pl.name}"
        _check(reader, key, pl.global_shape)
        _load_local(reader, key, pl, p.data)
        if optimizer is None or not p.requires_grad:  # a frozen parameter has no optimizer state
            continue
        st, old = {}, optimizer.state.get(p, {})
        for k in optim_keys(reader, pl.name):
            shape = tuple(reader.global_shape(f"optim.{pl.name}.{k}"))
            if shape == tuple(pl.global_shape) and shape:
                buf = old.get(k)  # the optimizer's own buffer, filled in place when it has one
                if not (torch.is_tensor(buf) and buf.shape == p.shape and buf.dtype == p.dtype):
                    buf = torch.empty_like(p.data)
                _load_local(reader, f"optim.{pl.name}.{k}", pl, buf)
                st[k] = buf
            else:
                v = reader.read(f"optim.{pl.name}.{k}")
                st[k] = v.to(_state_device(v.dim(), p), copy=True)
        if st:
            optimizer.state[p] = st


# -- flat shards (ZeRO-1/2/3) ----------------------------------------------------------------------

def _segments(f, lo: int, hi: int):
    """For flat buffer range [lo, hi): per parameter i overlapping it, (i, placement, global box,
    start in the range, valid sub-box offsets inside the local box, local box sizes)."""
    for i, (pl, shape, o, n) in enumerate(zip(f.placements, f.shapes, f.offsets, f.numels)):
        a, b = max(o, lo), min(o + n, hi)
        if a >= b:
            continue
        outer = placement_box(pl, shape)
        valid_local = ((0,) * len(shape), outer[1])
        pos = a - lo
        for lbox in flat_boxes(shape, a - o, b - o):
            size = math.prod(lbox[1])
            keep = intersect(lbox, valid_local)
            if keep is not None:
                inner = tuple(slice(k - l, k - l + s) for k, l, s in zip(keep[0], lbox[0], keep[1]))
                yield i, pl, sub_box(outer, keep), pos, size, lbox[1], inner
            pos += size


def flat_pieces(f, values: dict[str, torch.Tensor], mesh, replicate_groups, lo: int, hi: int) -> list[Piece]:
    """Pieces of flat buffer ``f``'s range [lo, hi), for each named 1-D tensor of that range
    (``{"model": shard, "optim.exp_avg": ...}``)."""
    out = []
    for i, pl, gbox, pos, size, lsizes, inner in _segments(f, lo, hi):
        if not writes_piece(pl, mesh, replicate_groups):
            continue
        for kind, flat in values.items():
            key = f"model.{pl.name}" if kind == "model" else f"optim.{pl.name}.{kind[len('optim.'):]}"
            box = flat.detach()[pos:pos + size].view(lsizes)[inner]
            out.append(Piece(key, tuple(pl.global_shape), gbox[0], box))
    return out


@torch.no_grad()
def load_flat_range(f, reader: TensorSource, kind: str, target: torch.Tensor, lo: int, hi: int) -> None:
    """Fill ``target`` (the flat buffer's range [lo, hi), 1-D) from ``reader``; padding -> 0.
    A segment that is a whole valid box of a CPU buffer is read straight into it (``fill``);
    only what no segment fills whole is zeroed first."""
    direct = target.device.type == "cpu" and target.is_contiguous()
    segments = list(_segments(f, lo, hi))
    whole = [direct and tuple(gbox[1]) == tuple(lsizes) for _, _, gbox, _, _, lsizes, _ in segments]
    gap = 0
    for (_, _, _, pos, size, _, _), w in sorted(zip(segments, whole), key=lambda sw: sw[0][3]):
        if w:
            target[gap:pos].zero_()
            gap = pos + size
        # a partial segment's padding is zeroed by the gap before the next whole one
    target[gap:].zero_()
    for (i, pl, gbox, pos, size, lsizes, inner), w in zip(segments, whole):
        key = f"model.{pl.name}" if kind == "model" else f"optim.{pl.name}.{kind}"
        _check(reader, key, pl.global_shape)
        if w:
            fill(reader, key, gbox[0], gbox[1], target[pos:pos + size].view(lsizes))
            continue
        part = reader.read(key, gbox[0], gbox[1], target.dtype).to(target.device)
        target[pos:pos + size].view(lsizes)[inner] = part
