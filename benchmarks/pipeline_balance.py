"""The busiest pipeline rank bounds the step (plan_time.busiest_share), checked on this CPU:
a Llama whose head outweighs its blocks, two pipeline ranks (1F1B), measured and
predicted with the planner's step model as it is (the steady state at the busiest rank's pace)
and with every rank at the average's work (the model before 2026-11-27), one probe for both;
the same model without pipelines beside it (docs/planner_limits.md). Run it alone.

    flock -x /tmp/bench.lock env PYTHONPATH=. python benchmarks/pipeline_balance.py [--steps 5] [--d-model 512 --vocab 32768]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))



def big_head(d_model: int, vocab: int) -> dict:
    """A four-block Llama whose head is several blocks' worth of FLOPs (d_model 512, vocabulary 32k:
    about five), large enough that matrix products, not per-operator costs, make its step."""
    return {"model": {"vocab_size": vocab, "d_model": d_model, "n_layers": 4, "n_heads": d_model // 64,
                      "n_kv_heads": d_model // 128, "max_seq_len": 128},
            "train": {"seq_len": 128, "global_batch": 16, "precision": "fp32"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args(argv)
    import planner_calibration as pc
    import shardlab.analysis.plan_time as pl
    from shardlab.analysis import calibrate as cal
    from shardlab.analysis import verify
    from shardlab.analysis.predict import predict
    layouts = [(name, 2, verify.layout_config(name, 2, arch="llama", extra=big_head(a.d_model, a.vocab))) for name in ("dp", "pp2-1f1b")]
    probe = pc._probe("cpu")
    rows = cal.calibrate(layouts, "cpu", probe, 2, a.steps)
    share = pl.busiest_share(layouts[1][2])
    real = pl.busiest_share
    pl.busiest_share = lambda cfg: 1.0
    try:
        even = predict(layouts[1][2], device="cpu", probe=probe).step_time_s
    finally:
        pl.busiest_share = real
    print("| layout | busiest rank's share | predicted ms | predicted ms, ranks at the average | measured ms "
          "| error | error, ranks at the average |\n|---|---:|---:|---:|---:|---:|---:|")
    for row, s, e in zip(rows, (1.0, share), (None, even)):
        ev = f"{1e3 * e:.1f} | " if e else "- | "
        ee = f"{100 * (e / row['step_s'] - 1):+.1f}%" if e else "-"
        print(f"| {row['layout']} | {s:.3f} | {1e3 * row['pred_step_s']:.1f} | {ev}{1e3 * row['step_s']:.1f} "
              f"| {100 * row['step_err']:+.1f}% | {ee} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
