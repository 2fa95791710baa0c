"""``shardlab memory`` refuses, after printing its prediction, a measured run that would fail in its
ranks: CPU ranks whose predicted peaks together exceed the memory available here (a 2-rank
measurement of the 8B config used to be OOM-killed mid-step: "rank 1 failed: killed by signal
9"), and train.device = cuda without a GPU (a traceback per rank). No rank starts."""
from pathlib import Path

import torch

from shardlab.cli import main as cli_main
from shardlab.commands import doctor_cmd

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


def _no_launch(*a, **k):
    raise AssertionError("a rank was started")


def test_a_measured_run_beyond_the_available_memory_is_refused(monkeypatch, capsys):
    monkeypatch.setattr("shardlab.commands.memory_cmd.measure_run", _no_launch)
    monkeypatch.setattr(doctor_cmd, "meminfo", lambda: {"MemAvailable": 2**28})  # 256 MiB available
    assert cli_main(["memory", TINY, "--nproc", "2"]) == 2
    out, err = capsys.readouterr()
    assert "predicted per rank at the peak of a step" in out  # the prediction stands, printed first
    line = err.strip()
    assert line.startswith("config error: measured run: 2 CPU ranks need about 0.") and "\n" not in line, line
    assert line.endswith("GiB together (the predicted peaks above), more than the 0.2 GiB available here; the "
                         "prediction stands: pass --no-run, or measure a smaller config"), line
    assert cli_main(["memory", TINY, "--nproc", "2", "--no-run"]) == 0


def test_cuda_without_a_gpu_is_refused_before_the_ranks(monkeypatch, capsys):
    monkeypatch.setattr("shardlab.commands.memory_cmd.measure_run", _no_launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["memory", TINY, "--nproc", "2", "--train.device=cuda"]) == 2
    assert capsys.readouterr().err.strip() == ("config error: train.device: cuda, but no CUDA device is visible "
                                               "here; use --train.device=cpu (--device sets the predicted "
                                               "activations' kind)")
