"""shardlab train's parent-side decisions: the gloo fallback on GPUs is said, paths are absolute."""
from pathlib import Path

import torch

from shardlab.commands.train_cmd import absolute_paths, backend_note
from shardlab.config import Config


def test_gloo_fallback_on_gpus_is_said(monkeypatch):
    """More local ranks than GPUs: the launcher uses gloo; shardlab train says so in one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    note = backend_note("auto", 4)
    assert note.startswith("shardlab: 4 ranks on 1 GPU(s)") and "gloo" in note and "\n" not in note
    assert backend_note("auto", 1) == "" and backend_note("cpu", 4) == ""


def test_mps_is_suggested_only_when_its_daemon_is_not_running(monkeypatch, tmp_path):
    """Ranks sharing a GPU: the note names CUDA MPS unless its control pipe exists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert "nvidia-cuda-mps-control -d" in backend_note("auto", 2)
    (tmp_path / "control").touch()  # the daemon's pipe
    note = backend_note("auto", 2)
    assert note.startswith("shardlab: 2 ranks on 1 GPU(s)") and "MPS" not in note


def test_paths_handed_to_ranks_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("x")
    cfg = Config()
    cfg.data.dataset, cfg.logging.run_dir, cfg.checkpoint.dir = "corpus.txt", "runs/a", "ck"
    absolute_paths(cfg)
    assert cfg.data.cache_dir == str(tmp_path / ".cache" / "shardlab")
    assert (cfg.logging.run_dir, cfg.checkpoint.dir) == (str(tmp_path / "runs/a"), str(tmp_path / "ck"))
    assert cfg.data.dataset == str(tmp_path / "corpus.txt")
    cfg.data.dataset, cfg.checkpoint.base = "shakespeare", "smollm2"  # words, not paths: kept
    absolute_paths(cfg)
    assert (cfg.data.dataset, cfg.checkpoint.base) == ("shakespeare", "smollm2")
    assert all(Path(p).is_absolute() for p in (cfg.data.cache_dir, cfg.logging.run_dir))
