"""Bad checkpoints on ``shardlab train --resume``: one line naming the file and the fix, exit 2,
nothing overwritten (the checkpoint directory is byte-for-byte unchanged)."""
import hashlib
import json
from pathlib import Path

import pytest

from shardlab.cli import main as cli_main

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=1",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0",
        "--checkpoint.every=2"]


def _digest(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    args = ["train", "--nproc", "2", *TINY, f"--data.cache_dir={tmp}/cache", f"--logging.run_dir={tmp}/run",
            "--train.steps=2"]
    assert cli_main(args) == 0
    return tmp


def _damage(run: Path, how: str) -> Path:
    step = run / "checkpoints" / "step_00000002"
    shard = step / "rank_00000.safetensors"
    if how == "index":
        (step / "index.json").unlink()
        return step / "index.json"
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        return shard
    data = bytearray(shard.read_bytes())            # flip one byte of the first tensor's data
    header = int.from_bytes(data[:8], "little")
    info = json.loads(data[8:8 + header])
    first = min(v["data_offsets"][0] for k, v in info.items() if k != "__metadata__")
    data[8 + header + first] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.parametrize("how", ["index", "truncate", "flip"])
def test_resume_refuses_damaged_checkpoint(saved, tmp_path, how, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(saved / "run" / "checkpoints", run / "checkpoints")
    bad = _damage(run, how)
    before = _digest(run / "checkpoints")
    code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={run}",
                     "--train.steps=4", "--resume"])
    lines = capsys.readouterr().err.strip().splitlines()
    # the start-up banner, and the skipped checkpoint named on stderr (stdout before 2026-12-08)
    err = [x for x in lines if not x.startswith(("shardlab: training ", "shardlab: skipping damaged checkpoint: "))]
    assert code == 2, lines
    assert len(err) == 1 and not any("Traceback" in x for x in lines), lines
    assert (bad.name if how != "index" else "index.json") in err[0] or str(bad.parent) in err[0], err
    assert _digest(run / "checkpoints") == before


def _copy_run(saved: Path, tmp_path: Path, checkpoints: bool = True) -> Path:
    import shutil
    run = tmp_path / "run"
    shutil.copytree(saved / "run", run, ignore=None if checkpoints else shutil.ignore_patterns("checkpoints"))
    return run


@pytest.mark.parametrize("case", ["checkpoints", "metrics-only", "checkpoint.dir", "dry-run"])
def test_a_second_run_where_one_lives_is_refused_and_nothing_changes(saved, tmp_path, case, capsys):
    """Without --resume, a run into a directory holding an earlier run is refused in one line
    naming the field and the three ways on (the docs/training.md transcript), before anything
    starts; the earlier run's files are byte-for-byte unchanged."""
    run = _copy_run(saved, tmp_path, checkpoints=case != "metrics-only")
    extra = {"checkpoint.dir": [f"--logging.run_dir={tmp_path}/new", f"--checkpoint.dir={run}/checkpoints"],
             "dry-run": [f"--logging.run_dir={run}", "--dry-run"]}.get(case, [f"--logging.run_dir={run}"])
    before = _digest(run)
    code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", "--train.steps=4", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    want = {"checkpoints": f"config error: logging.run_dir: {run}/checkpoints holds an earlier run (checkpoints up "
                           "to step_00000002); pass --resume to continue it, --overwrite to replace it, or "
                           "--run-dir DIR for a new run",
            "metrics-only": f"config error: logging.run_dir: {run} holds an earlier run (metrics.jsonl, no checkpoint); "
                            "pass --overwrite to replace it, or --run-dir DIR for a new run",
            "checkpoint.dir": f"config error: checkpoint.dir: {run}/checkpoints holds an earlier run (checkpoints up to "
                              "step_00000002); pass --resume to continue it, --overwrite to replace it, or "
                              "--checkpoint.dir=DIR for a new run"}
    assert err[0] == want.get(case, want["checkpoints"]), err
    assert _digest(run) == before and not (tmp_path / "new").exists()


def test_overwrite_replaces_the_earlier_run_and_keeps_other_files(saved, tmp_path, capsys):
    """--overwrite removes what the earlier run wrote (its metrics and checkpoints), leaves the
    user's own file, and the directory then holds one run: one start record, its checkpoints only.
    With --resume it is refused (they contradict)."""
    run = _copy_run(saved, tmp_path)
    (run / "notes.txt").write_text("mine")
    args = ["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={run}",
            "--train.steps=1", "--overwrite"]
    assert cli_main([*args, "--resume"]) == 2
    assert capsys.readouterr().err.strip() == ("config error: --overwrite: starts over, --resume (checkpoint.resume) "
                                               "continues the run; pass one")
    assert (run / "checkpoints" / "step_00000002").is_dir()  # the refusal removed nothing
    assert cli_main(args) == 0
    assert f"shardlab: --overwrite: removed the earlier run in {run}/checkpoints (checkpoints up to step_00000002)" \
        in capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]
    starts = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "start"]
    assert len(starts) == 1 and (run / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("change", ["--model.d_model=64", "--model.arch=gpt2", "--train.lora_rank=4",
                                    "--train.lora_rank=0", "--model.n_layers=1", "--model.n_layers=3",
                                    "--model.tie_embeddings=true", "--model.n_heads=8 --model.n_kv_heads=4",
                                    "--model.rope_theta=500000 --model.norm_eps=0.1"])
def test_resume_into_another_model_is_refused_before_any_rank_starts(saved, tmp_path, change, capsys):
    """--resume with a model section the checkpoint was not saved with: one line naming the first
    parameter whose shape differs (or the architectures) and the saved fields, exit 2; a rank used
    to fail inside the load with a traceback. The run directory is unchanged."""
    if "lora" in change:  # a LoRA run at rank 8 first; its adapters are (8, 32)
        run = tmp_path / "run"
        assert cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={run}",
                         "--train.steps=2", "--train.lora_rank=8"]) == 0
        capsys.readouterr()
    else:
        run = _copy_run(saved, tmp_path)
    before = _digest(run)
    extra = change.split() + (["--model.n_kv_heads=0"] if "gpt2" in change else [])
    code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={run}",
                     "--train.steps=4", "--resume", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    head = f"config error: --resume: {run}/checkpoints/step_00000002 is of another model: "
    want = {"--model.d_model=64": "model.tok_embeddings.weight is (256, 32) there, (256, 64) in this model; it was "
                                  "saved with d_model=32",
            "--model.arch=gpt2": "it holds a llama model, this config a gpt2 (arch='llama', n_kv_heads=2)",
            "--train.lora_rank=4": "model.layers.0.attention.wq.lora_A is (8, 32) there, (4, 32) in this model; it "
                                   "was saved with train.lora_rank=8",
            # a LoRA run resumed as a full one trained the whole model, its adapters silently dropped
            "--train.lora_rank=0": "it holds LoRA adapters (model.layers.0.attention.wk.lora_A, ...), this run none; "
                                   "it was saved with train.lora_rank=8",
            # fewer layers or a tied head loaded what both have, silently, and the next saves pruned
            # the checkpoints that held the rest; more layers failed inside a rank
            "--model.n_layers=1": "it holds model.layers.1.attention.wk.weight (and 8 more), this model not; it was "
                                  "saved with n_layers=2",
            "--model.n_layers=3": "this model has model.layers.2.attention.wk.weight (and 8 more), the checkpoint not; "
                                  "it was saved with n_layers=2",
            "--model.tie_embeddings=true": "it holds model.output.weight, this model not; it was saved with "
                                           "tie_embeddings=False",
            "--model.n_heads=8 --model.n_kv_heads=4": "the same shapes cut into other heads (n_heads=4, n_kv_heads=2)",
            # the same tensors, another function of them: resumed silently before 2026-12-08
            "--model.rope_theta=500000 --model.norm_eps=0.1": "the same tensors computed another way: rope_theta=10000.0 "
                                                              "there, 500000.0 here, norm_eps=1e-05 there, 0.1 here"}[change]
    assert err[0] == head + want + "; resume with the settings it was saved with, or start a new run with " \
                                   "--run-dir DIR", err
    assert _digest(run) == before


def test_resume_with_another_sequence_length_is_refused_before_any_rank_starts(saved, tmp_path, capsys):
    """The data cursor counts windows of seq_len tokens: a rank refused a changed seq_len after
    the launch; the parent says it first (exit 2), the run directory unchanged."""
    run = _copy_run(saved, tmp_path)
    before = _digest(run)
    code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={run}",
                     "--train.steps=4", "--resume", "--train.seq_len=8"])
    err = capsys.readouterr().err.strip()
    seq = next(a.split("=")[1] for a in TINY if a.startswith("--train.seq_len="))
    assert code == 2 and err == (f"config error: train.seq_len: {run}/checkpoints/step_00000002 was written with "
                                 f"seq_len={seq}; resume with --train.seq_len={seq}, or start a new run with --run-dir DIR")
    assert _digest(run) == before


def test_adapters_on_a_checkpoint_without_them_still_resume(saved, tmp_path, capsys):
    """The other direction is a documented start (docs/lora.md: adapters on a base checkpoint), not
    a mismatch: the parent's model check lets it through."""
    run = _copy_run(saved, tmp_path)
    assert cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={run}",
                     "--train.steps=4", "--resume", "--train.lora_rank=4", "--dry-run"]) == 0
    assert "resuming from" in capsys.readouterr().out


@pytest.mark.parametrize("field", ["run_dir", "checkpoint", "cache", "under_file"])
def test_run_paths_that_are_files_are_refused_before_any_rank_starts(saved, tmp_path, field, capsys):
    """A run directory, checkpoint directory or data cache that is a file (or lies under one) used
    to end the run in a rank's traceback, the checkpoint case after all its training; now one line
    naming the field, exit 2, also under --dry-run, and nothing is created."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    run, extra = tmp_path / "run", []
    if field == "run_dir":
        run = afile
    elif field == "under_file":
        run = afile / "sub"
    elif field == "checkpoint":
        extra = [f"--checkpoint.dir={afile}"]
    cache = afile if field == "cache" else saved / "cache"
    name = {"run_dir": "logging.run_dir", "under_file": "logging.run_dir", "checkpoint": "checkpoint.dir",
            "cache": "data.cache_dir"}[field]
    for dry in ([], ["--dry-run"]):
        code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={cache}", f"--logging.run_dir={run}",
                         "--train.steps=1", *extra, *dry])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"config error: {name}: "), err
        assert "is a file; give a directory" in err[0], err
    assert afile.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_overwrite_without_an_earlier_run_removes_nothing(saved, tmp_path, capsys):
    """--overwrite removed every folder named like a run output (profile/, ray/, ...) even where no
    earlier run was found, without a word; and a plain run wrote over a summary.json / loss.png it
    did not make. Now: nothing removed without an earlier run; those files count as one."""
    run = tmp_path / "proj"
    (run / "profile").mkdir(parents=True)
    (run / "profile" / "important.txt").write_text("mine")
    args = ["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={run}",
            "--train.steps=1"]
    assert cli_main([*args, "--overwrite"]) == 0
    assert (run / "profile" / "important.txt").read_text() == "mine"
    assert "removed" not in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text("{\"mine\": 1}")
    code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={saved}/cache", f"--logging.run_dir={other}",
                     "--train.steps=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"config error: logging.run_dir: {other} holds an earlier run (summary.json, no "
                                 "checkpoint); pass --overwrite to replace it, or --run-dir DIR for a new run"), err
    assert (other / "summary.json").read_text() == "{\"mine\": 1}"


def test_checkpoint_commands_keep_their_source_and_refuse_files(saved, tmp_path, capsys):
    """`checkpoint export --to CKPT/rank_00000.safetensors --force` wrote over the checkpoint's own
    shard; `checkpoint import --to FILE` ended in a traceback; an import of a shardlab checkpoint
    copied its optimizer state, which an import says it leaves out."""
    from shardlab.checkpoint import save as ckpt
    run = _copy_run(saved, tmp_path)
    step = run / "checkpoints" / "step_00000002"
    before = _digest(run)
    for args, part in ((["export", str(step), "--to", str(step / "rank_00000.safetensors"), "--force"],
                        "is inside the checkpoint"),
                       (["export", str(step), "--format", "hf", "--to", str(step / "hf_out")], "is inside the checkpoint"),
                       (["import", str(step), "--to", str(step / "rank_00000.safetensors")], "is a file; give a directory")):
        assert cli_main(["checkpoint", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("config error: --to: ") and part in err[0], err
    assert _digest(run) == before
    assert cli_main(["checkpoint", "import", str(step), "--to", str(tmp_path / "imported")]) == 0
    keys = ckpt.Reader(tmp_path / "imported" / "step_00000000").keys()
    assert any(k.startswith("model.") for k in keys) and not any(k.startswith("optim.") for k in keys)
    assert any(k.startswith("optim.") for k in ckpt.Reader(step).keys())  # what was left out
