"""Corpus, loader determinism and sharding; checkpoint atomicity, checksums and pruning."""
import json

import numpy as np
import pytest
import torch

from shardlab.config import ConfigError, DataConfig
from shardlab.train import checkpoint as ckpt
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


def test_checkpoint_roundtrip_prune_and_damage(tmp_path):
    t = {"model.w": torch.arange(6, dtype=torch.float64).view(2, 3), "optim.w.step": torch.tensor(3.0)}
    for step in (1, 2, 3):
        ckpt.save(tmp_path, step, t, {"data": {"cursor": step}}, keep=2)
    paths = ckpt.list_checkpoints(tmp_path)
    assert [p.name for p in paths] == ["step_00000002", "step_00000003"]
    tensors, meta = ckpt.load(paths[-1])
    assert torch.equal(tensors["model.w"], t["model.w"]) and meta["data"]["cursor"] == 3
    # damage the newest: refused with the file named; the previous one is still used
    f = paths[-1] / "state.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="state.safetensors: checksum mismatch"):
        ckpt.load(paths[-1])
    warnings = []
    assert ckpt.latest_valid(tmp_path, warn=warnings.append) == paths[0]
    assert "step_00000003" in warnings[0]


def test_crash_during_save_keeps_previous(tmp_path):
    t = {"model.w": torch.ones(3)}
    ckpt.save(tmp_path, 1, t, {}, keep=3)
    with pytest.raises(ckpt.CheckpointError, match="simulated crash"):
        ckpt.save(tmp_path, 2, {"model.w": torch.zeros(3)}, {}, keep=3, _fail_after_tensors=True)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert ckpt.latest_valid(tmp_path).name == "step_00000001"
    assert torch.equal(ckpt.load(ckpt.latest_valid(tmp_path))[0]["model.w"], torch.ones(3))


def test_checkpoint_command_inspect_export(tmp_path, capsys):
    from safetensors.torch import load_file

    from shardlab.cli import main as cli_main
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    meta = {"data": {"cursor": 8}, "scaler": {"scale": 1.0}, "layout": "tp=2", "world_size": 2}
    ckpt.save(tmp_path, 5, {"model.w": w, "optim.w.exp_avg": w * 0}, meta)
    assert cli_main(["checkpoint", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 5" in out and "tp=2" in out and "(2, 3)" in out
    dest = tmp_path / "w.safetensors"
    assert cli_main(["checkpoint", "export", str(tmp_path), "--to", str(dest)]) == 0
    assert torch.equal(load_file(str(dest))["w"], w) and list(load_file(str(dest))) == ["w"]
    assert cli_main(["checkpoint", "export", str(tmp_path), "--to", str(dest)]) == 2  # never overwrite silently
    f = tmp_path / "step_00000005" / "state.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert cli_main(["checkpoint", "inspect", str(tmp_path / "step_00000005")]) == 2
    assert "state.safetensors: checksum mismatch" in capsys.readouterr().err
