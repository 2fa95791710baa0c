"""Whole training steps on the two CPU transports: the process group (gloo) against the
shared-memory transport (docs/collectives.md, "Shared-memory transport"), layout by layout.

    python benchmarks/transport.py [--layouts tp2:2,moe-dp:2] [--steps 7] [--rounds 2]

Each layout is one of the planner calibration's (benchmarks/planner_calibration.py: the tiny
Llama, MoE or GPT-2 in fp32, one thread per rank) and runs ``--rounds`` times on each transport,
alternating, each run ``--steps`` timed steps after 2 warm-up (``shardlab.analysis.calibrate``:
the step is the slowest rank's median). Printed per layout: the median over its runs of each
transport's step, the ratio, and the spread of the steps within the runs (slowest rank's
fastest / slowest step), which is how much the machine moved meanwhile.
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
    args = ap.parse_args(argv)
    t0 = time.time()
    print("| layout | N | gloo step ms | shared step ms | gloo / shared | gloo steps min-max | shared steps min-max |")
    print("|---|---|---|---|---|---|---|")
    for label, n, cfg in pc.configs(args.layouts.split(",")):
        runs = {tr: [] for tr in TRANSPORTS}
        for _ in range(args.rounds):
            for tr in TRANSPORTS:
                c = copy.deepcopy(cfg)
                c.parallel.comm_transport = tr
                runs[tr].append(_slowest_steps(cal.measure_layout(c, n, warmup=2, steps=args.steps)))
        med = {tr: statistics.median(statistics.median(r) for r in runs[tr]) * 1e3 for tr in TRANSPORTS}
        span = {tr: f"{min(map(min, runs[tr])) * 1e3:.1f}-{max(map(max, runs[tr])) * 1e3:.1f}" for tr in TRANSPORTS}
        print(f"| {label} | {n} | {med['process_group']:.1f} | {med['shared']:.1f} | "
              f"{med['process_group'] / med['shared']:.2f}x | {span['process_group']} | {span['shared']} |", flush=True)
    print(f"\n{args.rounds} runs per transport and layout, alternating, {args.steps} timed steps each after 2 "
          f"warm-up; fp32, 1 thread per rank; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
