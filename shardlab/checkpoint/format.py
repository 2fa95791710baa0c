"""Building blocks of sharded checkpoints: pieces, boxes, dtypes, checksums, safetensors files.

A *piece* is a box of a global tensor: ``offsets`` (its origin in global coordinates) and
``sizes`` (``tensor.shape``). Boxes are tuples of ints; a scalar's box is ``((), ())``.

Safetensors files are written here by a small streaming writer (header first, then each
tensor's bytes in the declared order) so that a consolidated export never holds more than one
slice in memory. Format (https://huggingface.co/docs/safetensors): 8-byte little-endian header
length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{str: str}}``, then the data; offsets are relative to the end of the header. Docs: docs/checkpoints.md.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import zlib
from pathlib import Path

import torch


from ..distributed.regions import Piece, flat_boxes, intersect  # noqa: F401  (Piece, flat_boxes: re-exported)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the fix."""


# torch dtype <-> safetensors dtype string; index files use the torch name ("float32").
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_BY_NAME = {str(t).replace("torch.", ""): t for t in _ST_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _ST_DTYPES:
        raise ValueError(f"checkpoint: dtype {dtype} is not supported; use one of {sorted(_BY_NAME)}")
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise KeyError(name)
    return _BY_NAME[name]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The little-endian row-major bytes of a host tensor (no copy when contiguous)."""
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(tensor_bytes(t)) & 0xFFFFFFFF


def fsync_path(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- boxes -------------------------------------------------------------------------------------

def volume(sizes) -> int:
    return math.prod(sizes)


def subtract(off, size, c_off, c_size):
    """Box minus an inner box ``c`` (contained in it): at most 2*ndim disjoint boxes."""
    out = []
    lo, hi = list(off), [o + s for o, s in zip(off, size)]
    for d in range(len(off)):
        c_lo, c_hi = c_off[d], c_off[d] + c_size[d]
        if c_lo > lo[d]:
            out.append((tuple(lo[:d] + [lo[d]] + lo[d + 1:]),
                        tuple(hi[k] - lo[k] if k != d else c_lo - lo[d] for k in range(len(off)))))
        if c_hi < hi[d]:
            out.append((tuple(lo[:d] + [c_hi] + lo[d + 1:]),
                        tuple(hi[k] - lo[k] if k != d else hi[d] - c_hi for k in range(len(off)))))
        lo[d], hi[d] = c_lo, c_hi  # the remaining dimensions are cut inside c's range in dim d
    return out


def plan_cover(offsets, sizes, boxes):
    """Cover the box (offsets, sizes) with disjoint parts of ``boxes`` [(offsets, sizes), ...].

    Returns (assignments, uncovered): assignments is a list of (index into boxes, part offsets,
    part sizes); uncovered is the first part of the box that no box reaches, or None. Replicas
    (equal boxes) are fine: the first one is used. Larger overlaps are taken first, so a piece
    inside the box is normally read whole (and its checksum verified)."""
    if volume(sizes) == 0:
        return [], None
    todo, out = [(tuple(offsets), tuple(sizes))], []
    while todo:
        r_off, r_size = todo.pop()
        best = None
        for i, (b_off, b_size) in enumerate(boxes):
            c = intersect((r_off, r_size), (b_off, b_size))
            if c is not None and (best is None or volume(c[1]) > volume(best[1][1])):
                best = (i, c)
                if c[1] == r_size:
                    break
        if best is None:
            return out, (r_off, r_size)
        i, (c_off, c_size) = best
        out.append((i, c_off, c_size))
        todo.extend(subtract(r_off, r_size, c_off, c_size))
    return out, None


# -- safetensors files -------------------------------------------------------------------------

class SafetensorsWriter:
    """Stream a safetensors file: the header (names, dtypes, shapes) first, then each tensor's
    bytes in the declared order via ``write(name, tensor)``, possibly in dim-0 chunks. ``progress``:
    a label for a bar of the bytes written on stderr, shown when stderr is a terminal (the exports;
    the ranks' checkpoint files show none)."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None,
                 progress: str = ""):
        header, pos = {}, 0
        for name, dtype, shape in specs:
            if dtype not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {name}: dtype {dtype} not supported by checkpoints")
            n = volume(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as safetensors does
        self.path, self._order, self._i = path, [s[0] for s in specs], 0
        self._ends = {name: header[name]["data_offsets"] for name in self._order}
        self._start = 8 + len(raw)
        self._fh = open(path, "wb")
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._crc = 0
        self._bar = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=pos, unit="B", unit_scale=True, unit_divisor=1024, desc=progress,
                             dynamic_ncols=True, leave=False)

    def write(self, name: str, tensor: torch.Tensor, last: bool = True) -> int | None:
        """Append (part of) tensor ``name``; returns the crc32 of its bytes when ``last``."""
        if self._i >= len(self._order) or name != self._order[self._i]:
            raise ValueError(f"{self.path}: tensors must be written in the declared order (got {name})")
        data = tensor_bytes(tensor.detach().cpu())
        self._fh.write(data)
        self._crc = zlib.crc32(data, self._crc)
        if self._bar is not None:
            self._bar.update(len(data))
        if not last:
            return None
        if self._fh.tell() != self._start + self._ends[name][1]:
            raise ValueError(f"{self.path}: tensor {name} has the wrong number of bytes")
        crc, self._crc, self._i = self._crc & 0xFFFFFFFF, 0, self._i + 1
        return crc

    def close(self) -> int:
        """Flush and fsync; returns the file size."""
        if self._i != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._i} tensors not written")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        size = self._fh.tell()
        self._fh.close()
        self._close_bar()
        return size

    def abort(self) -> None:
        self._fh.close()
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def read_header(path: Path) -> dict:
    """Parse a safetensors header (reads only the header bytes); CheckpointError if damaged."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise CheckpointError(f"{path}: damaged safetensors header; re-save or use an older checkpoint")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: damaged safetensors header; re-save or use an older checkpoint") \
                from None
    try:
        header.pop("__metadata__", None)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        end = -1
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: header and file size disagree (truncated or damaged); "
                              "re-save or use an older checkpoint")
    return header
