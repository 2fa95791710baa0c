"""Smoke tests of the shardlab.initialize examples, run as users run them: `shardlab launch --nproc 2`."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "shardlab.cli", "launch", "--nproc", "2", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_ddp_trainer_snapshots_and_resumes(tmp_path):
    snap = str(tmp_path / "snap")
    r = _launch("examples/ddp_trainer.py", "--epochs", "1", "--save-every", "1", "--size", "256",
                "--snapshot-dir", snap)
    assert r.returncode == 0, r.stderr
    assert "Epoch 0 | Training snapshot saved" in r.stdout and "final loss" in r.stdout
    r = _launch("examples/ddp_trainer.py", "--epochs", "2", "--save-every", "1", "--size", "256",
                "--snapshot-dir", snap)
    assert r.returncode == 0, r.stderr
    assert "Resuming training from snapshot" in r.stdout and "at epoch 1" in r.stdout
    assert "Epoch 0 |" not in r.stdout and "Epoch 1 | Training snapshot saved" in r.stdout


def test_deepspeed_cnn_synthetic():
    r = _launch("examples/deepspeed_cnn.py", "--synthetic", "--steps", "2", "--train-limit", "512",
                "--test-limit", "64")
    assert r.returncode == 0, r.stderr
    assert "step 2/2 loss" in r.stdout and "test accuracy" in r.stdout


def test_deepspeed_script_unchanged_resumes_from_latest(tmp_path):
    """examples/deepspeed_unchanged.py (``import shardlab as deepspeed``): DeepSpeed's four values,
    its loader, tagged saves named in ``latest``, ``_, client_sd = load_checkpoint(...)``."""
    common = ["examples/deepspeed_unchanged.py", "--deepspeed_config", "examples/ds_config.json", "--synthetic",
              "--limit", "256", "--log-interval", "2", "--ckpt", str(tmp_path / "ck")]
    r = _launch(*common, "--epochs", "1")
    assert r.returncode == 0, r.stderr
    assert "[1,     2] loss" in r.stdout and "done: 2 optimizer steps on 2 ranks" in r.stdout, r.stdout
    assert (tmp_path / "ck" / "latest").read_text() == "epoch0\n"
    r = _launch(*common, "--epochs", "2")
    assert r.returncode == 0, r.stderr
    assert "at epoch 1" in r.stdout and "[1," not in r.stdout and "[2,     2] loss" in r.stdout, r.stdout
    assert "done: 4 optimizer steps" in r.stdout and (tmp_path / "ck" / "latest").read_text() == "epoch1\n"
