"""Checkpoints: safetensors tensors in global coordinates + a JSON manifest with checksums.

Layout of one checkpoint ``<dir>/step_00000100/``:
  state.safetensors   ``model.<global name>``, ``optim.<global name>.<state>``, ``rng.<rank>.<kind>``
  meta.json           step, data cursor, LR-schedule position, loss scaler, layout, config,
                      and the sha256 of every file (verified on load)

Saving writes a hidden temporary directory, fsyncs every file, then renames it into place:
a crash mid-save leaves the previous checkpoints intact. The last ``keep`` are kept. Nothing
is ever unpickled: tensors come from safetensors, the rest from JSON.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, keep: int = 3,
         _fail_after_tensors: bool = False) -> Path:
    """Atomically write checkpoint ``step``; prune to the newest ``keep``. Returns its path.
    (``_fail_after_tensors`` simulates a crash mid-save for tests.)"""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, str(tmp / "state.safetensors"))
    if _fail_after_tensors:
        raise CheckpointError(f"simulated crash while saving {tmp}")
    meta = dict(meta, step=step, files={"state.safetensors": _sha256(tmp / "state.safetensors")})
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Completed checkpoints (temporary directories excluded), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify(path: str | Path) -> dict:
    """Check the manifest and every file's checksum; return the manifest or raise CheckpointError."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise CheckpointError(f"{meta_file}: missing (incomplete checkpoint)")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file}: damaged ({e})") from None
    for name, digest in meta.get("files", {}).items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f}: checksum mismatch (file damaged or modified)")
    return meta


def load(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Verify then read one checkpoint -> (tensors, meta)."""
    meta = verify(path)
    return load_file(str(Path(path) / "state.safetensors")), meta


def latest_valid(directory: str | Path, warn=print) -> Path | None:
    """The newest checkpoint that verifies; damaged newer ones are reported through ``warn``."""
    for path in reversed(list_checkpoints(directory)):
        try:
            verify(path)
            return path
        except CheckpointError as e:
            warn(f"shardlab: skipping damaged checkpoint: {e}")
    return None


# -- RNG state as tensors ----------------------------------------------------------------------

def rng_tensors(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    out = {f"rng.{rank}.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng(tensors: dict[str, torch.Tensor], rank: int, device: torch.device) -> bool:
    """Restore this rank's RNG states if the checkpoint has them (same world size)."""
    key = f"rng.{rank}.cpu"
    if key not in tensors:
        return False
    torch.set_rng_state(tensors[key])
    if device.type == "cuda" and f"rng.{rank}.cuda" in tensors:
        torch.cuda.set_rng_state(tensors[f"rng.{rank}.cuda"], device)
    return True
