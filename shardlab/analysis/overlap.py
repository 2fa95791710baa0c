"""How much of a step's communication ran while compute ran, read from the Chrome traces of
``shardlab train --profile N``: |union(comm) & union(compute)| / |union(comm)|, which events
count as either on a GPU and on a CPU trace: docs/training.md, "Overlap" (``--profile``)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

COMM_WORDS = ("nccl", "gloo:", "allreduce", "all_reduce", "reduce_scatter", "reducescatter",
              "all_gather", "allgather", "alltoall", "all_to_all", "broadcast", "sendrecv")
"""Substrings (lower case) of a communication event's name."""
NOT_COMPUTE = ("c10d::", "wait", "record_param_comms", "profilerstep")
"""CPU operators of the loop's thread that are not compute: collective calls, waits, markers."""


def merge(spans) -> list[tuple[float, float]]:
    """The union of ``[(start, end), ...]`` as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def intersect(xs, ys) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract(xs, ys) -> list[tuple[float, float]]:
    """``xs`` without ``ys`` (both sorted disjoint interval lists)."""
    out, j = [], 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while a < b and k < len(ys) and ys[k][0] < b:
            if ys[k][0] > a:
                out.append((a, ys[k][0]))
            a = max(a, ys[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def _is_comm(name: str) -> bool:
    n = name.lower()
    return any(w in n for w in COMM_WORDS)


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Trace categories of work on the GPU."""
LAUNCHES = ("cuda_runtime", "cuda_driver")
"""Trace categories of the host calls that queue it (their ``correlation`` names the work)."""


def _launched(spans, events) -> tuple[set, list]:
    """The correlation ids of the GPU work launched (``cuda_runtime`` / ``cuda_driver`` calls)
    inside ``spans`` on their own thread, and the spans that launched nothing. The shared
    transport on CUDA queues its copies and reductions on a stream of its own (shm_cuda.py): its
    communication is that GPU work, not the host span that queued it."""
    calls = [e for e in events if e.get("cat") in LAUNCHES]
    ids, idle = set(), []
    for s in spans:
        inside = [c["args"]["correlation"] for c in calls if c.get("tid") == s.get("tid") and "correlation" in
                  c.get("args", {}) and s["ts"] <= c["ts"] <= s["ts"] + s["dur"]]
        ids.update(inside)
        if not inside:
            idle.append(s)
    return ids, idle


def _unrecorded_launches(events) -> set:
    """The correlation ids of GPU work launched from threads with no recorded operator: a thread
    started before the profiler (``parallel.comm_thread``'s) has no operators in the trace unless
    the profiler ran with ``profile_all_threads`` (train/loop.py asks for it where torch has it),
    yet CUPTI still records its launches. In shardlab that thread
    only runs collectives, so its GPU work is communication."""
    seen = {e.get("tid") for e in events if e.get("cat") in ("cpu_op", "user_annotation")}
    return {e["args"]["correlation"] for e in events if e.get("cat") in LAUNCHES
            and e.get("tid") not in seen and "correlation" in e.get("args", {})}


def overlap(trace) -> dict:
    """{comm_us, overlapped_us, exposed_us, fraction, device, steps} of a Chrome trace (a path or
    the loaded dict); exposed = communication with nothing computing beside it; steps = the
    profiled steps the trace holds (its ``ProfilerStep#`` spans)."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    main = Counter(e.get("tid") for e in ops).most_common(1)
    tid = main[0][0] if main else None
    # the host-side spans; a GPU trace also projects each onto the GPU (``gpu_user_annotation``:
    # first to last kernel of the range, waits included), which is not compute-free time
    inline = [e for e in events if e["name"].startswith("shm:") and e.get("cat") != "gpu_user_annotation"]
    other = [e for e in events if e["name"].lower().startswith("gloo:") or
             (e.get("tid") != tid and e.get("cat") == "user_annotation" and _is_comm(e["name"])
              and not e["name"].startswith("shm:"))]
    if kernels:  # host-side collectives (gloo) run on the same clock as the kernels
        ids, idle = _launched(inline, events)
        ids |= _unrecorded_launches(events)
        gpu = [e for e in events if e.get("cat") in GPU_WORK]
        shm = [e for e in gpu if e.get("args", {}).get("correlation") in ids]
        comm = other + idle + shm + [e for e in kernels if _is_comm(e["name"])]
        compute = [e for e in kernels if not _is_comm(e["name"]) and e.get("args", {}).get("correlation") not in ids]
        inline = idle
        device = "gpu"
    else:
        comm = inline + other
        compute = [e for e in ops if e.get("tid") == tid and not any(w in e["name"].lower() for w in NOT_COMPUTE)]
        device = "cpu"
    c = merge((e["ts"], e["ts"] + e["dur"]) for e in comm)
    k = merge((e["ts"], e["ts"] + e["dur"]) for e in compute)
    # the shared transport's copies and reductions inside its shm: spans on the loop's thread are
    # its communication (on the comm thread they are not the loop's operators anyway)
    k = subtract(k, merge((e["ts"], e["ts"] + e["dur"]) for e in inline if device == "gpu" or e.get("tid") == tid))
    comm_us = sum(b - a for a, b in c)
    both = intersect(c, k)
    steps = sum(1 for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    return {"comm_us": comm_us, "overlapped_us": both, "exposed_us": comm_us - both,
            "fraction": both / comm_us if comm_us else 0.0, "device": device, "steps": steps}


def report(profile_dir) -> str:
    """One line per rank trace in ``profile_dir``: communication time, the share that overlapped
    compute, and the exposed communication per profiled step."""
    rows = []
    for path in sorted(Path(profile_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:] or 0)):
        o = overlap(path)
        per = f", {o['exposed_us'] / 1e3 / o['steps']:.1f} ms exposed per step" if o["steps"] else ""
        rows.append(f"{path.stem}: {o['comm_us'] / 1e3:.1f} ms communicating, "
                    f"{100 * o['fraction']:.0f}% of it overlapped with compute{per}")
    return "; ".join(rows)
