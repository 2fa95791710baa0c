"""Held-out published runs (benchmarks/planner_heldout.toml) predicted by the planner: one row
per run, its error, and the runs refused because they use a feature the planner does not model.

    PYTHONPATH=. python benchmarks/planner_heldout.py      (also part of planner_validation.py)

The runs were written down (source, every setting, every assumption) and committed before any
prediction was made on them; see the file's header and docs/planner.md.
"""
from __future__ import annotations

import statistics
import sys
import tomllib
from pathlib import Path

from shardlab.analysis.devices import get_device
from shardlab.analysis.plan_layout import parse_layout, predict_pinned, refused
from shardlab.analysis.plan_search import HEADROOM
from shardlab.analysis.predict import RESERVED_PER_ALLOCATED, reserved
from shardlab.config import Config

FILE = Path(__file__).with_name("planner_heldout.toml")
GiB = 2**30


def load(path: Path = FILE) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def run_config(run: dict, models: dict):
    """(base Config of a run: model, sequence, batch, precision; its parsed layout)."""
    base = Config()
    for k, v in models[run["model"]].items():
        setattr(base.model, k, v)
    base.model.max_seq_len = base.train.seq_len = run["seq"]
    base.train.precision, base.train.global_batch = "bf16", run["global_batch"]
    # the FSDP mixed-precision policy the run applied, where the file states it (torchtitan's
    # default: bf16 parameters, fp32 reduction; shardlab's train.param_dtype / reduce_dtype)
    base.train.param_dtype, base.train.reduce_dtype = run.get("param_dtype", ""), run.get("reduce_dtype", "")
    if run["system"] == "Megatron-LM":  # as the fit set's Megatron rows: all-reduce after the backward
        base.parallel.overlap_comm = False
    return base, parse_layout(run["layout"])


def predict_run(run: dict, models: dict):
    """(prediction, config, note): ``ac-fit`` layouts take the lightest recomputation that fits."""
    base, spec = run_config(run, models)
    feats = run.get("features", [])
    cfg, pr = predict_pinned(base, spec, run["gpus"], run["gpu"], compile_="compile" in feats,
                             features=() if refused(feats) else feats)
    return pr, cfg, (f"ac-fit: {cfg.parallel.activation_checkpointing}" if spec.get("ac") == "fit" else "")


def value(run: dict, pr, cfg) -> float:
    """The prediction in the run's unit."""
    gpus, unit = run["gpus"], run["unit"]
    if unit == "tok/s/GPU":
        return pr.tokens_per_s / gpus
    if unit == "TFLOP/s/GPU" and run.get("flop_count") == "spec":
        return pr.tokens_per_s / gpus * pr.flops_per_token / 1e12
    if unit == "MFU" and run.get("flop_count") == "megatron72":
        m, s, b = cfg.model, cfg.train.seq_len, cfg.train.global_batch
        h, l, v = m.d_model, m.n_layers, m.vocab_size
        flops = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
        return 100 * flops / pr.step_time_s / gpus / get_device(run["gpu"]).peak_flops
    raise ValueError(f"{run['id']}: unit {unit!r} with flop_count {run.get('flop_count')!r} is not known")


def rows(path: Path = FILE) -> list[dict]:
    data = load(path)
    out = []
    for run in data["run"]:
        pr, cfg, note = predict_run(run, data["models"])
        no = refused(run.get("features", []))
        got = None if no else value(run, pr, cfg)
        resv = reserved(pr.peak.total, run["gpu"]) / GiB
        pub = run.get("memory_gib") if run.get("memory_kind") == "reserved" else None
        out.append({"run": run, "predicted": got, "refused": no, "note": note,
                    "error": None if got is None else (got - run["published"]) / run["published"],
                    "peak_gib": pr.peak.total / GiB, "fits": pr.peak.total <= HEADROOM * get_device(run["gpu"]).memory,
                    "reserved_gib": resv, "mem_error": None if pub is None else (resv - pub) / pub})
    return out


def print_table(table: list[dict]) -> list[float]:
    """The held-out table (markdown); returns the absolute errors of the modelled rows."""
    print("| run | source | GPUs | layout | unit | published | predicted | error | peak GiB allocated (bf16 layout) "
          f"| predicted reserved GiB ({RESERVED_PER_ALLOCATED:.2f}x) | published GiB | memory error | note |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    errs = []
    for r in table:
        run = r["run"]
        pub_mem = f"{run['memory_gib']} {run.get('memory_kind', '')}" if "memory_gib" in run else ""
        mem_err = "" if r["mem_error"] is None else f"{100 * r['mem_error']:+.1f}%"
        if r["refused"]:
            got, err = "refused", ", ".join(r["refused"]) + " not modelled"
        else:
            got, err = f"{r['predicted']:,.1f}", f"{100 * r['error']:+.1f}%"
            errs.append(abs(r["error"]))
        print(f"| {run['id']} | {run['source']} | {run['gpus']} {run['gpu']} | {run['layout']} | {run['unit']} | "
              f"{run['published']:,} | {got} | {err} | {r['peak_gib']:.1f}{'' if r['fits'] else ' (over 92%)'} | "
              f"{r['reserved_gib']:.1f} | {pub_mem} | {mem_err} | {'; '.join(x for x in (', '.join(run.get('features', [])), r['note']) if x)} |")
    return errs


def summary(errs: list[float], table: list[dict]) -> str:
    n_ref = sum(1 for r in table if r["refused"])
    feats = sorted({f for r in table for f in r["refused"]})
    if not errs:
        return f"held-out: no modelled rows; {n_ref} refused"
    priced = sorted({f for r in table if not r["refused"] for f in r["run"].get("features", [])})
    return (f"held-out median absolute error {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}% over "
            f"{len(errs)} modelled rows (features priced: {', '.join(priced) or 'none'}); "
            + (f"{n_ref} rows refused by name ({', '.join(feats)}: not modelled)" if n_ref else "none refused"))


def memory_summary(table: list[dict]) -> str:
    """The memory side: predicted reserved bytes (allocated x the stated ratio) against the
    published reserved figures, signed median and range."""
    errs = [r["mem_error"] for r in table if r["mem_error"] is not None]
    if not errs:
        return "held-out memory: no run publishes reserved bytes"
    return (f"held-out memory: predicted reserved (allocated x {RESERVED_PER_ALLOCATED:.2f}) against published "
            f"reserved over {len(errs)} runs: median absolute error {100 * statistics.median(map(abs, errs)):.1f}%, "
            f"from {100 * min(errs):+.1f}% to {100 * max(errs):+.1f}%")


def main() -> int:
    table = rows()
    errs = print_table(table)
    print("\n" + summary(errs, table))
    print(memory_summary(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
