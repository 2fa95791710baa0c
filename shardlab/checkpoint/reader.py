"""Reading a sharded checkpoint under any layout: each rank asks for the boxes it needs.

``Reader(path)`` parses ``index.json`` and checks that every shard file exists with the recorded
size and a parseable safetensors header matching the index (cheap: no tensor data is read).
``read(key, offsets, sizes)`` assembles the box from the saved pieces that intersect it, reading
only the intersecting slices, by offset: positioned reads (``os.preadv``) of the dim-0 rows
each box touches, no memory map. A piece read whole has its crc32 checked; ``verify_all``
reads and checks every piece. ``read_into`` reads a whole piece straight into the caller's
tensor (the load path of every engine: one copy; the crc32 is computed chunk by chunk in a
helper thread, overlapped with the reads of the next chunks, and checked before it returns). Docs: docs/checkpoints.md.
"""
from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from .format import _ST_DTYPES, CheckpointError, crc32, dtype_from_name, plan_cover, read_header

_FIX = "re-save or use an older checkpoint"
CHUNK = 4 << 20
"""Bytes per positioned read of :meth:`Reader.read_into`; each chunk's crc32 overlaps the next read."""
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}                          # "F32" -> torch.float32
_ST_NAMES = {str(k).replace("torch.", ""): v for k, v in _ST_DTYPES.items()}  # "float32" -> "F32"


def _crc_after(data, before) -> int:
    """crc32 of ``data`` continuing the crc of ``before`` (a future of the previous chunk's, or None)."""
    return zlib.crc32(data, before.result() if before is not None else 0)


@runtime_checkable
class TensorSource(Protocol):
    """What loading (pieces.py) asks of any source of global tensors: :class:`Reader`, and the
    Hugging Face / GGUF / layered / LoRA-merging readers of models/ (typed, checked by a test)."""

    def keys(self) -> list[str]: ...
    def has(self, key: str) -> bool: ...
    def global_shape(self, key: str) -> tuple: ...
    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor: ...
    def close(self) -> None: ...


class Reader:
    """One published checkpoint (a ``step_NNNNNNNN`` directory)."""

    def __init__(self, path):
        self.path = Path(path)
        index_file = self.path / "index.json"
        if not index_file.exists():
            raise CheckpointError(f"{index_file}: missing (incomplete checkpoint: the save did not finish); "
                                  "use an older checkpoint")
        try:
            index = json.loads(index_file.read_text())
            self.step, self.world_size, self.meta = int(index["step"]), int(index["world_size"]), index["meta"]
            self._keys: dict[str, dict] = index["keys"]
            self._ranks = {int(r["rank"]): r for r in index["ranks"]}
            for info in self._keys.values():
                dtype_from_name(info["dtype"])
            self._handles: dict[str, object] = {}
            self._crc_thread = None
            self._data_start: dict[str, int] = {}
            self._headers: dict[str, dict] = {}
            self._check_files()
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index_file}: damaged ({type(e).__name__}: {e}); {_FIX}") from None

    def _check_files(self) -> None:
        headers = {}
        for r in self._ranks.values():
            f = self.path / r["file"]
            if not f.exists():
                raise CheckpointError(f"{f}: missing; {_FIX}")
            if f.stat().st_size != r["size"]:
                raise CheckpointError(f"{f}: {f.stat().st_size} bytes, index.json records {r['size']} "
                                      f"(truncated or modified); {_FIX}")
            headers[r["file"]] = read_header(f)
            end = max((int(v["data_offsets"][1]) for v in headers[r["file"]].values()), default=0)
            self._data_start[r["file"]] = r["size"] - end  # 8 + header length
            for name, e in r["extra"].items():
                self._check_entry(f, headers[r["file"]], name, e["dtype"], e["shape"])
        for key, info in self._keys.items():
            for p in info["pieces"]:
                if p["file"] not in headers:
                    raise CheckpointError(f"{self.path / 'index.json'}: {key} names unknown file {p['file']}; {_FIX}")
                self._check_entry(self.path / p["file"], headers[p["file"]], p["name"], info["dtype"], p["sizes"])
        self._headers = headers

    @staticmethod
    def _check_entry(f: Path, header: dict, name: str, dtype: str, shape) -> None:
        h = header.get(name)
        if h is None or h.get("dtype") != _ST_NAMES[dtype] or list(h.get("shape", ())) != list(shape):
            raise CheckpointError(f"{f}: tensor {name} missing or not as index.json records it; {_FIX}")

    # -- what is in it ---------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._keys)

    def has(self, key: str) -> bool:
        return key in self._keys

    def _info(self, key: str) -> dict:
        if key not in self._keys:
            raise CheckpointError(f"{self.path}: no tensor {key} in this checkpoint (saved from another model "
                                  "or with another optimizer?)")
        return self._keys[key]

    def global_shape(self, key: str) -> tuple:
        return tuple(self._info(key)["global_shape"])

    def dtype(self, key: str) -> torch.dtype:
        return dtype_from_name(self._info(key)["dtype"])

    def pieces(self, key: str) -> list[dict]:
        """The saved pieces of ``key``: {file, name, offsets, sizes, crc32}."""
        return list(self._info(key)["pieces"])

    def rank_files(self) -> list[dict]:
        """Per saving rank: {rank, file, size, extra}."""
        return [self._ranks[r] for r in sorted(self._ranks)]

    # -- reading ---------------------------------------------------------------------------

    def _open(self, file: str) -> int:
        """A file descriptor for positioned reads (no memory map: pages read for one box are not
        kept mapped, so a load's resident memory is what it keeps, not the files it touched)."""
        if file not in self._handles:
            try:
                self._handles[file] = os.open(self.path / file, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{self.path / file}: cannot be opened ({e}); {_FIX}") from None
        return self._handles[file]

    def _pread(self, file: str, start: int, n: int) -> bytearray:
        fd, buf, done = self._open(file), bytearray(n), 0
        view = memoryview(buf)
        while done < n:
            got = os.preadv(fd, [view[done:]], start + done)
            if got <= 0:
                raise CheckpointError(f"{self.path / file}: ends early (truncated); {_FIX}")
            done += got
        return buf

    def _read_piece(self, p: dict, off, sizes) -> torch.Tensor:
        """The part (off, sizes) of saved piece ``p``, in global coordinates; crc32 when whole.
        Reads by offset only the piece's dim-0 rows that the box touches."""
        whole = list(off) == p["offsets"] and list(sizes) == p["sizes"]
        h = self._headers[p["file"]][p["name"]]
        dtype, shape = _ST_TORCH[h["dtype"]], list(h["shape"])
        item = torch.empty((), dtype=dtype).element_size()
        row = item
        for d in shape[1:]:
            row *= d
        local = [o - po for o, po in zip(off, p["offsets"])]
        r0, r1 = (0, shape[0] if shape else 1) if whole or not shape else (local[0], local[0] + sizes[0])
        start = self._data_start[p["file"]] + int(h["data_offsets"][0]) + r0 * row
        raw = self._pread(p["file"], start, (r1 - r0) * row)
        t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
        t = t.reshape([r1 - r0] + shape[1:] if shape else [])
        if not whole:
            t = t[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(local[1:], sizes[1:]))].contiguous()
        if whole and crc32(t) != p["crc32"]:
            raise CheckpointError(f"{self.path / p['file']}: checksum mismatch in {p['name']} (file damaged); "
                                  f"{_FIX}")
        return t

    def read_into(self, key: str, offsets, sizes, out: torch.Tensor) -> None:
        """Fill ``out`` (shape ``sizes``) with the box [offsets, offsets + sizes) of ``key``.

        Fast path -- the box is one saved piece whole, and ``out`` is a contiguous CPU tensor of
        the saved dtype: the bytes are read by offset straight into ``out``'s memory, in chunks
        of :data:`CHUNK` bytes; a helper thread takes each chunk's crc32 (chained) while the next
        chunk is read, and the result is compared with the index before returning.
        No temporary buffer, one copy (page cache -> ``out``). Otherwise: ``out.copy_(read(...))``."""
        info = self._info(key)
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        hit = [p for p in info["pieces"] if tuple(p["offsets"]) == offsets and tuple(p["sizes"]) == sizes]
        h = self._headers[hit[0]["file"]][hit[0]["name"]] if hit else None
        if h is None or out.device.type != "cpu" or not out.is_contiguous() or tuple(out.shape) != sizes \
                or _ST_TORCH[h["dtype"]] != out.dtype:
            with torch.no_grad():
                out.copy_(self.read(key, offsets, sizes, out.dtype))
            return
        p = hit[0]
        start = self._data_start[p["file"]] + int(h["data_offsets"][0])
        n = int(h["data_offsets"][1]) - int(h["data_offsets"][0])
        view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
        fd, crc, done = self._open(p["file"]), None, 0
        if self._crc_thread is None:
            self._crc_thread = ThreadPoolExecutor(1, thread_name_prefix="shardlab-ckpt-crc")
        while done < n:  # read chunk k + 1 while the thread takes chunk k's crc (both release the GIL)
            got = os.preadv(fd, [view[done:min(n, done + CHUNK)]], start + done)
            if got <= 0:
                raise CheckpointError(f"{self.path / p['file']}: ends early (truncated); {_FIX}")
            crc = self._crc_thread.submit(_crc_after, view[done:done + got], crc)
            done += got
        if (crc.result() if crc is not None else 0) & 0xFFFFFFFF != p["crc32"]:
            raise CheckpointError(f"{self.path / p['file']}: checksum mismatch in {p['name']} (file damaged); "
                                  f"{_FIX}")

    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of global tensor ``key`` (the whole tensor when None),
        assembled from the saved pieces that intersect it; only those slices are read."""
        info = self._info(key)
        gshape = tuple(info["global_shape"])
        offsets = (0,) * len(gshape) if offsets is None else tuple(int(o) for o in offsets)
        sizes = tuple(g - o for g, o in zip(gshape, offsets)) if sizes is None else tuple(int(s) for s in sizes)
        if len(offsets) != len(gshape) or len(sizes) != len(gshape) or \
                any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, gshape)):
            raise CheckpointError(f"{self.path}: {key}: box offsets {offsets} sizes {sizes} is outside its "
                                  f"global shape {gshape}; the loading layout does not match the model")
        pieces = info["pieces"]
        plan, hole = plan_cover(offsets, sizes, [(tuple(p["offsets"]), tuple(p["sizes"])) for p in pieces])
        if hole is not None:
            raise CheckpointError(f"{self.path}: {key}: no saved piece covers offsets {hole[0]} sizes {hole[1]}; "
                                  f"{_FIX}")
        out = torch.empty(sizes, dtype=dtype_from_name(info["dtype"]))
        for i, c_off, c_size in plan:
            part = self._read_piece(pieces[i], c_off, c_size)
            if out.dim() == 0:
                out.copy_(part.reshape(()))
            else:
                out[tuple(slice(c - o, c - o + s) for c, o, s in zip(c_off, offsets, c_size))] = part
        return out if dtype is None else out.to(dtype)

    def extra(self, rank: int, name: str) -> torch.Tensor | None:
        """An extra tensor saved by ``rank`` (e.g. ``"rng.cpu"``), or None if it has none."""
        r = self._ranks.get(int(rank))
        if r is None or name not in r["extra"]:
            return None
        e = r["extra"][name]
        whole = {"file": r["file"], "name": name, "offsets": [], "sizes": [], "crc32": e["crc32"]}
        return self._read_piece(whole, (), ())  # empty box == the piece's box: read whole, crc checked

    def verify_all(self) -> int:
        """Read every piece and extra tensor whole and check its crc32; check every key is fully
        covered. Returns the number of tensors checked. CheckpointError names the first bad file."""
        n = 0
        for key, info in self._keys.items():
            boxes = [(tuple(p["offsets"]), tuple(p["sizes"])) for p in info["pieces"]]
            _, hole = plan_cover((0,) * len(info["global_shape"]), info["global_shape"], boxes)
            if hole is not None:
                raise CheckpointError(f"{self.path}: {key}: no saved piece covers offsets {hole[0]}; {_FIX}")
        by_file: dict[str, list[dict]] = {}
        for info in self._keys.values():
            for p in info["pieces"]:
                by_file.setdefault(p["file"], []).append(p)
        for r in self.rank_files():
            for p in by_file.get(r["file"], []):
                self._read_piece(p, p["offsets"], p["sizes"])
                n += 1
            for name in r["extra"]:
                self.extra(r["rank"], name)
                n += 1
        return n

    def nbytes(self) -> int:
        return sum(r["size"] for r in self._ranks.values())

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()
        if self._crc_thread is not None:
            self._crc_thread.shutdown()
            self._crc_thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
