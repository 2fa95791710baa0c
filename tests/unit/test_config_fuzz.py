"""Seeded config fuzzer: mutations of configs/tiny.toml and of examples/ds_config.json run through
``shardlab config show``; each must exit 2 with exactly one stderr line (no traceback) or exit 0,
as an independent table of what each mutation kind should do says. Plus the user-study cases."""
import json
import random
import re
import warnings
from pathlib import Path

import pytest

from shardlab.cli import main as cli_main

ROOT = Path(__file__).parents[2]
TINY = (ROOT / "configs/tiny.toml").read_text()
DS = json.loads((ROOT / "examples/ds_config.json").read_text())
INF = float("inf")

# tiny.toml keys -> (section, zero allowed?, a different valid value)
KEYS = {"vocab_size": ("model", False, "512"), "d_model": ("model", False, "64"), "n_layers": ("model", False, "2"),
        "n_heads": ("model", False, "2"), "n_kv_heads": ("model", True, "4"), "max_seq_len": ("model", False, "256"),
        "steps": ("train", False, "10"), "global_batch": ("train", False, "32"), "seq_len": ("train", False, "64"),
        "lr": ("train", False, "1e-4"), "warmup_steps": ("train", True, "0"), "eval_every": ("train", True, "7"),
        "eval_batches": ("train", False, "1"), "log_every": ("logging", False, "1"), "every": ("checkpoint", True, "5"),
        "keep": ("checkpoint", False, "9")}
# kind -> (TOML value or None for a structural mutation, exit code; None = per-key rule)
TOML_KINDS = {"delete": 0, "duplicate": 2, "string": 2, "negative": 2, "zero": None, "inf": 2, "nan": 2,
              "huge": 2, "list": 2, "table": 2, "valid": 0, "unknown_key": 2, "section_scalar": 2,
              "fraction": 2, "bool": 2, "bad_bool": 2, "good_bool": 0}
VALUES = {"string": '"abc"', "negative": "-3", "zero": "0", "inf": "inf", "nan": "nan", "huge": str(2**62),
          "list": "[1, 2]", "table": "{ a = 1 }", "fraction": "2.5", "bool": "true"}


def mutate_toml(rng: random.Random, kind: str) -> tuple[str, int]:
    key = rng.choice(sorted(KEYS))
    section, zero_ok, valid = KEYS[key]
    line = re.compile(rf"^{key} = .*$", re.M)
    if kind == "delete":
        return line.sub("", TINY, count=1), 0
    if kind == "duplicate":
        return line.sub(lambda m: m.group(0) + "\n" + m.group(0), TINY, count=1), 2
    if kind == "valid":
        return line.sub(f"{key} = {valid}", TINY, count=1), 0
    if kind == "unknown_key":
        return line.sub(f"{key}x = 1", TINY, count=1), 2
    if kind == "section_scalar":
        sec = rng.choice(["model", "train", "logging", "checkpoint"])
        body = re.compile(rf"^\[{sec}\]\n(?:[^\[\n].*\n|\n)*", re.M)
        return body.sub(f"{sec} = 5\n", TINY, count=1), 2
    if kind in ("bad_bool", "good_bool"):
        value = rng.choice(['"yes"', '"on"', "2", '"maybe"']) if kind == "bad_bool" else rng.choice(
            ["true", "false", '"true"', '"0"', "1"])
        return TINY.replace("[logging]\n", f"[logging]\nprogress = {value}\n"), TOML_KINDS[kind]
    if kind == "fraction" and key == "lr":
        return line.sub("lr = 1e400", TINY, count=1), 2  # lr is a float: overflow instead
    expected = (0 if zero_ok else 2) if kind == "zero" else TOML_KINDS[kind]
    return line.sub(f"{key} = {VALUES[kind]}", TINY, count=1), expected


def _set(path: tuple, value):
    def apply(ds):
        d = ds
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return apply


# DeepSpeed mutations: (description, mutation, exit code), the expectation written down per case
DS_CASES = [(f"delete {k}", (lambda k: lambda ds: ds.pop(k))(k),
             2 if k == "train_micro_batch_size_per_gpu" else 0)  # then no batch key: DeepSpeed refuses it
            for k in DS] + [
    *[(f"{sec} = {v!r}", _set((sec,), v), 2) for sec in ("optimizer", "scheduler", "bf16", "zero_optimization",
                                                         "fp16", "activation_checkpointing")
      for v in (True, 5, "AdamW", [1])],
    *[(f"{sec} = null", _set((sec,), None), 0) for sec in ("optimizer", "scheduler", "bf16", "zero_optimization")],
    *[(f"stage {v!r}", _set(("zero_optimization", "stage"), v), 0 if v in (0, 1, 2, 3) and v is not True else 2)
      for v in (0, 1, 2, 3, 4, -1, "2", 2.5, True, None)],
    *[(f"{k} = {v!r}", _set((k,), v), 0 if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0)
       else 2) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
      for v in ("auto", 3, 0, -1, 2.5, "x", True, [2])],
    *[(f"gradient_clipping = {v!r}", _set(("gradient_clipping",), v), 0 if v in ("auto", 0.5, 0) else 2)
      for v in ("auto", 0.5, 0, -1, "x", INF, [1])],
    *[(f"lr = {v!r} (no scheduler: the optimizer's lr is the peak)",
       (lambda v: lambda ds: (ds.pop("scheduler"), _set(("optimizer", "params", "lr"), v)(ds)))(v),
       0 if v in ("auto", 1e-4) else 2)
      for v in ("auto", 1e-4, -1, 0, "fast", 100, INF, None)],
    *[(f"betas = {v!r}", _set(("optimizer", "params", "betas"), v), 0 if v in ("auto", [0.8, 0.9]) else 2)
      for v in ("auto", [0.8, 0.9], [1.5, 0.9], 0.9, ["a", "b"], [0.9])],
    *[(f"bf16.enabled = {v!r}", _set(("bf16", "enabled"), v), rc)
      for v, rc in ((True, 0), (False, 0), ("auto", 0), ("yes", 2), (1, 2), (None, 0))],
    ("fp16 true as well", _set(("fp16",), {"enabled": True}), 2),
    ("fp16 disabled", _set(("fp16",), {"enabled": False}), 0),
    *[(f"autotp_size = {v!r}", _set(("autotp_size",), v), 0 if v in (1, 2) else 2) for v in (1, 2, 0, "x", 2.5)],
    *[(f"model = {v!r}", _set(("model",), v), 0 if v == {"d_model": 64, "n_heads": 2} else 2)
      for v in ({"d_model": 64, "n_heads": 2}, {"d_model": -1}, {"bogus": 1}, 5, {"n_heads": 3})],
    *[(f"warmup_num_steps = {v!r}", _set(("scheduler", "params", "warmup_num_steps"), v),
       0 if v in (5, "auto") else 2) for v in (5, "auto", -5, 2.5, "x")],
    *[(f"scheduler.type = {v!r}", _set(("scheduler", "type"), v), 0 if v == "WarmupLR" else 2)
      for v in ("WarmupLR", "WarmupCosineLR", "OneCycle", 5, None)],  # WarmupCosineLR: no total_num_steps
]
TOP = [("top list", [DS]), ("top null", None), ("top string", "ds"), ("top number", 3)]


def run_show(path, capsys, extra=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DeepSpeed keys shardlab ignores are named in a warning
        rc = cli_main(["config", "show", str(path), *extra])
    out = capsys.readouterr()
    return rc, out.err.strip()


def check(rc, err, expected, what):
    assert "Traceback" not in err, what
    assert rc == expected, f"{what}: exit {rc}, expected {expected}: {err}"
    if expected == 2:
        assert err and "\n" not in err and err.startswith("config error: "), f"{what}: {err!r}"


def test_fuzz_tiny_toml(tmp_path, capsys):
    rng = random.Random(1234)
    kinds = list(TOML_KINDS) * 3 + [rng.choice(list(TOML_KINDS)) for _ in range(70)]
    assert len(kinds) >= 100
    for i, kind in enumerate(kinds):
        text, expected = mutate_toml(rng, kind)
        path = tmp_path / f"m{i}.toml"
        path.write_text(text)
        rc, err = run_show(path, capsys)
        check(rc, err, expected, f"{kind} mutation #{i}:\n{text}")


def test_fuzz_deepspeed_json(tmp_path, capsys):
    rng = random.Random(4321)
    cases = DS_CASES + [rng.choice(DS_CASES) for _ in range(max(0, 110 - len(DS_CASES)))]
    assert len(cases) + len(TOP) >= 100
    for i, (what, mutation, expected) in enumerate(cases):
        ds = json.loads(json.dumps(DS))
        mutation(ds)
        path = tmp_path / f"ds{i}.json"
        path.write_text(json.dumps(ds))
        rc, err = run_show(path, capsys)
        check(rc, err, expected, f"{what}: {json.dumps(ds)}")
    for what, data in TOP:
        path = tmp_path / "top.json"
        path.write_text(json.dumps(data))
        check(*run_show(path, capsys), 2, what)


# The user study's cases: 9 tracebacks and the values accepted although meaningless.
@pytest.mark.parametrize("override, field", [
    ("--train.global_batch=-4", "train.global_batch"), ("--train.global_batch=0", "train.global_batch"),
    ("--train.seq_len=-1", "train.seq_len"), ("--train.seq_len=0", "train.seq_len"),
    ("--model.n_kv_heads=-2", "model.n_kv_heads"), ("--model.ffn_hidden=-8", "model.ffn_hidden"),
    ("--train.timeout_s=-1", "train.timeout_s"), ("--train.timeout_s=0", "train.timeout_s"),
    ("--train.threads=-1", "train.threads"), ("--checkpoint.every=-5", "checkpoint.every"),
    ("--parallel.bucket_cap_mb=-1", "parallel.bucket_cap_mb"), ("--parallel.bucket_cap_mb=0", "parallel.bucket_cap_mb"),
    ("--model.rope_theta=-1", "model.rope_theta"), ("--model.rope_theta=0", "model.rope_theta"),
    ("--train.eps=-1e-8", "train.eps"), ("--train.eps=0", "train.eps"), ("--train.beta1=1.5", "train.beta1"),
    ("--train.lr=inf", "train.lr"), ("--train.lr=nan", "train.lr"), ("--train.lr=1e400", "train.lr"),
    (f"--model.d_model={2**40}", "model.d_model"), ("--parallel.tp=2.5", "parallel.tp"),
    ("--data.dataset=", "data.dataset"), ("--logging.run_dir=", "logging.run_dir"),
    ("--train.steps=1e400", "train.steps"), ("--logging.progress=yes", "logging.progress"),
])
def test_study_override_refused(override, field, capsys):
    rc, err = run_show(ROOT / "configs/tiny.toml", capsys, [override])
    check(rc, err, 2, override)
    assert err.startswith(f"config error: {field}: "), err


def test_range_error_names_value_limit_and_doc(capsys):
    assert run_show(ROOT / "configs/tiny.toml", capsys, ["--train.global_batch=-4"])[1] == (
        "config error: train.global_batch: got -4; must be >= 1, <= 16777216 (Sequences per optimizer step "
        "over all data-parallel ranks and micro-batches)")
    assert "<= 65536" in run_show(ROOT / "configs/tiny.toml", capsys, [f"--model.d_model={2**40}"])[1]
    rc, out = cli_main(["config", "show", "configs/tiny.toml"]), capsys.readouterr().out
    assert rc == 0 and "global_batch = 16  # Sequences per optimizer step" in out and "[>= 1, <= 16777216]" in out


@pytest.mark.parametrize("what, content, suffix", [
    ("binary", b"\xff\xfe\x00\x01model", ".toml"), ("json list", b"[1, 2]", ".json"), ("json null", b"null", ".json"),
    ("json string", b'"ds"', ".json"), ("section not a table", b"model = 5\n", ".toml"),
    ("zero_optimization 5", json.dumps({"train_batch_size": 8, "zero_optimization": 5}).encode(), ".json"),
    ("fp16 true", json.dumps({"train_batch_size": 8, "fp16": True}).encode(), ".json"),
    ("optimizer string", json.dumps({"train_batch_size": 8, "optimizer": "AdamW"}).encode(), ".json"),
])
def test_study_file_refused(what, content, suffix, tmp_path, capsys):
    path = tmp_path / f"c{suffix}"
    path.write_bytes(content)
    check(*run_show(path, capsys), 2, what)


def test_directory_refused(tmp_path, capsys):
    rc, err = run_show(tmp_path, capsys)
    check(rc, err, 2, "directory")
    assert "is a directory" in err


def test_fp16_true_says_the_fix(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": True}))
    assert 'write "fp16": {"enabled": true}' in run_show(path, capsys)[1]


def test_deepspeed_auto_autotp_and_model(tmp_path):
    from shardlab import config as C
    from shardlab.config.deepspeed import resolve_batch
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
            "gradient_clipping": "auto", "autotp_size": 2, "model": {"d_model": 64, "n_heads": 2}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(auto))
    cfg = C.load(path, ["--train.global_batch=8", "--parallel.microbatches=2"])
    # "auto" keeps shardlab's values; bf16 "auto" follows train.precision (fp32 unless set)
    assert (cfg.train.global_batch, cfg.parallel.microbatches, cfg.train.precision) == (8, 2, "fp32")
    assert (cfg.train.lr, cfg.train.grad_clip) == (C.TrainConfig().lr, C.TrainConfig().grad_clip)
    assert (cfg.parallel.tp, cfg.model.d_model, cfg.model.n_heads) == (2, 64, 2)
    # the HF rule with a known world size: train_batch_size = micro * accumulation * dp ranks (world / tp)
    ds = resolve_batch({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2, "autotp_size": 2}, world_size=8)
    assert ds["train_batch_size"] == 4 * 2 * 4


def test_verify_honours_model_overrides(capsys):
    assert cli_main(["verify", "--nproc", "1", "--layouts", "dp", "--model.n_heads=3"]) == 2
    assert "model.n_heads: 3 does not divide d_model=32" in capsys.readouterr().err
    assert cli_main(["verify", "--nproc", "1", "--layouts", "dp", "--model.d_model=-3"]) == 2
    assert cli_main(["verify", "--nproc", "2", "--parallel.tp=2"]) == 2
    assert "each layout sets its own parallel degrees" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["verify", "--nproc", "0"], "--nproc"), (["verify", "--steps", "0"], "--steps"),
    (["verify", "--nproc", "3", "--layouts", "tp2,cp2"], "--nproc"),  # nothing fits: not "0 passed, 0 failed"
    (["memory", "configs/tiny.toml", "--nproc", "0"], "--nproc"),
    (["plan", "llama-8b", "--gpus", "8", "--seq", "0"], "--seq"),
    (["plan", "llama-8b", "--gpus", "8", "--global-batch", "-4"], "--global-batch"),
    (["plan", "llama-8b", "--gpus", "8", "--tp", "0"], "--tp"),
    (["plan", "llama-8b", "--gpus", "8", "--zero", "5"], "--zero"),
    (["plan", "llama-8b", "--gpus", "8", "--gpus-per-node", "0"], "--gpus-per-node"),
    (["plan", "llama-8b", "--gpus", "12", "--gpus-per-node", "8"], "--gpus-per-node"),  # 1.5 nodes, was planned
    (["generate", "smollm2", "--prompt", "hi", "--top-k", "-1"], "--top-k"),  # was named --temperature
    (["train", "configs/tiny.toml", "--launcher", "ray", "--ray-num-cpus", "-1", "--dry-run"], "--ray-num-cpus"),
    (["train", "configs/tiny.toml", "--launcher", "ray", "--ray-cpus-per-worker", "-1", "--dry-run"],
     "--ray-cpus-per-worker"),  # dry runs passed both; the launch refused them later
])
def test_counts_below_one_are_refused_in_one_line(argv, flag, capsys):
    """A zero or negative count is refused naming its flag (exit 2), where it used to mean the default
    (plan's --seq 0, --tp 0), an empty run (verify's "0 passed, 0 failed", exit 0) or a search of
    nothing (plan's --global-batch -4, exit 1)."""
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"config error: {flag}:"), err
