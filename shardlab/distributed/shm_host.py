"""Host-side pieces shared by the shared-memory transport's collectives (shm.py) and its
point-to-point rings (shm_p2p.py): how a rank waits for the others, how a file under /dev/shm
is reserved, how long a wait may last, how long messages are cut into chunks (docs/collectives.md, "Shared-memory transport").
"""
from __future__ import annotations

import errno
import functools
import os
import platform
import time

from ..errors import ConfigError

X86 = platform.machine().lower() in ("x86_64", "amd64")
"""Whether the counter barrier (x86-64 ordering) is available, and with it the rings and
``parallel.comm_transport = auto``'s choice of this transport for CPU ranks on one host."""
SPINS = 64
"""``sched_yield`` calls before a waiting rank starts to sleep (naps from 20 us, doubling to 1 ms):
a busy spin would starve the rank being waited for when ranks outnumber cores."""
DEFAULT_TIMEOUT_S = 600.0
ONE_SHOT_BYTES = 256 << 10
"""Chunks up to this size all-reduce in one phase in groups of up to 4 ranks (``SharedComm``'s
``one_shot_ranks``): one barrier less beats reading every rank's region (2-core CPU, N = 4, one
phase / two: 0.69-0.88 at 4 KiB, 0.79-1.03 at 256 KiB, 1.18-1.29 at 16 MiB;
benchmarks/shm_latency.py, docs/collectives.md)."""
SPIN_S = 0.002
"""Seconds a waiting rank keeps yielding before its first nap where the host has two cores per
rank of the group (:func:`spin_seconds`): a nap's overshoot delays the other ranks too (on an
H100 host, 2 ranks: 0.3-0.6 ms of each 1 ms all-reduce call was barrier wait; docs/gpu.md)."""


def spin_seconds(size: int) -> float:
    """How long a rank of a group of ``size`` ranks on this host yields before napping: SPIN_S
    where this process may run on at least 2 x ``size`` cores, else 0 (the SPINS yields only)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return SPIN_S if cores >= 2 * size else 0.0


def collective_timeout(group):
    """The timeout (a timedelta) ``group``'s collectives run under: what ``init_process_group(timeout=...)``
    or ``set_timeout`` gave it (``train.timeout_s`` under the launcher; the Mesh's subgroups take the
    default group's, mesh.subgroup). None where the backend does not say (a private attribute)."""
    import torch
    for kind in getattr(group, "_device_types", ()) or (torch.device("cpu"),):
        try:
            timeout = group._get_backend(torch.device(kind)).options._timeout
        except Exception:  # another backend, or the attribute renamed
            continue
        if timeout is not None:
            return timeout
    return None


def group_timeout(group) -> float:
    """Seconds a collective of ``group`` may wait on this transport: the process group's own
    timeout (:func:`collective_timeout`), so a rank that never arrives stops the job as soon on
    this transport as on gloo. 600 s where the backend does not say."""
    timeout = collective_timeout(group)
    return DEFAULT_TIMEOUT_S if timeout is None else float(timeout.total_seconds())


def wait(done, timeout_s: float, late, progress=None, spin_s: float = 0.0) -> None:
    """Return once ``done()`` is true. Yields the core ``SPINS`` times (and for at least
    ``spin_s`` seconds), then sleeps in doubling naps up to 1 ms. ``progress()`` (optional) is
    called each round and returns True when it moved something, which restarts the yields and
    the clock. After ``timeout_s`` seconds with nothing moved, raises RuntimeError with the text
    ``late()`` returns."""
    t0, spins, nap = time.monotonic(), 0, 2e-5
    while not done():
        if progress is not None and progress():
            t0, spins, nap = time.monotonic(), 0, 2e-5
            continue
        spins += 1
        if spins < SPINS or (spin_s and time.monotonic() - t0 < spin_s):
            os.sched_yield()
            continue
        time.sleep(nap)
        nap = min(2 * nap, 1e-3)
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{late()} in {timeout_s:.0f} s")


def full(where: str, free: float, need: float) -> str:
    return (f"the shared-memory transport needs {need / 2**20:.0f} MiB more in {where} ({free / 2**20:.0f} MiB "
            "free); enlarge it (docker run --shm-size=8g) or set parallel.comm_transport = \"process_group\"")


def reserve(path: str, nbytes: int) -> None:
    """Create ``path`` (it must not exist) with ``nbytes`` allocated now. /dev/shm is a RAM file
    system that is often small (64 MiB by default in a Docker container): pages only promised by
    ``ftruncate`` would kill the process with SIGBUS at the first write past its end; reserving
    them here turns that into this error (a ConfigError naming the setting), before any rank writes."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        st = os.statvfs(os.path.dirname(path))
        raise ConfigError("parallel.comm_transport", full(os.path.dirname(path), st.f_bavail * st.f_frsize, nbytes)) from None
    os.close(fd)


# -- what each rank is doing at a barrier -----------------------------------------------------------
# A barrier only counts arrivals, so two ranks in different collectives (a skipped call, calls in
# another order) would pass it together and read each other's bytes as their own. Every rank
# therefore publishes, with its arrival, what it is in: the collective, the dtype, the bytes of its
# message (0 for all_to_all, whose sizes differ by design), its shape and the reduce op or broadcast root; after
# the barrier each compares all of them and every rank raises the same one-line error on a mismatch.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier")
BARRIER = (KINDS.index("barrier"), 0, 0)  # the signature of SharedComm.barrier()
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "complex128")
_OPS = ("sum", "avg", "max", "min")


def signature(kind: str, t, nbytes: int, op: str | int = "") -> tuple[int, int, int]:
    """(code, bytes, shape) of a collective: code packs the kind, the dtype and the op (a reduce
    op's name, or a broadcast's source rank); shape packs the number of dimensions (low 4 bits)
    and a hash of the sizes, so equal byte counts of different shapes differ too (all_to_all: 0,
    its shapes differ by design)."""
    dt = str(t.dtype).removeprefix("torch.")
    extra = _OPS.index(op) + 1 if op in _OPS else (int(op) + 16 if isinstance(op, int) else 0)
    shape = 0 if kind == "all_to_all" else (hash(tuple(t.shape)) & (2**58 - 1)) << 4 | min(t.dim(), 15)
    return KINDS.index(kind) | (_DTYPES.index(dt) + 1 if dt in _DTYPES else 0) << 8 | extra << 16, int(nbytes), shape


def describe(sig, shape: bool = False) -> str:
    """``kind(dtype, bytes[, n-d shape #hash], op)``; the shape only when asked (it differs)."""
    code, nbytes, shp = (int(x) for x in (list(sig) + [0])[:3])
    kind, dt, extra = KINDS[code & 0xFF], (code >> 8) & 0xFF, code >> 16
    if kind == "barrier":
        return "barrier()"
    what = [_DTYPES[dt - 1] if dt else "dtype?"] + ([f"{nbytes} bytes"] if nbytes else [])
    what += [f"{shp & 15}-d shape #{(shp >> 4) & 0xFFFF:04x}"] if shape and shp else []
    what += [_OPS[extra - 1]] if 1 <= extra <= len(_OPS) else [f"from group rank {extra - 16}"] if extra >= 16 else []
    return f"{kind}({', '.join(what)})"


def mismatch(name: str, sigs: list) -> str | None:
    """The error text when the group's ranks (``sigs[i]``: group rank i's signature) are not all
    in the same collective, else None."""
    if all(tuple(s) == tuple(sigs[0]) for s in sigs):
        return None
    shapes = len({tuple(s)[:2] for s in sigs}) == 1  # only the shapes differ: show them
    parts = ", ".join(f"group rank {i} in {describe(s, shapes)}" for i, s in enumerate(sigs))
    return (f"{name}: shared-memory collective mismatch: {parts} (every rank of a group must issue the "
            "same collectives in the same order)")


# -- arena sizes and the reduction shared by shm.py's collectives --------------------------------
_ALIGN = 4096
_MIN_CAP = 1 << 16
CHUNK = 4 << 20  # bytes a rank writes per phase: longer all_reduce / all_gather / reduce_scatter / broadcast go in chunks
GROUP_CHUNKS = 16 << 20  # ... and at most this much over the whole group (a rank maps every member's regions)


def chunk_bytes(n: int) -> int:
    """Bytes a member of an ``n``-rank group writes per phase: :data:`CHUNK`, less in groups over 4
    so that the 2 x n regions an all-gather reads stay at 2 x :data:`GROUP_CHUNKS` (a rank's
    resident shared pages at N = 8 were 64 MiB; docs/data-parallel.md, Where the memory goes)."""
    return min(CHUNK, max(1 << 16, GROUP_CHUNKS // max(1, n)))


def _spans(count: int, per: int, elem: int, chunk: int) -> list[tuple[int, int]]:
    """Cut ``count`` elements into spans of which ``per`` copies fit in ``chunk`` bytes (the
    comm's: :func:`chunk_bytes` on the CPU), so that the arena (and the shared pages each rank
    touches) is bounded by the chunk, not the model."""
    step = max(1, chunk // max(1, per * elem))
    return [(j, min(count, j + step)) for j in range(0, count, step)]


def _round(nbytes: int) -> int:
    return max(_MIN_CAP, -(-nbytes // _ALIGN) * _ALIGN)


def _reduce_into(out, parts: list, op: str):
    """out <- op(parts[0], parts[1], ...) in the order of ``parts`` (sum for ``avg``)."""
    import torch
    fn = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    if len(parts) == 1:
        out.copy_(parts[0])
        return out
    fn(parts[0], parts[1], out=out)
    for p in parts[2:]:
        fn(out, p, out=out)
    return out


def modes_off(fn):
    """Run a collective with the Python dispatch modes (``TorchDispatchMode``) switched off. Its
    internals (spins on the shared counters, a first call's mapping of the arena) dispatch a
    number of operators that differs from call to call; a mode that must see the same operators
    in the same order each time (selective recomputation's: the ``op`` policy replays a block's
    forward) would fail. Collectives are never kept by such policies: they run again. Under the
    profiler the call is one ``shm:<op>`` span (analysis/overlap.py counts it as communication)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes
    span = "shm:" + {"_gather": "all_gather"}.get(fn.__name__, fn.__name__)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _disable_current_modes():
            if not (torch.autograd._profiler_enabled() or getattr(torch.autograd.profiler, "_is_profiler_enabled", False)):
                return fn(*args, **kwargs)  # the second: a profiler of all threads, off on this one's flag
            with torch.profiler.record_function(span):
                return fn(*args, **kwargs)
    return wrapper
