"""Starting ranks: local spawn (CPU gloo, N ranks sharing one GPU, NCCL one rank per GPU) and
the torchrun contract. With cli.py, the only module that reads environment variables.

``run(fn, nproc, *args)`` starts ``nproc`` processes, initialises torch.distributed in each,
calls ``fn(ctx, *args)`` with a :class:`RankContext` and returns the list of results in rank
order. If any rank raises or dies, the others are terminated at once and :class:`WorkerError`
carries the failing rank's traceback: never a hang. Under torchrun (``RANK`` and
``WORLD_SIZE`` set) the same entry point runs in place, one process per rank.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A rank failed; ``rank`` is the first failing rank and ``str(err)`` holds its error."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        super().__init__(f"rank {rank} failed:\n{message}")


@dataclass
class RankContext:
    """What a rank needs to know about the launch: passed to the worker function."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def choose_backend(device: str, nproc_local: int) -> tuple[str, str]:
    """-> (backend, device kind). NCCL needs one GPU per rank; N ranks on one GPU use gloo."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device = cuda but no CUDA device is visible; use --train.device=cpu")
        return ("nccl" if torch.cuda.device_count() >= nproc_local else "gloo"), "cuda"
    return "gloo", "cpu"


def default_threads(nproc_local: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, nproc_local))


def _rank_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _init(rank, world, local_rank, local_world, init_method, device, timeout_s, threads) -> RankContext:
    backend, kind = choose_backend(device, local_world)
    torch.set_num_threads(threads or default_threads(local_world))
    dev = _rank_device(kind, local_rank)
    if kind == "cuda":
        torch.cuda.set_device(dev)
    kwargs = dict(backend=backend, rank=rank, world_size=world,
                  timeout=datetime.timedelta(seconds=timeout_s))
    if init_method:
        kwargs["init_method"] = init_method
    if backend == "nccl":
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)
    return RankContext(rank, world, local_rank, dev, backend)


def _worker(rank, world, init_method, device, timeout_s, threads, fn, args, results):
    try:
        ctx = _init(rank, world, rank, world, init_method, device, timeout_s, threads)
        out = fn(ctx, *args)
        # Plain pickle: tensors travel by value (torch's queue reducers would pass shared-memory
        # handles that die with this process).
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # report everything, including KeyboardInterrupt
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_world_size() -> int | None:
    """WORLD_SIZE under torchrun, else None."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


def torchrun_rank() -> int | None:
    return int(os.environ["RANK"]) if under_torchrun() else None


def run(fn, nproc: int, *args, device: str = "cpu", timeout_s: float = 60.0, threads: int = 0):
    """Run ``fn(ctx, *args)`` on ``nproc`` ranks; return results in rank order (see module doc)."""
    if under_torchrun():
        return [_run_torchrun(fn, args, device, timeout_s, threads)]
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="shardlab-store-")
    os.close(fd)
    os.unlink(store)  # FileStore creates it; a fresh name avoids port races between jobs
    init_method = f"file://{store}"
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(r, nproc, init_method, device, timeout_s, threads, fn, args, results))
             for r in range(nproc)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, nproc)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        results.close()
        results.join_thread()
        if os.path.exists(store):
            os.unlink(store)


_SECONDARY = ("Connection closed by peer", "remote worker", "Connection reset", "Timed out", "timed out")


def _collect(procs, results, nproc, grace_s: float = 1.0):
    """Results in rank order, or WorkerError for the root failure. When one rank fails, the
    others usually fail next with a broken-connection error: wait ``grace_s`` for every report,
    then blame a rank that died silently (killed) or raised a non-communication error first."""
    out: dict[int, object] = {}
    failures: dict[int, str] = {}
    deadline = None
    while len(out) + len(failures) < nproc:
        if deadline is not None and time.time() > deadline:
            break
        try:
            rank, status, payload = results.get(timeout=0.1)
            if status == "error":
                failures[rank] = payload
            else:
                out[rank] = pickle.loads(payload)
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if r not in out and r not in failures and p.exitcode not in (None, 0):
                    if deadline is None:  # give its own report a moment to arrive
                        deadline = time.time() + grace_s
                    elif time.time() > deadline - grace_s / 2:
                        code = p.exitcode
                        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                        failures[r] = f"process died ({how}) without reporting an error"
        if failures and deadline is None:
            deadline = time.time() + grace_s
    if not failures:
        return [out[r] for r in range(nproc)]

    def blame(item):
        rank, msg = item
        silent = msg.startswith("process died")
        secondary = any(s in msg for s in _SECONDARY)
        return (not silent, secondary, rank)
    rank, msg = min(failures.items(), key=blame)
    others = sorted(set(failures) - {rank})
    note = f"\n(then ranks {others} stopped as a consequence)" if others else ""
    raise WorkerError(rank, msg + note)


def _run_torchrun(fn, args, device, timeout_s, threads):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    ctx = _init(rank, world, local_rank, local_world, None, device, timeout_s, threads)
    try:
        return fn(ctx, *args)
    finally:
        dist.destroy_process_group()
