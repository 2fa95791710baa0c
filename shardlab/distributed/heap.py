"""The host heap of a CPU rank: its mmap threshold (set once per rank) and, between a step's
phases, freed pages handed back to the system.

glibc keeps the pages of freed blocks below its mmap threshold (which rises to 32 MiB after the
first large free) in the heap. A training step frees its forward's temporaries (gathered
units below the threshold, attention scores, casts) in an order that leaves holes the backward's
differently sized gradients do not fit, so the backward grows the heap while the holes stay
resident: a rank's resident peak sits 5-30% above its live tensors (docs/data-parallel.md, Where
the memory goes). ``malloc_trim(0)`` after the forward returns every free page of the heap to the
system (it stays mapped, so a later allocation faults it in again, zero-filled). It costs a few
milliseconds per call and only CPU ranks call it (CUDA memory lives in PyTorch's caching
allocator, which this does not touch).
"""
from __future__ import annotations

import ctypes
import platform

_LIBC = None


def _libc():
    """glibc, or None (not Linux, or a C library without malloc_trim / mallopt, e.g. musl)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        if platform.system() == "Linux":
            try:
                libc = ctypes.CDLL("libc.so.6")
                _LIBC = libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else False
            except OSError:
                pass
    return _LIBC or None


def release(device) -> None:
    """Return the free pages of the host heap to the system (CPU ranks on glibc; else nothing)."""
    if getattr(device, "type", device) != "cpu":
        return
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


def set_mmap_threshold(nbytes: int) -> None:
    """glibc (Linux): buffers of at least ``nbytes`` are mapped on their own and unmapped when
    freed, so a rank's resident set follows its live tensors instead of keeping the heap's high
    water (glibc's own threshold rises to 32 MiB after the first large free, so a 24 MiB FSDP unit
    then comes from the heap and leaves a hole there). Every rank sets 16 MiB (launch.py): an FSDP x
    TP rank's peak 16% lower, steps 0-5% slower; at 1 MiB every tensor of a megabyte is faulted in
    afresh and steps ran 15% slower (docs/data-parallel.md, Where the memory goes). 0: glibc's own.
    ``MMAP_SET`` records what this process set (None before: glibc cannot be asked)."""
    global MMAP_SET
    libc = _libc()
    if nbytes and libc:
        libc.mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD (also stops its dynamic rise)
    MMAP_SET = int(nbytes)


MMAP_SET: int | None = None
