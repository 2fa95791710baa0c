"""Where the test suite's time goes: a pytest plugin that records, around each test, the wall
seconds and the whole machine's busy CPU-seconds (``/proc/stat``: every process, the ranks a test
spawns included), and a report of the costliest files and tests. Run it serially with nothing else
on the machine (docs/status.md, The test suite):

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p suite_cpu tests   # writes suite_cpu.jsonl
    python benchmarks/suite_cpu.py suite_cpu.jsonl                           # the tables

``SUITE_CPU_OUT`` names the file (default ``suite_cpu.jsonl``, appended to; one per xdist worker).
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _out_path() -> str:
    base = os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{base}.{worker}" if worker else base


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, wall = _busy_s(), time.perf_counter()
    yield
    with open(_out_path(), "a") as f:
        f.write(json.dumps({"id": item.nodeid, "busy_s": _busy_s() - busy,
                            "wall_s": time.perf_counter() - wall}) + "\n")


def report(path: str, top: int = 15) -> None:
    rows = [json.loads(line) for line in open(path)]
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["id"].split("::")[0]]
        f[0], f[1], f[2] = f[0] + r["busy_s"], f[1] + r["wall_s"], f[2] + 1
    busy, wall = sum(r["busy_s"] for r in rows), sum(r["wall_s"] for r in rows)
    print(f"{len(rows)} tests, {wall / 60:.1f} min wall, {busy:,.0f} CPU-s busy ({busy / max(wall, 1e-9):.2f} cores)\n")
    print("| file | CPU-s | wall s | tests |\n|---|---:|---:|---:|")
    for name, (b, w, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name} | {b:,.0f} | {w:,.0f} | {n} |")
    print("\n| test | CPU-s | wall s |\n|---|---:|---:|")
    for r in sorted(rows, key=lambda r: -r["busy_s"])[:top]:
        print(f"| {r['id']} | {r['busy_s']:,.0f} | {r['wall_s']:,.0f} |")


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "suite_cpu.jsonl"
    if not os.path.isfile(path):
        print(f"suite_cpu: {path} does not exist; record one first: "
              "PYTHONPATH=benchmarks python -m pytest -q -p suite_cpu tests", file=sys.stderr)
        sys.exit(2)
    report(path)
