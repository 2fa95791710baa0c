"""Smoke test: examples/fsdp_cnn.py and examples/dataparallel_vs_ddp.py run with tiny arguments."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.train.images import DEFAULT_ROOT

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,args", [
    ("fsdp_cnn.py", ["--nproc", "2", "--steps", "3", "--limit-test", "100", "--policy", "size:10000"]),
    ("dataparallel_vs_ddp.py", ["--nproc", "2", "--steps", "2"]),
])
def test_example_runs(script, args):
    if not DEFAULT_ROOT.is_dir():
        pytest.skip("Fashion-MNIST absent: install the Debian package dataset-fashion-mnist")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "result:" in r.stdout, r.stdout
