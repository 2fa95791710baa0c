"""Automatic restart (docs/faults.md "Automatic restart"): ``--max-restarts K`` resumes a job whose
rank was killed from the newest valid checkpoint, bit for bit the uninterrupted run;
``--elastic MIN:MAX`` goes on with fewer ranks when a rank cannot come back. Ranks are killed with
the TEST-ONLY hooks of shardlab/launch.py (SHARDLAB_TEST_KILL_AT_STEP, SHARDLAB_TEST_REFUSE_RANK)."""
import shutil
from pathlib import Path

import pytest
import torch

from shardlab import config as C
from shardlab.cli import main as cli_main
from shardlab.train.metrics import read_metrics
from shardlab import launch_restart as restart

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=0",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0",
        "--train.steps=6", "--checkpoint.every=2", "--logging.log_every=1"]


def _final_state(run_dir):
    from shardlab.checkpoint.save import Reader, latest_valid
    reader = Reader(latest_valid(Path(run_dir) / "checkpoints"))
    tensors = {k: reader.read(k) for k in reader.keys() if k.startswith(("model.", "optim."))}
    return tensors, int(reader.step)


def _same(a, b):
    (ta, sa), (tb, sb) = _final_state(a), _final_state(b)
    assert sa == sb == 6 and set(ta) == set(tb) and ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def _restarts(run_dir):
    return [r for r in read_metrics(run_dir) if r["kind"] == "restart"]


def test_killed_rank_restarts_bit_exact(tmp_path, monkeypatch, capsys):
    """... and the newest checkpoint is looked up once per start, in the parent (the run plan,
    shardlab/train/plan.py): here once, for the restart (the first start does not resume)."""
    from shardlab.checkpoint import save
    base = TINY + [f"--data.cache_dir={tmp_path}/cache"]
    assert cli_main(["train", "--nproc", "2", *base, f"--logging.run_dir={tmp_path}/full"]) == 0
    monkeypatch.setenv("SHARDLAB_TEST_KILL_AT_STEP", f"1:3:{tmp_path}/killed-once")
    lookups, latest_valid = [], save.latest_valid
    monkeypatch.setattr(save, "latest_valid", lambda d, **kw: lookups.append(Path(d)) or latest_valid(d, **kw))
    capsys.readouterr()
    assert cli_main(["train", "--nproc", "2", *base, f"--logging.run_dir={tmp_path}/killed", "--max-restarts", "1"]) == 0
    assert lookups == [tmp_path / "killed" / "checkpoints"], lookups
    ranks = [p for p in (Path(save.__file__).parents[1] / "train").glob("*.py") if p.name != "plan.py"]
    assert not [p.name for p in ranks if "latest_valid" in p.read_text()]  # ranks read the plan's
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("shardlab: restart ")]
    assert len(line) == 1 and "rank 1 failed (process died (killed by signal 9)" in line[0], err
    assert "step_00000002 at step 2 on 2 rank(s), 1 step(s) to redo" in line[0], line
    print(line[0])
    assert (tmp_path / "killed-once").exists()
    rec, = _restarts(tmp_path / "killed")
    assert (rec["restart"], rec["step"], rec["lost_steps"], rec["failed_rank"], rec["world_size"]) == (1, 2, 1, 1, 2)
    _same(tmp_path / "full", tmp_path / "killed")


def test_without_restarts_a_killed_rank_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLAB_TEST_KILL_AT_STEP", f"0:1:{tmp_path}/once")
    assert cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={tmp_path}/cache",
                     f"--logging.run_dir={tmp_path}/run", "--train.steps=2"]) == 1
    err = capsys.readouterr().err
    assert "rank 0 failed" in err and "shardlab: restart" not in err and not _restarts(tmp_path / "run")


def test_elastic_goes_on_with_fewer_ranks(tmp_path, monkeypatch, capsys):
    base = TINY + [f"--data.cache_dir={tmp_path}/cache"]
    once = tmp_path / "rank3-gone"
    monkeypatch.setenv("SHARDLAB_TEST_KILL_AT_STEP", f"3:3:{once}")
    monkeypatch.setenv("SHARDLAB_TEST_REFUSE_RANK", f"3:{once}")  # once killed, rank 3 cannot come back
    capsys.readouterr()
    assert cli_main(["train", "--nproc", "4", *base, f"--logging.run_dir={tmp_path}/el", "--max-restarts", "2",
                     "--elastic", "2:4"]) == 0
    err = capsys.readouterr().err
    print(err)
    assert "shardlab: elastic: 3 rank(s) refused" in err  # global_batch 4 is not divisible by 3
    first, second = _restarts(tmp_path / "el")
    assert (first["failed_rank"], first["world_size"], first["step"], first["lost_steps"]) == (3, 4, 2, 1)
    assert (second["failed_rank"], second["world_size"], second["step"], second["lost_steps"]) == (3, 2, 2, 0)
    starts = [r for r in read_metrics(tmp_path / "el") if r["kind"] == "start"]
    assert [s["world_size"] for s in starts] == [4, 2]  # the refused start never reached its first record
    # the reference: resume the same checkpoint on 2 ranks ourselves
    ref = tmp_path / "ref" / "checkpoints"
    ref.mkdir(parents=True)
    shutil.copytree(tmp_path / "el" / "checkpoints" / "step_00000002", ref / "step_00000002")
    assert cli_main(["train", "--nproc", "2", *base, f"--logging.run_dir={tmp_path}/ref", "--resume"]) == 0
    _same(tmp_path / "ref", tmp_path / "el")


def test_elastic_arguments_are_checked():
    with pytest.raises(C.ConfigError):
        restart.parse_elastic("4:2")
    with pytest.raises(C.ConfigError):
        restart.parse_elastic("two")
    cfg = C.load(None, ["--parallel.tp=2"])
    with pytest.raises(C.ConfigError) as e:
        restart.check_elastic(cfg, 2, (1, 2))
    assert "plain data parallel" in str(e.value)
    assert restart.resized(C.load(None, ["--train.global_batch=4"]), 2).parallel.dp_replicate == 2


def test_launch_restarts_a_failed_script(tmp_path, capsys):
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os, sys\n"
        "count = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        f"open(r'{tmp_path}/seen-' + os.environ['RANK'] + '-' + str(count), 'w').close()\n"
        "sys.exit(3 if count == 0 and os.environ['RANK'] == '1' else 0)\n")
    assert cli_main(["launch", "--nproc", "2", "--max-restarts", "2", str(script)]) == 0
    err = capsys.readouterr().err
    assert "rank 1 failed (exit code 3)" in err and err.count("shardlab launch: restart 1/2") == 1, err
    assert {p.name for p in tmp_path.glob("seen-*-1")} == {"seen-0-1", "seen-1-1"}
    assert cli_main(["launch", "--nproc", "2", str(script)]) == 3  # no restarts: the failure stands
