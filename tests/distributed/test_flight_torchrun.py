"""The flight recorder's hang report without shardlab's launcher: a seeded desync under torchrun
(CPU, gloo, 2 ranks, 10 s timeout: 3 s once ran out while gloo connected the two ranks on a
loaded host, ``Gloo connectFullMesh failed ... timed out connecting``). Each rank's Comm call fails
at the timeout, dumps its recorder into the run's flight directory, and the failing rank prints the
report the local launcher prints, naming the ranks and the operations (distributed/flight_here.py)."""
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, torch
from shardlab.launch import init_from_env
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
ctx = init_from_env("cpu", timeout_s=10.0)
mesh = Mesh.build(Topology(tp=2), "cpu", transport="process_group")
mesh.flight.run_dir = sys.argv[1]
tp, x = mesh.comm("tp"), torch.ones(4)
tp.all_reduce(torch.ones(2))   # seq 1: agreed
if ctx.rank == 0:              # seq 2: the ranks disagree (a seeded desync)
    tp.all_reduce(x)
else:
    tp.barrier()
"""


def test_seeded_hang_under_torchrun_is_named_by_rank_and_op(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    if not Path(torchrun).exists():
        pytest.skip("torchrun not installed")
    (tmp_path / "desync.py").write_text(SCRIPT)
    t0 = time.perf_counter()
    from shardlab.launch import free_port
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), str(tmp_path / "desync.py"),
                        str(tmp_path / "flight")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    out = r.stderr
    assert "communication at the failure (flight recorder):" in out, out[-3000:]
    assert "ranks disagree at seq 2: rank 0 all_reduce(float32[4], sum)" in out, out[-3000:]
    assert "rank 1 barrier()" in out and "rank 0: last op tp all_reduce(float32[4], sum) seq 2" in out, out[-3000:]
    assert {p.name for p in (tmp_path / "flight").glob("rank*.json")} == {"rank0.json", "rank1.json"}
    assert time.perf_counter() - t0 < 90
