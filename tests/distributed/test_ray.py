"""The Ray launcher (docs/ray.md): ``--launcher ray`` runs the very per-rank code of the local launcher
as Ray Train workers, so its losses are bit-equal to the local launcher's (DDP and a 2-D layout), and
a worker killed mid-run under ``--max-restarts 1`` (Ray's FailureConfig(max_failures=1)) is restarted
from the last reported checkpoint and ends with the uninterrupted run's parameters. The local
launcher itself is checked against a float64 single-process reference in test_train.py and
test_restart.py; here the reference is the local launcher. One Ray instance serves the module."""
import json
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
# Ray's worker starts, health checks and restarts run on wall-clock intervals: beside the other
# pytest worker's ranks on 2 cores, the restart test took 250 s of the suite's 300 s per test
# (2026-11-29; 44 s alone), so this file gets twice that. A hang is still stopped.
pytestmark = pytest.mark.timeout(600)

from shardlab.cli import main as cli_main  # noqa: E402

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=0",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0",
        "--checkpoint.every=2", "--logging.log_every=1"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2 ** 20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _train(run_dir, cache, nproc, *extra):
    return cli_main(["train", "--nproc", str(nproc), *TINY, f"--data.cache_dir={cache}",
                     f"--logging.run_dir={run_dir}", *extra])


def _losses(run_dir):
    recs = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}  # a re-trained step: its last loss


def _final(run_dir):
    from shardlab.checkpoint.save import Reader, latest_valid
    reader = Reader(latest_valid(Path(run_dir) / "checkpoints"))
    try:
        return int(reader.step), {k: reader.read(k) for k in reader.keys() if k.startswith(("model.", "optim."))}
    finally:
        reader.close()


def _same_params(a, b, steps):
    (sa, ta), (sb, tb) = _final(a), _final(b)
    assert sa == sb == steps and set(ta) == set(tb) and ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.fixture(scope="module")
def local_ddp(tmp_path_factory, cache):
    run = tmp_path_factory.mktemp("local_ddp")
    assert _train(run, cache, 2, "--train.steps=6") == 0
    return run


def test_2d_layout_bit_equal_to_local_with_relative_paths(ray_cluster, cache, tmp_path, monkeypatch):
    """TP 2 x 2 replicas on 4 Ray workers: every step's loss bit-equal to the local launcher's. The
    Ray run is started as the README's ``--launcher ray`` example is typed, with a relative data
    directory and run directory (that example once failed in every worker: Ray workers start in
    their own directories; the driver now resolves every config path once, before they start)."""
    layout = ["--parallel.tp=2", "--parallel.dp_replicate=2", "--train.steps=2", "--checkpoint.save=false"]
    assert _train(tmp_path / "local", cache, 4, *layout) == 0
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "--nproc", "4", *TINY, "--data.cache_dir=rel-cache", "--logging.run_dir=ray", *layout,
                     "--launcher", "ray", "--ray-strategy", "SPREAD"]) == 0
    assert (tmp_path / "rel-cache").is_dir() and (tmp_path / "ray" / "metrics.jsonl").exists()
    assert _losses(tmp_path / "ray") == _losses(tmp_path / "local") and len(_losses(tmp_path / "local")) == 2


def test_ddp_bit_equal_and_killed_worker_restarts(ray_cluster, local_ddp, cache, tmp_path, monkeypatch):
    """DDP on 2 Ray workers, rank 1 killed after step 3 (checkpoints every 2 steps), --max-restarts 1:
    the run ends by itself; every step's loss (steps 1-3 from the first group, 3-6 from the
    restarted one) is bit-equal to the local launcher's, and so are the final tensors."""
    once = tmp_path / "killed-once"
    monkeypatch.setenv("SHARDLAB_TEST_KILL_AT_STEP", f"1:3:{once}")  # rank 1 SIGKILLs itself after step 3
    assert _train(tmp_path / "ray", cache, 2, "--train.steps=6", "--launcher", "ray", "--max-restarts", "1") == 0
    assert once.exists()
    starts = [json.loads(x) for x in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["resumed_from"] for r in starts if r["kind"] == "start"]
    assert resumed[0] is None and resumed[1].endswith("step_00000002") and "/ray/" in resumed[1], resumed
    # Ray Train's restart is recorded as --max-restarts' is (rank 0 of the restarted group), before its start
    kinds = [r["kind"] for r in starts if r["kind"] in ("start", "restart")]
    restart = next(r for r in starts if r["kind"] == "restart")
    assert kinds == ["start", "restart", "start"] and restart["restart"] == 1, kinds
    assert restart["resumed_from"] == resumed[1] and restart["step"] == 2 and restart["lost_steps"] == 1, restart
    local, on_ray = _losses(local_ddp), _losses(tmp_path / "ray")
    assert sorted(local) == sorted(on_ray) == list(range(1, 7))
    assert on_ray == local  # bit-equal floats
    _same_params(local_ddp, tmp_path / "ray", 6)
    reported = sorted(p.name for p in (tmp_path / "ray" / "ray").glob("*/step_*"))
    # every rank's files were reported and merged; Ray prunes the registered ones beyond the newest 2 (a
    # checkpoint reported just before the kill may stay unregistered, hence unpruned: docs/ray.md)
    assert reported[-2:] == ["step_00000004", "step_00000006"], reported


def test_launch_script_on_ray_from_a_relative_path(ray_cluster, tmp_path, monkeypatch):
    """``shardlab launch --launcher ray`` as a user types it: a relative script path whose script
    all-reduces over the ranks' process group and writes a relative file named by its argument. Ray workers start in their
    own directories; the script runs where ``shardlab launch`` was started, with the torchrun env."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "allreduce.py").write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "open(f'{sys.argv[1]}{dist.get_rank()}', 'w').write(f\"{os.environ['WORLD_SIZE']} {t.item()} {os.getcwd()}\")\n"
        "dist.destroy_process_group()\n")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["launch", "--nproc", "2", "--launcher", "ray", "sub/allreduce.py", "rank"]) == 0  # its argument too
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [f"2 3.0 {tmp_path}"] * 2


@pytest.fixture
def examples(monkeypatch):
    """Import an example as a module (importable by the ranks it spawns, which inherit sys.path)."""
    import importlib
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    return importlib.import_module


def test_parameter_server_example_smoke(ray_cluster, examples, capsys):
    """A few steps: the sync server is DDP with SGD (same loss to float32 rounding); bytes are counted."""
    rows = examples("ray_parameter_server").main(["--workers", "2", "--steps", "3", "--batch", "8"])
    sync, asyn, ddp = rows
    m = 4 * sum(p.numel() for p in examples("ray_parameter_server").make_model(0).parameters())
    assert sync["bytes"] == 2 * 2 * m  # each of 2 workers pulls M and pushes M per step
    assert asyn["bytes"] >= 2 * 2 * m
    assert ddp["bytes"] == 2 * 2 * m * (2 - 1) / 2  # ring all-reduce 2M(N-1)/N per rank, 2 ranks
    assert abs(sync["loss"] - ddp["loss"]) < 1e-5, (sync, ddp)
    assert "| parameter server, async |" in capsys.readouterr().out


def test_heterogeneous_example_smoke(ray_cluster, examples, capsys):
    """A few steps: the fed trainer trains on exactly the batches the inline one prepares itself."""
    inline, fed = examples("ray_heterogeneous").main(["--steps", "3", "--batch", "2", "--seq", "16", "--d", "16",
                                                      "--feeders", "1", "--window", "2"])
    assert inline["loss"] == fed["loss"] and inline["tokens_per_s"] > 0 and fed["tokens_per_s"] > 0
    assert "tokens/s" in capsys.readouterr().out


def _seeded_desync(ctx):
    """Rank 0 all_reduce, rank 1 barrier at the same sequence number (after one agreed all_reduce)."""
    import torch.distributed as dist
    from shardlab.distributed.mesh import Mesh
    from shardlab.distributed.shm_host import collective_timeout
    from shardlab.distributed.topology import Topology
    assert collective_timeout(dist.group.WORLD).total_seconds() == 5.0  # TorchConfig(timeout_s) reached it
    mesh = Mesh.build(Topology(tp=2), "cpu", transport="process_group")
    tp = mesh.comm("tp")
    tp.all_reduce(torch.ones(2))   # seq 1: agreed
    if ctx.rank == 0:              # seq 2: the ranks disagree
        tp.all_reduce(torch.ones(4))
    else:
        tp.barrier()


def test_seeded_hang_under_ray_is_named_by_rank_and_op(ray_cluster):
    """The flight recorder under the Ray launcher (docs/faults.md): both workers fail at the 5 s
    collective timeout, each dumps its recorder, and the driver's error names each rank's last
    operation and the disagreement, as the local launcher's does (test_diagnosis.py)."""
    import sys
    import time
    import ray.cloudpickle
    from shardlab import launch, launch_ray
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import this file
    t0 = time.perf_counter()
    with pytest.raises(launch.WorkerError) as info:
        launch_ray.run(_seeded_desync, 2, timeout_s=5.0)
    text = str(info.value)
    assert "communication at the failure (flight recorder):" in text, text
    assert "rank 0: last op tp all_reduce(float32[4], sum) seq 2" in text, text
    assert "rank 1: last op tp barrier() seq 2" in text, text
    assert "ranks disagree at seq 2: rank 0 all_reduce(float32[4], sum)" in text and "rank 1 barrier()" in text, text
    dumps = Path(text.split("full dumps: ")[1].split()[0])
    assert {p.name for p in dumps.glob("rank*.json")} == {"rank0.json", "rank1.json"}
    assert time.perf_counter() - t0 < 120
