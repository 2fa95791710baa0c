"""Reporting a rank's result or error to the launcher (``launch.run``, ``launch_replicas.run``)."""
from __future__ import annotations

import pickle
import traceback

import torch.distributed as dist


def report_to(results, tag: tuple, body) -> None:
    """In a rank: put ``(*tag, "ok", pickled body())`` or ``(*tag, "error", traceback)`` on the
    ``results`` queue (then exit 1); the process group is destroyed at the end either way."""
    try:
        # Plain pickle: tensors travel by value (torch's queue reducers would pass shared-memory
        # handles that die with this process).
        results.put((*tag, "ok", pickle.dumps(body())))
    except BaseException as e:  # report everything, including KeyboardInterrupt
        results.put((*tag, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
