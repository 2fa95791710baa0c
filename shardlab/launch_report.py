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


def close_dump_dir(dump_dir: str, ok: bool, err=None, say=None) -> None:
    """At the end of a launch (launch.run, launch_ray.run): remove the flight-recorder dump
    directory after a success, when it holds nothing, or after bad input found by a rank (one line,
    no report); else keep it and name it, unless the failure's report (``err``) already does."""
    import os
    import shutil
    import sys
    from .errors import BAD_INPUT
    try:
        held = os.listdir(dump_dir)
    except OSError:
        return
    root = str(err).split("\n")[1] if err is not None and "\n" in str(err) else ""
    if ok or not held or root.startswith(BAD_INPUT):
        shutil.rmtree(dump_dir, ignore_errors=True)
    elif err is None or dump_dir not in str(err):
        (say or (lambda m: print(m, file=sys.stderr, flush=True)))(
            f"shardlab: flight-recorder dumps of the ranks kept in {dump_dir}")
