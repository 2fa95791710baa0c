"""Each module registers its own cross-field config check (config/validation.py: ``register_check``);
``validate`` runs them all and refuses to run with one missing, so no check is skipped silently."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.config import Config
from shardlab.config.validation import CHECKS, ORDER

ROOT = Path(__file__).resolve().parents[2]
# One config per registered check (in ORDER), violating that check only: (overrides, --nproc, field)
CASES = {
    "train.checks.check_model": (["--model.arch=cnn", "--parallel.tp=2"], 2, "parallel.tp"),
    "parallel.tensor.check_config": (["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                      "--train.seq_len=127"], 2, "train.seq_len"),
    "parallel.context.check_config": (["--parallel.cp=2", "--train.seq_len=126"], 2, "train.seq_len"),
    "parallel.ulysses.check_config": (["--parallel.cp_ulysses=2"], 1, "parallel.cp_ulysses"),
    "parallel.expert.check_config": (["--parallel.dp_shard=2", "--parallel.ep=2"], 2, "parallel.ep"),
    "parallel.pipeline.schedule.check_config": (["--parallel.pp_virtual=2"], 1, "parallel.pp_virtual"),
    "parallel.pipeline.sharded.check_config": (["--parallel.pp=2", "--parallel.microbatches=2",
                                                "--parallel.zero_stage=3", "--parallel.offload=true"], 2,
                                               "parallel.offload"),
    "parallel.zero.check_config": (["--parallel.offload=true"], 1, "parallel.offload"),
    "config.validation.check_dtypes": (["--parallel.tp=2", "--train.reduce_dtype=bf16"], 2, "train.reduce_dtype"),
    "train.checks.check_task": (["--train.seq_len=256"], 1, "train.seq_len"),
    "config.validation.check_batch": (["--parallel.dp_shard=2", "--train.global_batch=3"], 2, "train.global_batch"),
    "train.checks.check_adapters": (["--train.lora_rank=4", "--train.lora_targets=nothing.*"], 1,
                                    "train.lora_targets"),
}
SCRIPT = """
import contextlib, io, json, sys
from shardlab import cli
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    out.append([code, (err.getvalue().strip().splitlines() or [""])[-1]])
print(json.dumps(out))
"""


def test_every_required_check_has_a_case_and_is_registered():
    assert list(CASES) == list(ORDER)
    assert set(ORDER) <= set(CHECKS)  # conftest imports shardlab.train.checks, as entry points do


def test_each_check_refuses_through_the_cli_in_a_fresh_process():
    """``shardlab config show`` and ``shardlab train --dry-run`` in a new interpreter (no test
    imports): every registered check still refuses its config, naming the field (exit 2)."""
    argvs = [[*cmd, "configs/tiny.toml", "--nproc", str(n), *over]
             for over, n, _ in CASES.values() for cmd in (["config", "show"], ["train", "--dry-run"])]
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argvs)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    fields = [field for _, _, field in CASES.values() for _ in range(2)]
    for argv, (code, line), field in zip(argvs, results, fields):
        assert code == 2 and line.startswith(f"config error: {field}:"), (argv, code, line)


def test_validate_refuses_to_run_without_a_registered_check(monkeypatch):
    monkeypatch.delitem(CHECKS, "parallel.tensor.check_config")
    with pytest.raises(RuntimeError, match="parallel.tensor.check_config.*import shardlab.train.checks"):
        Config().validate(1)
