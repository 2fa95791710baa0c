"""Corpus, loader determinism and sharding; checkpoint atomicity (kill -9 mid-save), pruning, CLI.
(Sharded checkpoint IO in detail: test_checkpoint_io.py.)"""
import json

import numpy as np
import pytest
import torch

from shardlab.config import ConfigError, DataConfig
from shardlab.checkpoint import save as ckpt
from shardlab.train.data import Loader, TokenData, prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    return TokenData(prepare(DataConfig(cache_dir=str(d))))


def test_corpus_is_shakespeare_bytes(corpus):
    assert corpus.meta["train_tokens"] > 1_000_000 and corpus.meta["vocab_size"] == 256
    text = bytes(np.asarray(corpus.train[:200_000], dtype=np.uint8)).decode("utf-8", "ignore")
    assert "thou" in text.lower()
    assert 2.5 < corpus.unigram_entropy < 3.6


def test_loader_shards_are_the_global_batch(corpus):
    full = Loader(corpus, 32, 8, 1, 0, 1, seed=3)
    shards = [Loader(corpus, 32, 8, 2, r, 4, seed=3) for r in range(4)]
    for _ in range(3):
        (gx, gy), = full.next_batch()
        parts = [torch.cat([mb[0] for mb in s.next_batch()]) for s in shards]
        assert torch.equal(torch.cat(parts), gx)
        assert torch.equal(gx[:, 1:], gy[:, :-1])


def test_loader_cursor_resume(corpus):
    a = Loader(corpus, 16, 4, 1, 0, 1, seed=1)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    expect = a.next_batch()[0][0]
    b = Loader(corpus, 16, 4, 1, 0, 1, seed=1)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert torch.equal(b.next_batch()[0][0], expect)
    with pytest.raises(ConfigError, match="train.seq_len"):
        Loader(corpus, 8, 4, 1, 0, 1, seed=1).load_state_dict(state)


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="data.dataset"):
        prepare(DataConfig(dataset=str(tmp_path / "nope.txt"), cache_dir=str(tmp_path)))


def _save(directory, step, w, meta=None, keep=3):
    """Save ``model.w`` (rows split over two ranks) and a scalar optimizer state."""
    staging = ckpt.prepare(directory, step)
    half = w.shape[0] // 2
    for r, (lo, hi) in enumerate([(0, half), (half, w.shape[0])]):
        ckpt.write_rank(staging, r, [ckpt.Piece("model.w", tuple(w.shape), (lo, 0), w[lo:hi]),
                                     ckpt.Piece("optim.w.step", (), (), torch.tensor(float(step)))],
                        ckpt.rng_tensors(torch.device("cpu")))
    return ckpt.commit(directory, step, 2, meta or {"data": {"cursor": step}}, keep=keep)


def test_checkpoint_roundtrip_prune_and_damage(tmp_path):
    w = torch.arange(6, dtype=torch.float64).view(2, 3)
    for step in (1, 2, 3):
        _save(tmp_path, step, w + step, keep=2)
    paths = ckpt.list_checkpoints(tmp_path)
    assert [p.name for p in paths] == ["step_00000002", "step_00000003"]
    r = ckpt.Reader(paths[-1])
    assert torch.equal(r.read("model.w"), w + 3) and r.meta["data"]["cursor"] == 3 and r.step == 3
    assert r.read("optim.w.step").shape == () and float(r.read("optim.w.step")) == 3.0
    # damage the newest (truncate a shard): refused with the file named; the previous one is used
    f = paths[-1] / "rank_00001.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.safetensors"):
        ckpt.Reader(paths[-1])
    warnings = []
    assert ckpt.latest_valid(tmp_path, warn=warnings.append) == paths[0]
    assert "step_00000003" in warnings[0]


_KILLED_CHILD = """
import os, signal, sys, torch
from shardlab.checkpoint import format as ckpt_format, save as ckpt
d, w = sys.argv[1], torch.arange(12.0).view(4, 3)
staging = ckpt.prepare(d, 1)
for r in range(2):
    ckpt.write_rank(staging, r, [ckpt.Piece("model.w", (4, 3), (2 * r, 0), w[2 * r:2 * r + 2])], {})
ckpt.commit(d, 1, 2, {"note": "complete"})
big = torch.ones(1 << 20)
staging = ckpt.prepare(d, 2)
ckpt.write_rank(staging, 0, [ckpt.Piece("model.big", (2 << 20,), (0,), big)], {})
real = ckpt_format.SafetensorsWriter.write
def dying(self, name, tensor, last=True):  # rank 1 dies after half of its data reached the file
    real(self, name, tensor[: tensor.numel() // 2], last=False)
    self._fh.flush()
    print("writing", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
ckpt_format.SafetensorsWriter.write = dying
ckpt.write_rank(staging, 1, [ckpt.Piece("model.big", (2 << 20,), (1 << 20,), big * 2)], {})
print("not reached", flush=True)
"""


def test_kill_during_save_keeps_previous(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(repo)), timeout=120)
    assert res.returncode == -signal.SIGKILL and res.stdout.split() == ["writing"], res
    staging = ckpt.staging_dir(tmp_path, 2)
    assert (staging / "rank_00000.json").exists() and (staging / "rank_00001.safetensors").exists()
    assert not (staging / "rank_00001.json").exists()  # rank 1 never finished
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert ckpt.latest_valid(tmp_path).name == "step_00000001"
    r = ckpt.Reader(ckpt.latest_valid(tmp_path))
    assert torch.equal(r.read("model.w"), torch.arange(12.0).view(4, 3)) and r.meta == {"note": "complete"}
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.json: missing"):
        ckpt.commit(tmp_path, 2, 2, {})  # the half-written step cannot be published
    with pytest.raises(ckpt.CheckpointError, match="incomplete checkpoint"):
        ckpt.Reader(staging)
    path = _save(tmp_path, 2, torch.ones(4, 3))  # saving step 2 again works
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert torch.equal(ckpt.Reader(path).read("model.w"), torch.ones(4, 3)) and not staging.exists()
    assert not ckpt.Reader(path).has("model.big")


def test_checkpoint_command_inspect_verify_export(tmp_path, capsys):
    from safetensors.torch import load_file

    from shardlab.cli import main as cli_main
    w = torch.arange(6 * 5, dtype=torch.float32).view(6, 5)
    meta = {"data": {"cursor": 8}, "scaler": {"scale": 1.0}, "layout": "tp=2", "world_size": 2}
    staging = ckpt.prepare(tmp_path, 5)
    for r in range(2):
        ckpt.write_rank(staging, r, [ckpt.Piece("model.w", (6, 5), (3 * r, 0), w[3 * r:3 * r + 3]),
                                     ckpt.Piece("model.b", (5,), (0,), w[0].to(torch.bfloat16)),
                                     ckpt.Piece("model.s", (), (), torch.tensor(2.5, dtype=torch.float64)),
                                     ckpt.Piece("optim.w.exp_avg", (6, 5), (3 * r, 0), w[3 * r:3 * r + 3] * 0)],
                        ckpt.rng_tensors(torch.device("cpu")))
    ckpt.commit(tmp_path, 5, 2, meta)
    assert cli_main(["checkpoint", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 5" in out and "tp=2" in out and "(6, 5)" in out and "rank_00001.safetensors" in out
    assert cli_main(["checkpoint", "verify", str(tmp_path / "step_00000005")]) == 0
    assert "ok:" in capsys.readouterr().out
    dest = tmp_path / "w.safetensors"
    # tiny chunks: model.w is streamed one row at a time
    assert cli_main(["checkpoint", "export", str(tmp_path), "--to", str(dest), "--chunk-mib", "0.00001"]) == 0
    got = load_file(str(dest))
    assert sorted(got) == ["b", "s", "w"] and torch.equal(got["w"], w)
    assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"], w[0].to(torch.bfloat16))
    assert got["s"].shape == () and float(got["s"]) == 2.5
    before = dest.read_bytes()
    assert cli_main(["checkpoint", "export", str(tmp_path), "--to", str(dest)]) == 2  # never overwrite silently
    assert "--force" in capsys.readouterr().err and dest.read_bytes() == before
    assert cli_main(["checkpoint", "export", str(tmp_path), "--to", str(dest), "--force"]) == 0
    assert torch.equal(load_file(str(dest))["w"], w)
