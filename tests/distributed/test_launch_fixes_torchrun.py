"""torchrun's own restarts (docs/faults.md, "Automatic restart"): `torchrun --max-restarts 1 -m
shardlab train ...` whose rank 1 is SIGKILLed after step 3 (checkpoints every 2 steps) used to be
refused at the restart ("holds an earlier run ... pass --resume"); now the restarted ranks resume
from step 2 and the command ends with 0, a restart line and record written. `--resume` on the first
start of such a job (no checkpoint directory yet) starts fresh instead of being refused."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=0",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0",
        "--train.steps=6", "--checkpoint.every=2", "--logging.log_every=1"]


def test_torchrun_restart_resumes(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("no torchrun")
    once = tmp_path / "killed-once"
    env = dict(os.environ, SHARDLAB_TEST_KILL_AT_STEP=f"1:3:{once}", OMP_NUM_THREADS="1")
    run = tmp_path / "run"
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "--max-restarts", "1", "-m", "shardlab", "train", *TINY,
                        f"--data.cache_dir={tmp_path / 'cache'}", f"--logging.run_dir={run}", "--resume"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=540)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert once.exists()
    assert "shardlab: restart 1/1: a rank failed (torchrun restarted the job); resuming from" in out, out[-4000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    restarts = [r for r in recs if r["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["resumed_from"].endswith("step_00000002"), restarts
    starts = [r["resumed_from"] for r in recs if r["kind"] == "start"]
    assert starts[0] is None and starts[1].endswith("step_00000002"), starts
    assert max(r["step"] for r in recs if r["kind"] == "train") == 6
