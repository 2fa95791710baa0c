"""Planner calibration: predicted vs measured per-rank memory and step time for ~37 layouts.

    python benchmarks/planner_calibration.py [--layouts a:2,b:4] [--steps 5] [--device cpu]
        [--out benchmarks/results/planner_calibration.md]

Each layout (``shardlab.analysis.verify.LAYOUTS``, degrees filled to N ranks with data parallel)
runs the tiny/small Llama, the tiny MoE or a tiny GPT-2 in fp32 on N spawned ranks, one layout at
a time (``shardlab.analysis.calibrate``: what is measured is described there). Per group of ranks
with identical figures: model-state bytes predicted vs measured (exact?), peak saved activations
(predicted, measured, error), and per layout the step time (predicted after the probe, measured:
slowest rank's median of the timed steps, error). Summary: all model state exact, the largest
activation error, the median absolute step-time error.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shardlab.analysis import calibrate as cal  # noqa: E402
from shardlab.analysis import verify  # noqa: E402
from shardlab.parallel.expert import padded_dispatch  # noqa: E402


def _preset(name: str, keep=("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                             "max_seq_len", "n_experts", "moe_top_k", "moe_capacity_factor")) -> dict:
    """{model, train} overrides from configs/<name>.toml (model shape, seq_len, global_batch), fp32."""
    with open(ROOT / "configs" / f"{name}.toml", "rb") as fh:
        c = tomllib.load(fh)
    t = c.get("train", {})
    return {"model": {k: v for k, v in c["model"].items() if k in keep},
            "train": {"seq_len": t["seq_len"], "global_batch": t["global_batch"], "precision": "fp32"}}


TINY, SMALL, MOE = _preset("tiny"), _preset("small"), _preset("tiny-moe")
GPT2 = {"model": {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 128},
        "train": {"seq_len": 128, "global_batch": 16, "precision": "fp32"}}
# (label, verify layout, N, arch, overrides)
LAYOUTS = [
    ("dp", "dp", 1, "llama", TINY),
    ("dp", "dp", 2, "llama", TINY),
    ("dp-accum", "dp-accum", 2, "llama", TINY),
    ("zero1", "zero1", 2, "llama", TINY),
    ("zero2", "zero2", 4, "llama", TINY),
    ("fsdp", "fsdp", 4, "llama", TINY),
    ("fsdp", "fsdp", 8, "llama", TINY),
    ("hsdp", "hsdp", 4, "llama", TINY),
    ("tp2", "tp2", 2, "llama", TINY),
    ("tp2-sp", "tp2-sp", 2, "llama", TINY),
    ("tp4", "tp4", 4, "llama", TINY),
    ("tp2-fsdp", "tp2-fsdp", 4, "llama", TINY),
    ("pp2-gpipe", "pp2-gpipe", 2, "llama", TINY),
    ("pp2-1f1b", "pp2-1f1b", 2, "llama", TINY),
    ("pp2-interleaved", "pp2-interleaved", 2, "llama", TINY),
    ("pp2-zb", "pp2-zb", 2, "llama", TINY),
    ("pp2-tp2", "pp2-tp2", 4, "llama", TINY),
    ("dp2-tp2-pp2", "dp2-tp2-pp2", 8, "llama", TINY),
    ("cp2", "cp2", 2, "llama", TINY),
    ("ac-full", "dp-ac-full", 2, "llama", TINY),
    ("tp2-ac-selective", "tp2-ac-selective", 2, "llama", TINY),
    ("fsdp-ac-full", "fsdp-ac-full", 2, "llama", TINY),
    ("fsdp-ac-op", "fsdp-ac-op", 2, "llama", TINY),
    ("tp2-sp-ac-op", "tp2-sp-ac-op", 2, "llama", TINY),
    ("ep2", "ep2", 2, "llama", MOE),
    ("moe-dp", "moe-dp", 2, "llama", MOE),
    ("pp2-fsdp", "pp2-fsdp", 4, "llama", TINY),
    ("pp2-zero1", "pp2-zero1", 4, "llama", TINY),
    ("pp2-dualpipev", "pp2-dualpipev", 2, "llama", TINY),
    ("pp2-dualpipe", "pp2-dualpipe", 2, "llama", TINY),
    ("cp2-ulysses", "cp2-ulysses", 2, "llama", TINY),
    ("cp4-unified", "cp4-unified", 4, "llama", TINY),
    ("ep2-zero2", "ep2-zero2", 2, "llama", MOE),
    ("ep2-fsdp", "ep2-fsdp", 4, "llama", MOE),
    # the routing-dependent ones: only the kept rows travel, so memory follows the router
    ("ep2 exact", "ep2", 2, "llama", {**MOE, "parallel": {"ep_dispatch": "exact"}}),
    ("ep2 dropless", "ep2", 2, "llama", {**MOE, "model": {**MOE["model"], "moe_capacity_factor": 0.0}}),
    ("small dp", "dp", 2, "llama", SMALL),
    ("small zero2", "zero2", 2, "llama", SMALL),
    ("gpt2 dp", "dp", 2, "gpt2", GPT2),
    ("gpt2 tp2", "tp2", 2, "gpt2", GPT2),
    ("gpt2 pp2-1f1b", "pp2-1f1b", 2, "gpt2", GPT2),
    ("gpt2 ac-op", "dp-ac-op", 2, "gpt2", GPT2),
    ("gpt2 tp2 math", "tp2", 2, "gpt2", {**GPT2, "model": {**GPT2["model"], "attention": "math", "dropout": 0.1}}),
]


def configs(selected: list[str] | None = None):
    """(label, N, config) of the LAYOUTS (or those whose 'label:N' is in ``selected``) that fit."""
    out = []
    for label, name, n, arch, extra in LAYOUTS:
        if selected and f"{label}:{n}" not in selected:
            continue
        cfg = verify.layout_config(name, n, arch=arch, extra=extra)
        if cfg is None:
            raise SystemExit(f"layout {label} does not fit {n} ranks")
        out.append((label, n, cfg))
    return out


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _ranks(ids: list[int]) -> str:
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) \
        else ",".join(map(str, ids))


def table(rows: list[dict]) -> str:
    head = ("| layout | N | ranks | stage | model state pred MiB | meas MiB | exact | act pred MiB | act meas MiB "
            "| act err | step pred ms | step meas ms | step err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['layout']} | {row['nproc']} | failed: {row['error']} |")
            continue
        groups: dict[tuple, list[int]] = {}
        for r in row["ranks"]:
            m, p = r["meas"], r["pred"]
            key = (m.stage, m.model_state, m.act_peak, None if p is None else (p.params + p.grads + p.optim),
                   None if p is None else p.activations, r["state_exact"])
            groups.setdefault(key, []).append(r["rank"])
        for i, ((stage, ms, act, ps, pa, exact), ids) in enumerate(groups.items()):
            step = (f"{1e3 * row['pred_step_s']:.1f}" if row["pred_step_s"] else "-",
                    f"{1e3 * row['step_s']:.1f}", _pct(row["step_err"])) if i == 0 else ("", "", "")
            lines.append(f"| {row['layout'] if i == 0 else ''} | {row['nproc'] if i == 0 else ''} | {_ranks(ids)} "
                         f"| {stage} | {_mib(ps)} | {_mib(ms)} | {'-' if exact is None else 'yes' if exact else 'NO'} "
                         f"| {_mib(pa)} | {_mib(act)} | {_pct(cal.rel_err(pa, act) if pa is not None else None)} "
                         f"| {' | '.join(step)} |")
    return "\n".join(lines)


def wgrad_table(rows: list[dict]) -> str:
    """Split backward (ZB-H1, DualPipe/V): per rank, the predicted W stash vs the engine's
    ``wgrad_peak_bytes`` (inputs and output gradients held from B to W, outside autograd)."""
    lines = ["| layout | N | rank | stage | W stash pred MiB | meas MiB | err |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        for r in row.get("ranks", []):
            if r["meas"].wgrad_peak and r["pred"] is not None:
                lines.append(f"| {row['layout']} | {row['nproc']} | {r['rank']} | {r['meas'].stage} "
                             f"| {_mib(r['pred'].wgrad)} | {_mib(r['meas'].wgrad_peak)} | {_pct(r['wgrad_err'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def cuda_table(rows: list[dict]) -> str:
    """On CUDA: per rank, the predicted total vs torch.cuda.max_memory_allocated over the timed steps."""
    lines = ["| layout | N | rank | pred total MiB | max allocated MiB | err |", "|---|---|---|---|---|---|"]
    for row in rows:
        for r in row.get("ranks", []):
            if r["meas"].max_alloc is not None:
                p = r["pred"]
                lines.append(f"| {row['layout']} | {row['nproc']} | {r['rank']} | {_mib(p.total if p else None)} "
                             f"| {_mib(r['meas'].max_alloc)} | {_pct(r['alloc_err'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def routed(cfg) -> bool:
    """True when a rank's activation shapes follow the router: expert parallel whose rows travel
    unpadded (``parallel.ep_dispatch = exact``, or dropless); with the padded dispatch they are set
    by the capacity (parallel/expert.py)."""
    m, p = cfg.model, cfg.parallel
    return bool(m.n_experts) and p.ep > 1 and not padded_dispatch(p.ep_dispatch, m.moe_capacity_factor)


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    exact = [r["state_exact"] for r in ok if r["state_exact"] is not None]
    fixed = [r for r in ok if r["act_err_max"] is not None and not routed(r["cfg"])]
    acts = [r["act_err_max"] for r in fixed]
    steps = [abs(r["step_err"]) for r in ok if r["step_err"] is not None]
    out = [f"layouts: {len(rows)} ({len(rows) - len(ok)} failed); ranks measured: "
           f"{sum(len(r['ranks']) for r in ok)}"]
    out += [f"{r['layout']}:{r['nproc']}: {r['pred_error']}" for r in ok if r.get("pred_error")]
    if not exact:
        out.append("no prediction available (shardlab.analysis.predict not importable): measured side only")
        return "\n".join(f"- {s}" for s in out)
    bad = [r["layout"] + f":{r['nproc']}" for r in ok if r["state_exact"] is False]
    out.append(f"model state exact on every rank: {'yes' if all(exact) else 'NO (' + ', '.join(bad) + ')'}")
    if fixed:
        worst = max(fixed, key=lambda r: abs(r["act_err_max"]))
        out.append(f"max |activation error|: {100 * max(map(abs, acts)):.1f}% ({worst['layout']}:{worst['nproc']})"
                   f" over the {len(fixed)} layouts whose shapes do not depend on the routing")
    dep = [f"{r['layout']}:{r['nproc']} {100 * r['act_err_max']:+.1f}%" for r in ok
           if r["act_err_max"] is not None and routed(r["cfg"])]
    if dep:
        out.append("routing-dependent (expert parallel, exact dispatch or dropless; predicted: balanced routing, "
                   "the expectation): " + ", ".join(dep))
    if steps:
        out.append(f"median |step-time error|: {100 * statistics.median(steps):.1f}% over {len(steps)} layouts"
                   f" (max {100 * max(steps):.1f}%)")
    return "\n".join(f"- {s}" for s in out)


def _probe(device: str):
    """The planner's CPU throughput probe (``analysis.devices.probe_cpu``), measured once before
    the layouts run; None on other devices (their constants are tabulated)."""
    if device != "cpu":
        return None
    try:
        from shardlab.analysis.devices import probe_cpu
    except ImportError:
        return None
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:  # measured now, under the same load as the layouts
        return probe_cpu(cache_dir=tmp, refresh=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="", help="comma-separated label:N (default: all)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="")
    ap.add_argument("--gpu", default="", help="on cuda: the planner's device kind for the predictions "
                                              "(h100, h200, a100; default: from the device's name)")
    a = ap.parse_args(argv)
    pred_device = a.device
    if a.device == "cuda":
        import torch
        from shardlab.analysis.devices import gpu_kind
        pred_device = a.gpu or gpu_kind(torch.cuda.get_device_name(0)) or ""
        if not pred_device:
            ap.error(f"--gpu: no planner constants for {torch.cuda.get_device_name(0)!r}; name one (h100, h200, a100)")
    selected = [s.strip() for s in a.layouts.split(",") if s.strip()] or None
    layouts = configs(selected)
    probe = _probe(a.device)
    if probe:
        print("probe: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in probe.items()), file=sys.stderr)

    def log(row):
        print(f"  {row['layout']}:{row['nproc']}  {row['seconds']:.1f} s", file=sys.stderr, flush=True)
    rows = cal.calibrate(layouts, a.device, probe, a.warmup, a.steps, log=log, pred_device=pred_device)
    tab, summ, ctab, wtab = table(rows), summary(rows), cuda_table(rows), wgrad_table(rows)
    print(tab)
    print(summ)
    for extra in (wtab, ctab):
        if extra:
            print(extra)
    if a.out:
        from _ranks import write_table
        notes = ("Model state: bytes after the first optimizer step (parameters, gradients, optimizer "
                 "states; every storage once). Activations: peak of the saved-tensor bytes held at once during "
                 "one step (all micro-batches), parameters/buffers/flat buffers excluded. Step: slowest rank's "
                 f"median of {a.steps} timed steps after {a.warmup} warm-up; device {a.device}, fp32, 1 thread/rank."
                 + ("\n\nProbe (measured before the layouts, analysis/devices.py probe_cpu): "
                    + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in probe.items())
                    if probe else ""))
        write_table(a.out, "# Planner calibration", tab, summ, *[t for t in (wtab, ctab) if t], notes)


if __name__ == "__main__":
    main()
