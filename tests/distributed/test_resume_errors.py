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
    err = [x for x in lines if not x.startswith("shardlab: training ")]  # the start-up banner
    assert code == 2, lines
    assert len(err) == 1 and not any("Traceback" in x for x in lines), lines
    assert (bad.name if how != "index" else "index.json") in err[0] or str(bad.parent) in err[0], err
    assert _digest(run / "checkpoints") == before
