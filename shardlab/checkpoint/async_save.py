"""Asynchronous checkpoint saves (``checkpoint.async_save = true``): the training step waits only
for the previous save, a barrier and a host snapshot of this rank's pieces; a background thread
writes them and rank 0's commits. How, and what a failure leaves: docs/checkpoints.md,
"Asynchronous saves"."""
from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

import torch

from . import save as ckpt
from .format import CheckpointError

__all__ = ["AsyncSaver", "save", "saver", "finish", "HOOK_ENV"]

HOOK_ENV = "SHARDLAB_TEST_ASYNC_SAVE_HOOK"
"""Tests only (the key in ``RunPlan.test_hooks``; ``hook=`` of :meth:`AsyncSaver.save`):
``KIND:RANK:STEP`` makes rank RANK's writer of step STEP, in the middle of its data file,
``raise`` an OSError, ``exit`` (``os._exit(9)``: a killed rank) or ``sleep`` 2 s."""
MARKER_TIMEOUT_S = 3600.0
"""How long rank 0's writer waits for the other ranks' done markers."""


def failed_file(rank: int) -> str:
    return ckpt.rank_file(rank, "failed")


class AsyncSaver:
    """One per process (see :func:`save`): at most one save in flight."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.step: int | None = None
        self._host: list[torch.Tensor] = []  # snapshot buffers, reused from save to save

    # -- the training thread ------------------------------------------------------------------
    def wait(self) -> BaseException | None:
        """Block until the save in flight (if any) is finished; return its error (and forget it)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        err, self.error = self.error, None
        return err

    def settle(self, mesh) -> None:
        """Collective: wait for this rank's save in flight, then raise on every rank if it failed
        on any (one all_reduce of a flag on the training thread)."""
        step, err = self.step, self.wait()
        flag = torch.tensor([1.0 if err is not None else 0.0])
        mesh.comm("world").all_reduce(flag, op="max")
        if err is not None:
            raise CheckpointError(f"asynchronous save of step {step} failed on rank {mesh.rank}: "
                                  f"{type(err).__name__}: {err}; the previous checkpoint is kept") from err
        if flag.item():
            raise CheckpointError(f"asynchronous save of step {step} failed on another rank (its traceback names "
                                  "the error); the previous checkpoint is kept")

    def snapshot(self, pieces: list, extra: dict) -> tuple[list, dict, object]:
        """Host copies of ``pieces`` (reusing the previous save's buffers when the shapes match)
        and ``extra``; returns (pieces, extra, CUDA event or None)."""
        tensors = [p.tensor for p in pieces if not isinstance(p.tensor, ckpt.Deferred)]
        specs = [(tuple(t.shape), t.dtype, t.device.type == "cuda") for t in tensors]
        if [(tuple(h.shape), h.dtype, h.is_pinned()) for h in self._host] != specs:
            self._host = []  # another layout: allocate afresh (free the old buffers first)
            self._host = [torch.empty(s, dtype=d, pin_memory=pin) for s, d, pin in specs]
        cuda = False
        with torch.no_grad():
            for h, t in zip(self._host, tensors):
                cuda |= t.device.type == "cuda"
                h.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        it = iter(self._host)
        out = [p if isinstance(p.tensor, ckpt.Deferred) else p._replace(tensor=next(it)) for p in pieces]
        return out, {k: v.detach().to("cpu", copy=True) for k, v in extra.items()}, event

    def save(self, directory, step: int, mesh, pieces, meta, device, keep: int = 3, hook: str = "",
             on_commit=None) -> Path | None:
        """Collective like ``checkpoint.save``, but returns once the snapshot is taken. Returns,
        on rank 0, the path the checkpoint will have once committed; ``on_commit`` runs on rank 0's
        writer thread after the commit (not if the save fails). ``hook``: :data:`HOOK_ENV`."""
        self.settle(mesh)
        world = mesh.comm("world")
        if mesh.rank == 0:
            ckpt.prepare(directory, step)
        world.barrier()
        snap, extra, event = self.snapshot(pieces(), ckpt.rng_tensors(device))
        meta_v = meta() if mesh.rank == 0 else None
        staging = ckpt.staging_dir(directory, step)
        self.step = step
        self.thread = threading.Thread(  # not a daemon: a process that exits still finishes its save
            target=self._write, name=f"shardlab-ckpt-{step}",
            args=(Path(directory), staging, int(step), mesh.rank, mesh.world_size, snap, extra, event, meta_v, keep, hook,
                  on_commit))
        self.thread.start()
        return Path(directory) / ckpt._step_name(step) if mesh.rank == 0 else None

    # -- the background thread ----------------------------------------------------------------
    def _write(self, directory, staging, step, rank, world, pieces, extra, event, meta, keep, hook, on_commit) -> None:
        try:
            if event is not None:
                event.synchronize()
            ckpt.write_rank(staging, rank, _hooked(pieces, rank, step, hook), extra)
            if rank == 0:
                _wait_markers(staging, world, step)
                ckpt.commit(directory, step, world, meta, keep=keep)
                if on_commit is not None:
                    on_commit()
        except BaseException as e:  # reported by settle() on the training thread
            self.error = e
            try:
                (staging / failed_file(rank)).write_text(f"{type(e).__name__}: {e}\n")
            except OSError:
                pass


def _wait_markers(staging: Path, world: int, step: int) -> None:
    """Rank 0's writer: until every rank's ``rank_NNNNN.json`` exists (or one failed)."""
    deadline = time.monotonic() + MARKER_TIMEOUT_S
    todo = set(range(world))
    while todo:
        for r in sorted(todo):
            failed = staging / failed_file(r)
            if failed.exists():
                raise CheckpointError(f"rank {r} failed writing step {step}: {failed.read_text().strip()}")
            if (staging / ckpt.rank_file(r, "json")).exists():
                todo.discard(r)
        if todo:
            if time.monotonic() > deadline:
                raise CheckpointError(f"{staging}: ranks {sorted(todo)} did not finish writing step {step} "
                                      f"within {MARKER_TIMEOUT_S:.0f} s")
            time.sleep(0.02)


def _hooked(pieces: list, rank: int, step: int, spec: str) -> list:
    """Tests: the fault ``spec`` of :data:`HOOK_ENV`, injected as the load of the second piece."""
    if not spec:
        return pieces
    kind, r, s = spec.split(":")
    if int(r) != rank or int(s) != step:
        return pieces

    def fault():
        if kind == "exit":
            os._exit(9)
        if kind == "raise":
            raise OSError(f"injected write failure ({HOOK_ENV}={spec})")
        time.sleep(2.0)
    if len(pieces) < 2:  # a rank with (almost) nothing to write: before it starts
        fault()
        return pieces
    p = pieces[1]
    t = p.tensor

    def load():
        fault()
        return t
    return [pieces[0], p._replace(tensor=ckpt.Deferred(tuple(t.shape), t.dtype, load)), *pieces[2:]]


_SAVER: AsyncSaver | None = None


def save(directory, step: int, mesh, pieces, meta, device, keep: int = 3, hook: str = "",
         on_commit=None) -> Path | None:
    """The process's :class:`AsyncSaver` (created on first use) saves."""
    global _SAVER
    if _SAVER is None:
        _SAVER = AsyncSaver()
        ckpt.IN_FLIGHT.append(finish)  # a later synchronous save or the end of the run waits for it
    return _SAVER.save(directory, step, mesh, pieces, meta, device, keep=keep, hook=hook, on_commit=on_commit)


def saver(asynchronous: bool, test_hooks: dict | None = None):
    """The save function a run uses: this module's ``save`` (``checkpoint.async_save``; the run
    plan's ``test_hooks`` arm :data:`HOOK_ENV`) or checkpoint/save.save; both take the same arguments."""
    return functools.partial(save, hook=(test_hooks or {}).get(HOOK_ENV, "")) if asynchronous else ckpt.save


def finish(mesh) -> None:
    """End of training (collective; a no-op where no asynchronous save was started in this
    process): wait for the save in flight, raise on every rank if it failed on any."""
    if _SAVER is not None:
        _SAVER.settle(mesh)
