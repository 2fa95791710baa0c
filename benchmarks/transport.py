"""Whole training steps on the two CPU transports: the process group (gloo) against the
shared-memory transport (docs/collectives.md, "Shared-memory transport"), layout by layout.

    python benchmarks/transport.py [--layouts tp2:2,moe-dp:2] [--steps 7] [--rounds 2] [--thread]

Each layout is one of the planner calibration's (benchmarks/planner_calibration.py: the tiny
Llama, MoE or GPT-2 in fp32, one thread per rank) and runs ``--rounds`` times on each transport,
alternating, each run ``--steps`` timed steps after 2 warm-up (``shardlab.analysis.calibrate``:
the step is the slowest rank's median). Printed per layout: the median over its runs of each
transport's step, the ratio, and the spread of the steps within the runs (slowest rank's
fastest / slowest step), which is how much the machine moved meanwhile. ``--thread`` adds a
third column: the shared-memory transport with ``parallel.comm_thread`` (its asynchronous
collectives on a thread of each comm; distributed/shm_thread.py).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT = ("dp:2,zero2:4,fsdp:4,hsdp:4,tp2:2,tp2-sp:2,tp4:4,pp2-1f1b:2,cp2:2,cp4-unified:4,"
           "ep2:2,moe-dp:2,small dp:2")
TRANSPORTS = ("process_group", "shared")
THREAD = "shared+thread"  # the shared transport with parallel.comm_thread


def _slowest_steps(ms) -> list:
    """The timed steps of the rank whose median is the largest."""
    return max((m.step_times for m in ms), key=statistics.median)


def main(argv=None) -> None:
    import planner_calibration as pc
    from shardlab.analysis import calibrate as cal
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=DEFAULT, help="comma-separated label:N of the calibration's layouts")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2, help="runs per transport and layout, alternating")
    ap.add_argument("--thread", action="store_true", help="also the shared transport with parallel.comm_thread")
    args = ap.parse_args(argv)
    t0 = time.time()
    variants = TRANSPORTS + ((THREAD,) if args.thread else ())
    extra = (" | shared+thread step ms | shared / shared+thread | shared+thread steps min-max", "|---|---|---")
    print("| layout | N | gloo step ms | shared step ms | gloo / shared | gloo steps min-max | shared steps min-max"
          f"{extra[0] if args.thread else ''} |")
    print(f"|---|---|---|---|---|---|---{extra[1] if args.thread else ''}|")
    for label, n, cfg in pc.configs(args.layouts.split(",")):
        runs = {tr: [] for tr in variants}
        for _ in range(args.rounds):
            for tr in variants:
                c = copy.deepcopy(cfg)
                c.parallel.comm_transport = "shared" if tr == THREAD else tr
                c.parallel.comm_thread = tr == THREAD
                runs[tr].append(_slowest_steps(cal.measure_layout(c, n, warmup=2, steps=args.steps)))
        med = {tr: statistics.median(statistics.median(r) for r in runs[tr]) * 1e3 for tr in variants}
        span = {tr: f"{min(map(min, runs[tr])) * 1e3:.1f}-{max(map(max, runs[tr])) * 1e3:.1f}" for tr in variants}
        more = f" | {med[THREAD]:.1f} | {med['shared'] / med[THREAD]:.2f}x | {span[THREAD]}" if args.thread else ""
        print(f"| {label} | {n} | {med['process_group']:.1f} | {med['shared']:.1f} | "
              f"{med['process_group'] / med['shared']:.2f}x | {span['process_group']} | {span['shared']}{more} |",
              flush=True)
    print(f"\n{args.rounds} runs per transport and layout, alternating, {args.steps} timed steps each after 2 "
          f"warm-up; fp32, 1 thread per rank; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
