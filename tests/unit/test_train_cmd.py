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


def test_cuda_without_a_gpu_and_a_missing_corpus_are_refused_before_a_launch(monkeypatch, tmp_path, capsys):
    """train.device=cuda where no GPU is visible, and (in a --dry-run, which prepares no data) a
    corpus file that does not exist: one line naming the field, exit 2, nothing started or
    written. The device check used to fail inside every rank with a traceback; the dry run used
    to pass with a missing corpus."""
    from shardlab.cli import main as cli_main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    base = ["train", str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"),
            "--nproc", "2", "--run-dir", "run"]
    cases = [(["--device", "cuda"], "config error: train.device: cuda, but no CUDA device is visible here; use "
                                    "--device cpu (or auto)"),
             (["--train.device=cuda", "--dry-run"], None),
             (["--data.dataset=missing.txt", "--dry-run"],
              "config error: data.dataset: 'missing.txt' is neither 'shakespeare' nor an existing text file")]
    for extra, want in cases:
        assert cli_main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err == (want or cases[0][1]), err
    assert not (tmp_path / "run").exists()
    assert cli_main([*base, "--dry-run"]) == 0 and "nothing started" in capsys.readouterr().out


def test_model_state_beyond_the_available_memory_is_warned_before_a_start(monkeypatch, tmp_path, capsys):
    """CPU ranks whose model state alone (a lower bound: the matmuls' parameters, fp32 params +
    grads + Adam's two states = 16 bytes each, over the data-parallel ranks) exceeds MemAvailable:
    one warning line before the launch, instead of ranks killed by signal 9 minutes later."""
    from shardlab.commands import doctor_cmd
    from shardlab.commands.train_cmd import memory_warning
    from shardlab.config import load
    from shardlab.models.decoder import matmul_params_per_token
    cfg = load(str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"), ["--parallel.dp_replicate=2"])
    cfg.validate(world_size=2)
    need = 2 * 16 * matmul_params_per_token(cfg.model, ffn_matrices=2)  # 2 DDP ranks, each the whole state
    monkeypatch.setattr(doctor_cmd, "meminfo", lambda: {"MemAvailable": need + 1})
    assert memory_warning(cfg, 2) == ""
    monkeypatch.setattr(doctor_cmd, "meminfo", lambda: {"MemAvailable": need - 1})
    line = memory_warning(cfg, 2)
    assert line.startswith(f"shardlab: warning: the 2 ranks' model state alone is at least {need / 2**30:,.1f} GiB")
    assert line.endswith("shardlab memory CONFIG --no-run --nproc 2") and "\n" not in line
    # the dry run says it too (it used to stay silent: the warning came only at a real start)
    from shardlab.cli import main as cli_main
    assert cli_main(["train", "configs/tiny.toml", "--nproc", "2", "--dry-run", "--run-dir", str(tmp_path / "r")]) == 0
    assert line in capsys.readouterr().err.splitlines()
    cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.zero_stage = 1, 2, 3  # ZeRO-3: half each
    assert memory_warning(cfg, 2) == ""
    one = load(str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")).validate(world_size=1)
    monkeypatch.setattr(doctor_cmd, "meminfo", lambda: {"MemAvailable": need // 2 - 1})
    assert memory_warning(one, 1).startswith("shardlab: warning: the rank's model state alone")


def test_the_launcher_refuses_cuda_without_a_gpu_before_any_rank(monkeypatch):
    """launch.run checks the device in the parent, for every command that starts ranks (generate
    --tp, bench comm, memory, launch): a ConfigError, where each rank used to raise a traceback."""
    import pytest
    from shardlab import launch
    from shardlab.config import ConfigError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch, "rank_context", lambda *a: pytest.fail("a rank was started"))
    with pytest.raises(ConfigError) as e:
        launch.run(print, 2, device="cuda")
    assert str(e.value) == "config error: train.device: cuda, but no CUDA device is visible here; use --device cpu (or auto)"
