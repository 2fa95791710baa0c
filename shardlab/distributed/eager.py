"""Communication that runs eagerly inside a compiled block.

``parallel.compile`` compiles each block's call (``Module.compile()``), forward hooks included,
and collectives run inside it: ZeRO-3's gather / free hooks, TP / SP / Ulysses / expert
all-to-alls, ring attention. Dynamo must not trace into the transports' host code (it failed there,
e.g. where a message grew the shared-memory arena: docs/composition.md), so those entry points are
wrapped with :func:`eager`: once :func:`prepare` has run (parallelize and ``engine.compile`` do,
before they compile), each call goes through ``torch.compiler.disable`` (a graph break, the call
eager); before, the function is called directly, unless dynamo is tracing it (a compile nobody
prepared: your own ``torch.compile(model)`` of a shardlab.initialize model), when that one wrapper
turns eager the same way. ``torch.compiler.disable`` imports ``torch._dynamo``, about 1.3 s of a
command's start on this CPU, so nothing pays it that does not compile.
"""
from __future__ import annotations

import functools
import weakref

import torch

_pending: weakref.WeakSet = weakref.WeakSet()  # wrappers made before prepare() (an engine's hooks die with it)
_prepared = False


def eager(fn):
    """``fn``, run outside any compiled graph once :func:`prepare` has run."""
    slot: list = [None]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        run = slot[0]
        if run is None:
            if not torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            # traced by a compile nobody prepared (your own torch.compile(model)): eager from now on
            run = slot[0] = torch.compiler.disable(fn)
        return run(*args, **kwargs)

    call._eager_slot = slot
    if _prepared:
        slot[0] = torch.compiler.disable(fn)
    else:
        _pending.add(call)
    return call


def prepare() -> None:
    """From now on every :func:`eager` function (made before or after) runs outside compiled
    graphs. Idempotent; per process (the wrappers are module-level functions and methods)."""
    global _prepared
    if _prepared:
        return
    for call in list(_pending):
        call._eager_slot[0] = torch.compiler.disable(call.__wrapped__)
    _pending.clear()
    _prepared = True
