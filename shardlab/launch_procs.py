"""Rank processes of the local launchers (launch.run, launch_replicas): how they start (a
forkserver with torch and shardlab preloaded for CPU ranks, a fresh interpreter for CUDA ranks)
and never outlive the launcher (the environment they take is launch.py's: launch.enter_rank).
Docs: docs/training.md, "Launcher"; docs/faults.md, "A killed launcher leaves no ranks behind"."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

# What a forkserver imports once, so that each CPU rank starts as a fork of it instead of a fresh
# interpreter importing torch (about 2 s of CPU per rank on a 2-core host; docs/training.md, "Launcher").
# torch._dynamo: every torch optimizer's constructor imports it (torch._compile's _disable_dynamo),
# about 800 modules (sympy among them) and another 2 CPU-s per rank, on every launch.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "shardlab.launch", "shardlab.train.checks",
            "shardlab.train.loop"]


def rank_context(device: str):
    """The multiprocessing context rank processes start from (their target calls
    ``launch.enter_rank`` with the launcher's pid and environment first). CPU ranks: a forkserver
    with torch and shardlab preloaded (it imports but never computes, so no thread pool is
    forked); CUDA ranks: "spawn", a fresh interpreter each (a CUDA context never crosses a fork)."""
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not cpu or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_PR_SET_PDEATHSIG = 1


def set_pdeathsig() -> bool:
    """Linux: ask the kernel to SIGKILL this process when its parent dies. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> str:
    """In a rank process, first thing: never outlive the launcher ``parent_pid`` (docs/faults.md,
    "A killed launcher leaves no ranks behind"). Returns the mechanism used (pdeathsig, watchdog)."""
    # The parent is the launcher, or under a forkserver (rank_context) the server, which exits when
    # the launcher does (its pipe from the launcher closes): dying with it is dying with the launcher.
    parent = os.getppid()
    if parent != parent_pid and not _alive(parent_pid):
        os._exit(1)
    if set_pdeathsig():
        if os.getppid() != parent:
            os._exit(1)
        return "pdeathsig"

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="shardlab-parent-watchdog", daemon=True).start()
    return "watchdog"


def let_forkserver_exit() -> None:
    """In a forkserver's child: close its copy of the server's "alive" pipe, which the server waits
    on to exit. Then the server exits as soon as the launcher does, and this rank, whose parent it
    is, dies with it (die_with_parent) instead of keeping the server, and so itself, alive."""
    from multiprocessing import forkserver
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None
