"""The flight-recorder report where no launch.run parent collects the dumps (torchrun, Ray).

``flight.dump_all`` calls :func:`report_here` when a rank's Comm call fails and its recorder has a
``run_dir`` (``shardlab train`` sets ``<run_dir>/flight``): the rank prints the same report the
local launcher prints (docs/faults.md, Hangs and desyncs), from the dumps of this run's ranks.
"""
from __future__ import annotations

import glob
import os
import sys
import time

_START = time.time()
_REPORTED: list = []


def report_here(rec, collect, diagnose, wait_s: float = 5.0) -> str:
    """Under torchrun or Ray no parent of ours reads the ranks' dumps: the failing rank prints the
    report itself (once), from the dumps the ranks of this run wrote into ``rec.run_dir`` (files
    older than this process by over a minute are an earlier run's and ignored), waiting up to
    ``wait_s`` for the other ranks' (they dump when their own collective fails). ``collect`` and
    ``diagnose``: flight.py's (passed in: this module imports nothing of it, no import cycle)."""
    if _REPORTED:
        return ""
    _REPORTED.append(True)
    nproc = 1 + max((m for members in rec.groups.values() for m in members), default=rec.rank)
    deadline = time.time() + wait_s
    while time.time() < deadline and len(_fresh(rec.run_dir)) < nproc:
        time.sleep(0.1)
    dumps = {r: d for r, d in collect(rec.run_dir, nproc, wait_s=0).items() if r in _fresh(rec.run_dir)}
    text = "\n".join([f"rank {rec.rank}: communication at the failure (flight recorder):",
                      *diagnose(dumps, nproc), f"  full dumps: {rec.run_dir}"])
    print(text, file=sys.stderr, flush=True)
    return text


def _fresh(directory: str) -> set:
    out = set()
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        try:
            if os.path.getmtime(path) >= _START - 60:
                out.add(int(os.path.basename(path)[4:-5]))
        except (OSError, ValueError):
            pass
    return out
