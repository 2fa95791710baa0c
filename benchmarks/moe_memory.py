"""The planner's activation memory for MoE layouts against the measured peak, fp32 and bf16
autocast, dropless and with a capacity (the tiny MoE of ``shardlab verify``, N = 2, CPU).

    PYTHONPATH=. python benchmarks/moe_memory.py

Each row: predicted activation bytes (``predict``) and the measured peak of the bytes autograd
saves over one step (``analysis.calibrate.measure_layouts``), per rank. Dropless expert parallel
is routing-dependent (the prediction assumes balanced routing); the rest is set by the config.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab.analysis import calibrate as cal  # noqa: E402
from shardlab.analysis.predict import predict  # noqa: E402
from shardlab.analysis.verify import layout_config  # noqa: E402

PROBE = {"flops": 1e10, "alpha": 1e-4, "bw": 1e9, "mem_bw": 1e10}  # time constants: memory does not use them


def main():
    print("| precision | capacity factor | layout | rank | predicted bytes | measured bytes | error |")
    print("|---|---|---|---|---|---|---|")
    for prec in ("fp32", "bf16"):
        for cap in (0.0, 1.25):
            for name in ("moe-dp", "ep2"):
                cfg = layout_config(name, 2, extra={"train": {"precision": prec}, "model": {"moe_capacity_factor": cap}})
                measured = cal.measure_layouts([cfg], 2, warmup=1, steps=0)[0]
                pred = predict(cfg, device="cpu", probe=PROBE)
                for m in measured:
                    p = pred.ranks[m.rank].activations
                    print(f"| {prec} | {cap:g} | {name} | {m.rank} | {p:,.0f} | {m.act_peak:,.0f} | "
                          f"{100 * (p - m.act_peak) / m.act_peak:+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
