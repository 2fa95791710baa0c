"""Sharded checkpoints: every rank writes the pieces it owns, rank 0 publishes an index.

One checkpoint ``<dir>/step_00000100/``::

    rank_00000.safetensors   this rank's pieces (boxes of global tensors) + its extra tensors (RNG)
    rank_00000.json          what rank 0 wrote: per piece key, global shape, offsets, sizes, dtype,
                             name in the file, crc32; the extra names; the file size
    ...
    index.json               written last: step, world size, meta, per key the pieces that cover it

Saving (the caller barriers between the phases)::

    rank 0: staging = prepare(dir, step)           # <dir>/.tmp-step_00000100, emptied
    every rank: write_rank(staging_dir(dir, step), rank, pieces, extra)
    rank 0: commit(dir, step, world_size, meta)    # index.json, fsync, rename, prune

A crash at any point before the rename leaves only a hidden ``.tmp-`` directory, which is
never listed; the previous checkpoints are untouched. Loading under any layout: ``Reader``
(reader.py) reads only the slices that intersect the box a rank asks for. Nothing is ever
unpickled: tensors come from safetensors, the rest from JSON. Docs: docs/checkpoints.md.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from typing import Callable, NamedTuple

import torch

from .format import CheckpointError, Piece, SafetensorsWriter, dtype_name, flat_boxes, fsync_path, plan_cover
from .reader import Reader

__all__ = ["CheckpointError", "Deferred", "Piece", "PREFIX", "staging_dir", "prepare", "write_rank", "commit",
           "remove_interrupted", "finish_saves",
           "list_checkpoints", "latest_valid", "Reader", "flat_boxes", "rng_tensors", "restore_rng"]

PREFIX = "step_"
INDEX = "index.json"
FORMAT = "shardlab-sharded-1"
_STEP_RE = re.compile(r"^step_\d{8}$")


def _step_name(step: int) -> str:
    return f"{PREFIX}{int(step):08d}"


def rank_file(rank: int, suffix: str) -> str:
    return f"rank_{int(rank):05d}.{suffix}"


def staging_dir(directory, step: int) -> Path:
    """The hidden directory where checkpoint ``step`` is written before it is published."""
    return Path(directory) / f".tmp-{_step_name(step)}"


def prepare(directory, step: int) -> Path:
    """Rank 0, before any rank writes: an empty staging directory (a stale one is removed)."""
    staging = staging_dir(directory, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def remove_interrupted(directory) -> list[Path]:
    """Before a run starts (rank 0): clean up after saves that were interrupted (a killed job).
    Staging directories (``.tmp-step_*``) are removed; a ``.old-step_*`` left by a crash in the
    middle of re-saving a step is removed when its step directory exists, else renamed back
    (it is then the only copy). Returns the removed paths."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = []
    for old in sorted(root.glob(f".old-{PREFIX}*")):
        final = root / old.name[len(".old-"):]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
        else:
            os.replace(old, final)
    for staging in sorted(root.glob(f".tmp-{PREFIX}*")):
        shutil.rmtree(staging, ignore_errors=True)
        removed.append(staging)
    if removed:
        fsync_path(root)
    return removed


def _dumps(obj: dict) -> str:
    """JSON with one line per top-level entry and per entry of a nested dict or list (readable
    and compact: one line per key, piece or rank)."""
    def block(v, pad):
        if isinstance(v, dict) and v:
            return "{\n" + ",\n".join(f"{pad} {json.dumps(k)}: {json.dumps(x)}" for k, x in v.items()) + f"\n{pad}}}"
        if isinstance(v, list) and v:
            return "[\n" + ",\n".join(f"{pad} {json.dumps(x)}" for x in v) + f"\n{pad}]"
        return json.dumps(v)
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {block(v, ' ')}" for k, v in obj.items()) + "\n}\n"


def _write_json(path: Path, obj: dict) -> None:
    """Write JSON under a temporary name, fsync, rename: readers never see half a file."""
    tmp = path.with_name(path.name + ".part")
    with tmp.open("w") as fh:
        fh.write(_dumps(obj))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Deferred(NamedTuple):
    """A piece's tensor produced only when it is written (a streaming import holds one at a time)."""
    shape: tuple
    """The box's sizes."""
    dtype: torch.dtype
    """The tensor's dtype."""
    load: Callable[[], torch.Tensor]
    """Returns the tensor (``shape``, ``dtype``)."""


def write_rank(staging: Path, rank: int, pieces: list[Piece], extra: dict[str, torch.Tensor],
               progress: str = "") -> None:
    """Every rank: write ``rank_NNNNN.safetensors`` (pieces + extra tensors) and ``rank_NNNNN.json``
    (written after the data is fsynced, so its presence means this rank finished). Tensors may
    be on any device; they are copied to the host one at a time. A piece's tensor may be a
    :class:`Deferred`, loaded when written. No collective. ``progress``: a label for a bar on a
    terminal's stderr (``shardlab checkpoint import``; SafetensorsWriter)."""
    staging = Path(staging)
    specs, entries = [], []
    for i, p in enumerate(pieces):
        gshape, offs = tuple(int(s) for s in p.global_shape), tuple(int(o) for o in p.offsets)
        sizes = tuple(p.tensor.shape)
        if len(offs) != len(gshape) or len(sizes) != len(gshape) or \
                any(o < 0 or o + s > g for o, s, g in zip(offs, sizes, gshape)):
            raise ValueError(f"checkpoint piece {p.key}: box offsets {offs} sizes {sizes} does not fit "
                             f"global shape {gshape}")
        name = f"p{i}.{p.key}"
        specs.append((name, p.tensor.dtype, sizes))
        entries.append({"key": p.key, "global_shape": list(gshape), "offsets": list(offs),
                        "sizes": list(sizes), "dtype": dtype_name(p.tensor.dtype), "name": name})
    for name, t in extra.items():
        if re.match(r"^p\d+\.", name):
            raise ValueError(f"checkpoint extra tensor {name!r}: names p<N>.* are reserved for pieces")
        dtype_name(t.dtype)
        specs.append((name, t.dtype, tuple(t.shape)))
    path = staging / rank_file(rank, "safetensors")
    writer = SafetensorsWriter(path, specs, {"format": FORMAT, "rank": rank}, progress)
    try:
        for p, e in zip(pieces, entries):
            t = p.tensor.load() if isinstance(p.tensor, Deferred) else p.tensor
            if tuple(t.shape) != tuple(e["sizes"]) or t.dtype != p.tensor.dtype:
                raise ValueError(f"checkpoint piece {p.key}: deferred tensor is {t.dtype} {tuple(t.shape)}, "
                                 f"declared {p.tensor.dtype} {tuple(e['sizes'])}")
            e["crc32"] = writer.write(e["name"], t)
        extras = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "crc32": writer.write(name, t)}
                  for name, t in extra.items()}
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    _write_json(staging / rank_file(rank, "json"),
                {"rank": rank, "file": path.name, "size": size, "pieces": entries, "extra": extras})


def _check_covered(key: str, info: dict) -> None:
    boxes = sorted({(tuple(p["offsets"]), tuple(p["sizes"])) for p in info["pieces"]})
    _, hole = plan_cover((0,) * len(info["global_shape"]), info["global_shape"], boxes)
    if hole is not None:
        raise CheckpointError(f"checkpoint {key}: no rank saved the box at offsets {hole[0]} sizes {hole[1]} "
                              f"of global shape {tuple(info['global_shape'])}; fix the engine's pieces")


def commit(directory, step: int, world_size: int, meta: dict, keep: int = 3) -> Path:
    """Rank 0, after every rank has written: index.json last, fsync, atomic rename to
    ``<dir>/step_NNNNNNNN`` (an existing one is replaced), prune to the newest ``keep``."""
    root = Path(directory)
    staging = staging_dir(root, step)
    keys: dict[str, dict] = {}
    ranks = []
    for r in range(world_size):
        rj = staging / rank_file(r, "json")
        if not rj.exists():
            raise CheckpointError(f"{rj}: missing: rank {r} did not finish writing step {step}; "
                                  "call commit only after every rank's write_rank (barrier)")
    for r in range(world_size):
        rj = staging / rank_file(r, "json")
        info = json.loads(rj.read_text())
        data = staging / info["file"]
        if not data.exists() or data.stat().st_size != info["size"]:
            raise CheckpointError(f"{data}: missing or not the size rank {r} recorded; save the step again")
        ranks.append({"rank": r, "file": info["file"], "size": info["size"], "extra": info["extra"]})
        for p in info["pieces"]:
            k = keys.setdefault(p["key"], {"global_shape": p["global_shape"], "dtype": p["dtype"], "pieces": []})
            if (k["global_shape"], k["dtype"]) != (p["global_shape"], p["dtype"]):
                raise CheckpointError(f"{rj}: {p['key']} saved as {p['dtype']} {p['global_shape']} here but "
                                      f"{k['dtype']} {k['global_shape']} by another rank; fix the engine's pieces")
            k["pieces"].append({"file": info["file"], "name": p["name"], "offsets": p["offsets"],
                                "sizes": p["sizes"], "crc32": p["crc32"]})
    for key, info in keys.items():
        _check_covered(key, info)
    index = {"format": FORMAT, "step": int(step), "world_size": int(world_size), "meta": meta,
             "keys": dict(sorted(keys.items())), "ranks": ranks}
    _write_json(staging / INDEX, index)
    fsync_path(staging)
    final = root / _step_name(step)
    if final.exists():  # re-saving the same step (e.g. after a resume): swap, then delete the old one
        old = root / f".old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        fsync_path(root)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    fsync_path(root)
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(f".tmp-{PREFIX}*"):  # staging dirs of saves that crashed earlier
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def save(directory, step: int, mesh, pieces: Callable[[], list], meta: Callable[[], dict], device,
         keep: int = 3, on_commit: Callable[[], None] | None = None) -> Path | None:
    """The whole save protocol, collective over ``mesh``'s world: rank 0 prepares the staging
    directory, every rank writes its ``pieces()`` and RNG states, rank 0 writes the index with
    ``meta()``, commits atomically and then calls ``on_commit``. Only barriers synchronise.
    Returns the path on rank 0. (checkpoint/async_save.save has the same signature and returns
    once this rank's pieces are in host memory; call :func:`finish_saves` at the end.)"""
    finish_saves(mesh)  # an asynchronous save still in flight (async_save switched off mid-run)
    world = mesh.comm("world")
    if mesh.rank == 0:
        prepare(directory, step)
    world.barrier()
    write_rank(staging_dir(directory, step), mesh.rank, pieces(), rng_tensors(device))
    world.barrier()
    path = commit(directory, step, mesh.world_size, meta(), keep=keep) if mesh.rank == 0 else None
    if path is not None and on_commit is not None:
        on_commit()
    world.barrier()
    return path


IN_FLIGHT: list[Callable] = []
"""``finish(mesh)`` of the saver that has saves in flight (checkpoint/async_save.py registers its own
at its first save: this module does not import it)."""


def finish_saves(mesh) -> None:
    """Collective, at the end of training: wait for the asynchronous save in flight and raise
    (on every rank) if it failed on any. A no-op where no asynchronous save was started."""
    for finish in IN_FLIGHT:
        finish(mesh)


def list_checkpoints(directory) -> list[Path]:
    """Published checkpoints (``step_NNNNNNNN``; staging dirs excluded), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name))


def latest_valid(directory, warn=print) -> Path | None:
    """The newest checkpoint whose index parses and whose files exist with the recorded sizes
    (no tensor data is read); damaged newer ones are reported through ``warn``."""
    for path in reversed(list_checkpoints(directory)):
        try:
            Reader(path).close()
            return path
        except CheckpointError as e:
            warn(f"shardlab: skipping damaged checkpoint: {e}")
    return None


# -- RNG state as tensors ----------------------------------------------------------------------

def rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states as uint8 tensors, for ``write_rank(..., extra=...)``."""
    out = {"rng.cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        out["rng.cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng(tensors: dict[str, torch.Tensor | None], device: torch.device) -> bool:
    """Restore RNG states saved by ``rng_tensors`` (e.g. ``{n: reader.extra(rank, n) for n in ...}``).
    Returns False when the CPU state is absent (e.g. the world size changed)."""
    if tensors.get("rng.cpu") is None:
        return False
    torch.set_rng_state(tensors["rng.cpu"])
    if torch.device(device).type == "cuda" and tensors.get("rng.cuda") is not None:
        torch.cuda.set_rng_state(tensors["rng.cuda"], device)
    return True


def restore_rank_rng(reader, rank: int, world_size: int, device: torch.device) -> bool:
    """This rank's saved RNG states, restored when the checkpoint was written by as many ranks
    (another world size: each rank keeps its fresh generators). Returns whether it restored."""
    if reader.world_size != world_size:
        return False
    return restore_rng({k: v for k in ("rng.cpu", "rng.cuda") if (v := reader.extra(rank, k)) is not None}, device)
