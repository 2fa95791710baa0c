"""Where the planner's held-out time predictions fall short: per held-out run in tokens/s/GPU
(benchmarks/planner_heldout.toml), the predicted step, the published one (the predicted step x
predicted / published rate), their difference, and that difference as a share of the predicted
FSDP communication per step and of the predicted compute (docs/planner_validation.md). An
analysis of held-out rows: nothing in the model is fitted to it.

    PYTHONPATH=. python benchmarks/planner_shortfall.py
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_heldout import load, predict_run, value  # noqa: E402


def main() -> int:
    d = load()
    print("| run | GPU | error | predicted step s | published step s | shortfall s | / FSDP communication | / compute |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for run in d["run"]:
        if run["unit"] != "tok/s/GPU":
            continue
        pr, cfg, _ = predict_run(run, d["models"])
        got, b = value(run, pr, cfg), pr.breakdown
        step = pr.step_time_s
        short = step * got / run["published"] - step
        comm = short / b["dp_comm"] if b["dp_comm"] else float("nan")
        print(f"| {run['id']} | {run['gpu']} | {100 * (got / run['published'] - 1):+.1f}% | {step:.3f} | "
              f"{step + short:.3f} | {short:.3f} | {comm:.2f} | {short / b['compute']:.2f} |")
        by_gpu.setdefault(run["gpu"], []).append((comm, short / b["compute"]))
    for gpu, xs in by_gpu.items():
        c, k = [x for x, _ in xs], [y for _, y in xs]
        print(f"{gpu}: {len(xs)} runs; shortfall / FSDP communication {min(c):.2f}-{max(c):.2f} (median "
              f"{statistics.median(c):.2f}), / compute {min(k):.2f}-{max(k):.2f} (median {statistics.median(k):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
