"""--launcher ray fixes (docs/ray.md, docs/faults.md): a local Ray of its own where a cluster runs
and RAY_ADDRESS names it; SIGTERM ends with shardlab's line and 143; each rank line reaches the
driver once; no empty flight-recorder directory is left; the mmap threshold is set in the workers;
`shardlab launch` scripts see TORCHELASTIC_* and a failing script's exit status is the command's."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(600)  # Ray's starts on 2 shared cores (test_ray.py)

from shardlab.cli import main as cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--logging.log_every=1",
        "--logging.tensorboard=false", "--train.eval_every=0", "--checkpoint.save=false"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2 ** 20, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_own_local_ray_beside_a_cluster_and_sigterm(ray_cluster, tmp_path):
    """Items 1, 4, 7, 9: with a cluster running and RAY_ADDRESS naming it, `--launcher ray` (no
    --ray-address) crashed in ray.init; SIGTERM gave Ray's stack dump and exit 1; every step line
    came twice; the flight-recorder directory stayed behind."""
    tmp = Path(tempfile.mkdtemp(prefix="slt-", dir="/tmp"))  # short: Ray's socket paths are at most 107 bytes
    env = dict(os.environ, RAY_ADDRESS=ray_cluster, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "shardlab", "train", "--nproc", "2", *TINY, "--train.steps=100000",
           f"--data.cache_dir={tmp_path / 'cache'}", f"--logging.run_dir={tmp_path / 'run'}", "--launcher", "ray"]
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if "train: step 4/" in line:
                break
        p.send_signal(signal.SIGTERM)
        t0 = time.time()
        seen.append(p.stdout.read())
        code = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
        flight = list(tmp.glob("shardlab-flight-*"))
        shutil.rmtree(tmp, ignore_errors=True)
    out = "".join(seen)
    assert code == 143, out[-3000:]
    assert out.rstrip().splitlines()[-1] == "shardlab: terminated (SIGTERM); the ranks were stopped", out[-3000:]
    assert "SIGTERM received" not in out and "Traceback" not in out, out[-3000:]
    assert time.time() - t0 < 90
    for step in (1, 2, 3):
        assert sum(f"train: step {step}/" in line for line in out.splitlines()) == 1, out[-3000:]
    assert not flight


def _probe(ctx):
    from shardlab.distributed import heap
    return heap.MMAP_SET, ctx.restart_count


def test_mmap_threshold_in_ray_workers(ray_cluster, monkeypatch):
    """Item 8: only launch._init set it, so Ray workers kept glibc's own threshold."""
    import ray.cloudpickle
    from shardlab import launch_ray
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setenv("SHARDLAB_MMAP_THRESHOLD", str(8 << 20))  # read by the driver
    assert launch_ray.run(_probe, 1) == [(8 << 20, 0)]


SCRIPT = """import os, sys
r, c = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "unset")
open(os.path.join(sys.argv[1], f"rank{r}-start{c}"), "w").write(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "unset"))
if r == "1" and int(c if c != "unset" else 0) < int(sys.argv[2]):
    sys.exit(3)
"""


def test_launch_script_restarts_and_exit_status(ray_cluster, tmp_path, capsys):
    """Item 5: Ray workers' scripts saw no TORCHELASTIC_* and a script's exit 3 ended with 1."""
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    assert cli_main(["launch", "--nproc", "2", "--launcher", "ray", "--max-restarts", "1", str(script), str(out), "1"]) == 0
    starts = {p.name: p.read_text() for p in out.iterdir()}
    starts.pop("rank0-start0", None)  # rank 0's first script may be stopped before it writes
    assert starts == {"rank1-start0": "1", "rank0-start1": "1", "rank1-start1": "1"}, starts
    capsys.readouterr()
    assert cli_main(["launch", "--nproc", "2", "--launcher", "ray", str(script), str(out), "9"]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "shardlab launch: rank 1 failed (exit code 3); the other ranks were stopped"
