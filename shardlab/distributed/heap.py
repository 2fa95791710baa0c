"""The host heap between a step's phases: hand freed pages back to the system.

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

_TRIM = None


def _libc_trim():
    global _TRIM
    if _TRIM is None:
        _TRIM = False
        if platform.system() == "Linux":
            try:
                _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                pass
    return _TRIM


def release(device) -> None:
    """Return the free pages of the host heap to the system (CPU ranks on glibc; else nothing)."""
    if getattr(device, "type", device) != "cpu":
        return
    trim = _libc_trim()
    if trim:
        trim(0)
