"""``shardlab plan --layout``: the layout grammar (analysis/plan_layout.py), its refusals (one line
naming the part and the fix, exit 2), features the planner does not model refused by name, the
search's uneven pipeline splits, and the held-out published runs all expressible."""
import tomllib
from pathlib import Path

import pytest

from shardlab.analysis.plan_layout import apply_layout, parse_layout
from shardlab.analysis.plan_search import enumerate_layouts, layout_label
from shardlab.cli import main
from shardlab.commands.plan_cmd import load_model
from shardlab.config import Config
from shardlab.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _base(model="llama-405b", seq=8192):
    base = load_model(model)
    base.train.precision, base.train.seq_len = "bf16", seq
    base.model.max_seq_len = max(base.model.max_seq_len, seq)
    return base


def test_parse_the_issue_layout():
    spec = parse_layout("fsdp8 tp8sp pp8 interleaved:2 mb4x8 ac-full")
    assert spec == {"zero": 3, "dp": 8, "tp": 8, "sp": True, "pp": 8, "schedule": "interleaved", "virtual": 2,
                    "mb": 4, "micro": 8, "ac": "full"}
    cfg = apply_layout(_base(), spec, 512)
    p = cfg.parallel
    assert (p.dp_shard, p.tp, p.pp, p.pp_virtual, p.microbatches, p.zero_stage) == (8, 8, 8, 2, 8, 3)
    assert cfg.train.global_batch == 4 * 8 * 8 and p.sequence_parallel and p.activation_checkpointing == "full"


@pytest.mark.parametrize("label", [
    "fsdp8 tp8sp pp8:interleavedv2 mb4x8 ac-full",
    "fsdp16 tp4sp cp8 pp32:dualpipev mb2x64 ac-op",
    "rep4 fsdp8 tp8sp mb1x2",
    "zero1-16 tp8sp pp8:zb-h1 mb1x16 ac-selective",
    "ddp64 tp8 cp2-ulysses mb1x1",
    "fsdp64 tp8sp pp16:interleavedv8 split-ends mb1x32",
])
def test_printed_labels_parse_back_to_the_same_layout(label):
    """Every label the search prints is a valid --layout (the 405B on 8,192 GPUs, 126 layers:
    uneven stages)."""
    spec = parse_layout(label)
    gpus = 1
    for k in ("dp", "rep", "tp", "cp", "pp"):
        gpus *= spec.get(k, 1)
    cfg = apply_layout(_base(), spec, gpus)
    assert layout_label(cfg) == label


@pytest.mark.parametrize("layout, gpus, part", [
    ("fsdp8 tp8 bogus", 64, "'bogus'"),
    ("fsdp8 tp8 tp8", 64, "given twice"),
    ("fsdp4 tp8", 64, "multiply to 32 ranks, not --gpus 64"),
    ("fsdp8 interleaved:2", 8, "needs a ppN part"),
    ("fsdp8 pp8 1f1b:2", 64, "interleaved schedule only"),
    ("fsdp8 ac-sometimes", 8, "ac-none, ac-selective, ac-op, ac-full"),
    ("fsdp8 tp3", 24, "parallel.tp"),
    ("fsdp8 tp0", 8, "'tp0'"),
    ("fsdp4 pp2 split-middle mb1x2", 8, "split-balanced, split-ends"),
    ("fsdp4 pp2 split-ends mb1x2", 8, "pp*pp_virtual >= 3"),
    ("fsdp8 split-ends", 8, "use it with pp > 1"),
])
def test_bad_layouts_are_one_line_naming_the_part_exit_2(capsys, layout, gpus, part):
    assert main(["plan", "llama-405b", "--gpus", str(gpus), "--layout", layout]) == 2
    err = capsys.readouterr().err.strip()
    assert "--layout" in err and part in err and "\n" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag, gpu, layout, says", [
    ("--float8", "a100", "fsdp8 mb2x1 ac-op", "no fp8 tensor cores"),
    ("--async-tp", "h100", "fsdp8 mb2x1 ac-op", "tpNsp"),
])
def test_features_that_cannot_be_priced_are_refused_by_name(capsys, flag, gpu, layout, says):
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", gpu, "--layout", layout, flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and flag in err and says in err, err


def test_pinned_layout_prints_one_row_and_says_when_it_does_not_fit(capsys):
    rc = main(["plan", "llama-8b", "--gpus", "8", "--gpu", "h100-gt", "--seq", "8192",
               "--layout", "fsdp8 mb2x1 ac-op", "--compile"])
    out = capsys.readouterr().out
    assert rc == 0 and "fsdp8 mb2x1 ac-op" in out and "predicted fastest" not in out, out
    rc = main(["plan", "llama-405b", "--gpus", "8", "--gpu", "h100", "--layout", "fsdp8 mb1x1"])
    out = capsys.readouterr().out
    assert rc == 1 and "does not fit" in out, out


def test_search_offers_uneven_interleaved_splits():
    """126 layers on 8 stages x 2 (or 4) virtual stages: not a divisor, offered anyway (the engine
    balances stages by parameters); before, --schedule interleaved --pp 8 found no layout."""
    base = _base()
    base.train.global_batch = 256
    found = {(c.parallel.pp_virtual, c.parallel.microbatches)
             for c in enumerate_layouts(base, 512, 8, {"tp": 8, "pp": 8, "cp": 1, "schedule": "interleaved",
                                                        "zero": 3, "ac": "full"})}
    assert {v for v, _ in found} == {2, 4} and 126 % (8 * 2) and 126 % (8 * 4)
    assert {m for _, m in found} == {8, 16, 32}  # micro-batches of 4, 2 and 1 sequence (8 would leave 4 < pp)


def test_search_keeps_the_split_it_is_given():
    """--pp-split ends: every pipelined layout the search offers has the embedding and the head in
    stages of their own (pp x v >= 3; pp 2 with 1F1B cannot, and is not offered); unfixed, none."""
    base = _base()
    base.train.global_batch = 256
    fixed = {"tp": 8, "cp": 1, "zero": 3, "ac": "full", "mb": 1}
    ends = [c.parallel for c in enumerate_layouts(base, 512, 8, {**fixed, "pp_split": "ends"}) if c.parallel.pp > 1]
    plain = [c.parallel for c in enumerate_layouts(base, 512, 8, fixed) if c.parallel.pp > 1]
    assert ends and all(p.pp_split == "ends" and p.pp * p.pp_virtual >= 3 for p in ends)
    assert {(p.pp, p.pp_schedule) for p in plain} >= {(2, "1f1b")} and not any(p.pp == 2 and p.pp_virtual == 1 for p in ends)
    assert all(p.pp_split == "balanced" for p in plain)


def test_every_heldout_run_is_expressible():
    data = tomllib.loads((ROOT / "benchmarks" / "planner_heldout.toml").read_text())
    assert len(data["run"]) >= 20 and len({r["system"] for r in data["run"]}) >= 3
    for run in data["run"]:
        spec = parse_layout(run["layout"])
        base = Config()
        for k, v in data["models"][run["model"]].items():
            setattr(base.model, k, v)
        base.model.max_seq_len = base.train.seq_len = run["seq"]
        base.train.precision, base.train.global_batch = "bf16", run["global_batch"]
        spec.pop("ac", None) if spec.get("ac") == "fit" else None
        cfg = apply_layout(base, spec, run["gpus"])
        assert cfg.parallel.world_size == run["gpus"] and cfg.train.global_batch == run["global_batch"], run["id"]


def test_layout_and_fixed_degrees_together_are_refused():
    with pytest.raises(ConfigError, match="inside --layout"):
        from shardlab.commands import plan_cmd
        import argparse
        ap = argparse.ArgumentParser()
        plan_cmd.configure(ap)
        plan_cmd.main(ap.parse_args(["llama-8b", "--gpus", "8", "--tp", "2", "--layout", "fsdp4 tp2"]))


def test_ac_fit_takes_the_lightest_recomputation_that_fits():
    from shardlab.analysis.plan_layout import AC_MODES, predict_pinned
    from shardlab.analysis.plan_search import HEADROOM
    from shardlab.analysis.predict import predict
    base = _base("llama-8b")
    base.train.global_batch = 16
    cfg, pred = predict_pinned(base, parse_layout("fsdp8 mb2x1 ac-fit"), 8, "h100")
    chosen = cfg.parallel.activation_checkpointing
    cap = HEADROOM * 80e9
    assert pred.peak.total <= cap
    for lighter in AC_MODES[:AC_MODES.index(chosen)]:  # every lighter mode is over the capacity
        c = apply_layout(base, {**parse_layout("fsdp8 mb2x1"), "ac": lighter}, 8)
        assert predict(c, "h100", per_rank=False).peak.total > cap, lighter
    assert chosen != "none"  # 8B at 2 x 8,192 tokens per GPU needs recomputation on 80 GB


def test_reserved_column_is_the_stated_ratio_of_allocated(capsys):
    """The reserved estimate (predict.RESERVED_PER_ALLOCATED) is the median of the nine H100 rows
    it names (reserved / allocated as measured, 1.06-1.56x), printed beside the allocated total;
    on CPU a rank's peak is resident bytes, with nothing reserved beyond it."""
    import statistics
    from shardlab.analysis.predict import H100_RESERVED_ROWS, RESERVED_PER_ALLOCATED, reserved
    ratios = [r / a for _, r, a in H100_RESERVED_ROWS]
    assert len(ratios) == 9 and all(r > 1 for r in ratios)
    assert RESERVED_PER_ALLOCATED == statistics.median(ratios)
    assert reserved(10 * 2**30, "cpu") == 10 * 2**30
    assert reserved(10 * 2**30, "h100") == pytest.approx(10 * 2**30 * RESERVED_PER_ALLOCATED)
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", "h100-gt", "--seq", "8192",
                 "--layout", "fsdp8 mb2x1 ac-op", "--compile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if "total GiB" in line)
    assert "reserved" in lines[head] and "reserved" in lines[head - 1]
    total, resv = (float(x) for x in lines[head + 1].split()[-4:-2])
    assert resv == pytest.approx(total * RESERVED_PER_ALLOCATED, abs=0.06), lines[head + 1]


def test_heldout_memory_side_compares_reserved_with_reserved():
    """Only runs whose source publishes reserved bytes get a memory error, and it is the predicted
    reserved (allocated x the ratio) against that figure."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planner_heldout
    table = [{"mem_error": None}, {"mem_error": -0.10}, {"mem_error": 0.02}, {"mem_error": -0.30}]
    line = planner_heldout.memory_summary(table)
    assert "over 3 runs" in line and "median absolute error 10.0%" in line and "-30.0% to +2.0%" in line
    assert "no run" in planner_heldout.memory_summary([{"mem_error": None}])
