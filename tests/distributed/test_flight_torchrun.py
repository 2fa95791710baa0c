"""The flight recorder's hang report without shardlab's launcher: a seeded desync under torchrun
(CPU, gloo, 2 ranks, 3 s collective timeout). Each rank's Comm call fails at the timeout, dumps
its recorder into the run's flight directory, and the failing rank prints the report the local
launcher prints, naming the ranks and the operations (distributed/flight_here.py)."""
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
ctx = init_from_env("cpu", timeout_s=3.0)
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


LATE = """
import sys, time, torch, torch.distributed as dist
from shardlab.launch import init_from_env
from shardlab.distributed.shm_host import collective_timeout
import os
if os.environ["RANK"] == "1":
    time.sleep(5)               # arrives after rank 0's 2 s collective timeout
ctx = init_from_env("cpu", timeout_s=2.0)
t = torch.ones(1)
dist.all_reduce(t)
open(f"{sys.argv[1]}{ctx.rank}", "w").write(f"{t.item()} {collective_timeout(dist.group.WORLD).total_seconds()}")
"""


def test_a_short_collective_timeout_does_not_bound_the_connection(tmp_path):
    """``init_from_env(timeout_s=2)`` with one rank 5 s late: the ranks connect (under at least
    mesh.CONNECT_S; the 3 s timeout of the test above once failed in gloo's connection on a loaded
    host) and the collectives still time out at 2 s."""
    (tmp_path / "late.py").write_text(LATE)
    from shardlab.cli import main
    assert main(["launch", "--nproc", "2", str(tmp_path / "late.py"), str(tmp_path / "rank")]) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2.0 2.0"] * 2
