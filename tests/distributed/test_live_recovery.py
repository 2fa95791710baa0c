"""Live recovery of replica groups (docs/faults.md, "Live recovery"; train.fault_tolerance = replica).

* without failures, 2 replicas x 1 rank equal plain data parallel (dp_replicate = 2) run by
  ``shardlab train`` (float64, independent code path: DDP's all-reduce, no quorum);
* a replica SIGKILLed in the middle of a step (after its backward, before the cross-replica
  average) is dropped, the survivor trains degraded steps (logged with the live count and the
  effective batch), the replacement is healed and the replicas end bit-identical;
* a replacement that receives damaged state (one flipped byte) refuses it and is healed on retry;
* 2 replicas x 2 ranks (FSDP inside each replica): a rank raising mid-step takes its replica
  down, which is replaced and healed.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from shardlab import config as C
from shardlab import launch_replicas
from shardlab.train import finetune
from shardlab.train.heal import train_replica
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)
from shardlab.train.plan import make_plan

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=0",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0",
        "--logging.log_every=1", "--train.precision=fp64", "--train.threads=1"]


def _cfg(tmp_path, *extra, steps=6, world=2):
    cfg = C.load(None, TINY + [f"--data.cache_dir={tmp_path}/cache", f"--logging.run_dir={tmp_path}/ft",
                               f"--train.steps={steps}", "--parallel.dp_replicate=2", *extra])
    return cfg.validate(world_size=world)


def _run(cfg, n_local=1, faults=None):
    data_dir = finetune.prepare_tokens(cfg, None)
    return launch_replicas.run(train_replica, 2, n_local, str(data_dir), timeout_s=30, ft_timeout_s=10,
                               threads=1, faults=faults, say=lambda *_: None, plan=make_plan(cfg))


def _records(run_dir, r):
    return [json.loads(x) for x in (Path(run_dir) / f"replica_{r}" / "metrics.jsonl").read_text().splitlines()]


def _identical(results):
    a, b = results[0], results[1]
    for ra, rb in zip(a, b):
        assert ra["step"] == rb["step"] and ra["fingerprint"] == rb["fingerprint"]
        for k in ra["params"]:
            assert torch.equal(ra["params"][k], rb["params"][k]), k


def test_no_failure_equals_plain_data_parallel(tmp_path):
    from shardlab.cli import main as cli_main
    from shardlab.checkpoint.save import Reader, latest_valid
    cfg = _cfg(tmp_path)
    results, report = _run(cfg)
    assert report["failures"] == [] and all(r[0]["degraded"] == 0 and r[0]["steps"] == 6 for r in results)
    _identical(results)
    assert cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={tmp_path}/cache", "--train.steps=6",
                     f"--logging.run_dir={tmp_path}/ddp"]) == 0
    reader = Reader(latest_valid(tmp_path / "ddp" / "checkpoints"))
    for name, p in results[0][0]["params"].items():
        ref = reader.read(f"model.{name}")
        assert p.dtype == torch.float64 and torch.allclose(p, ref, rtol=0, atol=1e-10), name


def test_replica_killed_mid_step_heals_and_replicas_end_identical(tmp_path):
    cfg = _cfg(tmp_path, steps=8)
    results, report = _run(cfg, faults={"kill": [[1, 0, 0, 3, "sigkill"]], "hold_start": [[1, 1, 2.0]]})
    _identical(results)
    f, = report["failures"]
    assert f["replica"] == 1 and "signal 9" in f["why"] and f["rejoin"] is not None
    assert results[1][0]["gen"] == 1 and results[1][0]["healed"] == 1 and results[0][0]["step"] == 8
    recs = [r for r in _records(tmp_path / "ft", 0) if r["kind"] == "train"]
    assert [r["step"] for r in recs] == list(range(1, 9))  # every step once: none lost, none twice
    degraded = [r for r in recs if r["degraded"]]
    assert degraded and all(r["live_replicas"] == 1 and r["effective_batch"] == 2 for r in degraded)
    assert degraded[0]["step"] == 3  # the step the replica died in was retried without it
    assert all(r["live_replicas"] == 2 for r in recs if r["step"] < 3)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)


def test_corrupt_heal_is_refused_and_retried(tmp_path):
    cfg = _cfg(tmp_path, steps=6)
    flag = tmp_path / "corrupted-once"
    results, _ = _run(cfg, faults={"kill": [[1, 0, 0, 2, "sigkill"]], "corrupt_once": str(flag)})
    assert flag.exists()
    assert results[1][0]["refused"] == 1 and results[1][0]["healed"] == 1
    _identical(results)


@pytest.mark.parametrize("how", ["raise"])
def test_two_rank_replicas_fsdp_inside(tmp_path, how):
    cfg = _cfg(tmp_path, "--parallel.dp_shard=2", "--parallel.zero_stage=3", "--train.global_batch=8", steps=5,
               world=4)
    results, report = _run(cfg, n_local=2, faults={"kill": [[0, 0, 1, 2, how]]})
    assert report["failures"][0]["replica"] == 0
    _identical(results)
    assert results[0][0]["gen"] == 1 and results[0][1]["healed"] == 1


def test_replica_mode_without_replicas_is_refused(tmp_path, capsys):
    from shardlab.cli import main as cli_main
    code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={tmp_path}/cache", "--parallel.dp_shard=2",
                     "--train.fault_tolerance=replica", f"--logging.run_dir={tmp_path}/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "train.fault_tolerance" in err[-1] and "dp_replicate" in err[-1], err
    assert not (tmp_path / "r").exists()


def test_short_soak(tmp_path):
    """benchmarks/soak.py, short: 2 replicas x 2 ranks (FSDP inside), a handful of seeded failures
    of every kind (SIGKILL, SIGSTOP, raised exception); replicas identical, no process left, every
    step recorded once, no stretch without a committed step longer than the start deadline."""
    import argparse
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import soak
    args = argparse.Namespace(replicas=2, ranks=2, minutes=2.0, failures=6, gap=0.3, timeout=2.0, seed=3,
                              cache=str(tmp_path / "cache"), spares=1, start_timeout=30.0)
    res = soak.soak(args)
    print(soak.table(args, res))
    assert res["identical"] and res["orphans"] == [] and res["clash"] == 0 and res["missing"] == 0
    assert res["gap"] < args.start_timeout
    assert len(res["fails"]) == 6 and {f["how"].split(":")[0] for f in res["fails"]} == {"sigkill", "sigstop", "raise"}
    for f in res["fails"]:
        if "t_detect" in f:  # dropped: detected within the timeout (+ supervision slack), then rejoined
            assert f["detect"] < args.timeout + 1.0 and f["rejoin"] is not None, f
        else:  # ridden out: only a pause shorter than the timeout may go undetected
            assert f["how"].startswith("sigstop") and float(f["how"].split(":")[1]) < args.timeout, f


def _sleep_forever():
    import time
    time.sleep(600)


def test_soak_counts_a_rank_left_by_the_forkserver():
    """The soak's orphan count sees a rank the launcher's forkserver forked (a grandchild of this
    process whose command line is the server's), and not the server itself."""
    import sys
    from shardlab import launch
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import soak
    p = launch.rank_context("cpu").Process(target=_sleep_forever, daemon=True)
    p.start()
    try:
        left = soak._children()
        assert p.pid in left
        assert not [q for q in left if q != p.pid and b"forkserver" in Path(f"/proc/{q}/cmdline").read_bytes()]
    finally:
        p.kill()
        p.join()
    assert p.pid not in soak._children()


def _reference(ctx, cfg, data_dir, members_by_step):
    """One process, no quorum: step s trains on the samples of the replicas that were live at s
    (their shards of the global batch), the mean over those samples; AdamW, clipping, LR as usual."""
    import copy
    from shardlab.distributed.mesh import Mesh
    from shardlab.distributed.topology import Topology
    from shardlab.train.loop import Trainer, open_data
    one = copy.deepcopy(cfg)
    one.parallel.dp_replicate = 1
    mesh = Mesh.build(Topology.from_config(one.parallel), ctx.device, transport="process_group")
    tr = Trainer(one, mesh, open_data(one, data_dir))
    full, per = tr.loader, cfg.train.global_batch // cfg.parallel.dp_replicate

    class Live:  # the live replicas' shards of the step's global batch
        def next_batch(self):
            (x, y), = full.next_batch()
            rows = torch.cat([torch.arange(r * per, (r + 1) * per) for r in members_by_step[tr.step + 1]])
            return [(x[rows], y[rows])]
    tr.loader = Live()
    while tr.step < cfg.train.steps:
        tr.train_step()
    return {n: p.detach().clone() for n, p in tr.engine.model.named_parameters()}


def test_degraded_steps_equal_a_single_process_on_the_live_shards(tmp_path):
    """The killed-mid-step run against an independent computation: one process that trains each
    step on exactly the live replicas' samples (members recorded per step in the metrics)."""
    from shardlab import launch
    cfg = _cfg(tmp_path, steps=6)
    results, _ = _run(cfg, faults={"kill": [[0, 0, 0, 2, "sigkill"]], "hold_start": [[0, 1, 2.0]]})
    members = {}
    for r in (0, 1):
        for rec in _records(tmp_path / "ft", r):
            if rec["kind"] == "train":
                members.setdefault(rec["step"], rec["members"])
    assert sorted(members) == list(range(1, 7)) and members[2] == [1] and members[1] == [0, 1]
    ref, = launch.run(_reference, 1, cfg, str(finetune.prepare_tokens(cfg, None)), members, threads=1)
    for name, p in results[1][0]["params"].items():
        assert torch.allclose(p, ref[name], rtol=0, atol=1e-10), name


def test_replacement_stuck_at_start_is_started_again(tmp_path):
    """A replacement that never asks to join (hung before its first request) is failed at the
    launcher's start deadline and started again; the survivor trains on meanwhile; identical end."""
    cfg = _cfg(tmp_path, steps=10)
    data_dir = finetune.prepare_tokens(cfg, None)
    results, report = launch_replicas.run(train_replica, 2, 1, str(data_dir), timeout_s=30, ft_timeout_s=10, plan=make_plan(cfg),
                                          threads=1, say=lambda *_: None, start_timeout_s=4.0,
                                          faults={"kill": [[1, 0, 0, 2, "sigkill"]], "hold_start": [[1, 1, 10**6]]})
    first, stuck = report["failures"]
    assert "signal 9" in first["why"] and stuck["gen"] == 1 and "did not ask to join within 4 s" in stuck["why"]
    assert results[1][0]["gen"] == 2 and results[1][0]["healed"] == 1
    _identical(results)


def test_eval_checkpoints_and_resume_in_replica_mode(tmp_path):
    """train.eval_every and checkpoint.every work with replicas (the lowest live replica records /
    saves); --resume loads the newest checkpoint in every replica and ends where an uninterrupted
    run ends, bit for bit."""
    from shardlab.cli import main as cli_main
    from shardlab.checkpoint.save import list_checkpoints
    base = ["train", "--nproc", "2", *TINY, f"--data.cache_dir={tmp_path}/cache", "--parallel.dp_replicate=2",
            "--train.fault_tolerance=replica", "--train.eval_every=2", "--checkpoint.every=2"]
    assert cli_main(base + ["--train.steps=6", f"--logging.run_dir={tmp_path}/b"]) == 0
    saved = list_checkpoints(tmp_path / "b" / "checkpoints")
    assert [p.name for p in saved] == ["step_00000002", "step_00000004", "step_00000006"]
    val = [r for r in _records(tmp_path / "b", 0) if r["kind"] == "val"]
    assert [r["step"] for r in val] == [2, 4, 6] and all(r["val_loss"] > 0 for r in val)
    shutil.copytree(saved[1], tmp_path / "a" / "checkpoints" / saved[1].name)  # a run that stopped after step 4
    assert cli_main(base + ["--train.steps=6", f"--logging.run_dir={tmp_path}/a", "--resume"]) == 0
    assert [r["step"] for r in _records(tmp_path / "a", 0) if r["kind"] == "train"] == [5, 6]  # resumed at 4
    from shardlab.checkpoint.save import Reader
    a, b = Reader(tmp_path / "a" / "checkpoints" / "step_00000006"), Reader(saved[2])
    assert a.keys() == b.keys() and any(k.startswith("model.") for k in a.keys())
    for name in b.keys():  # parameters and optimizer state
        assert torch.equal(a.read(name), b.read(name)), name
    assert a.meta["data"] == b.meta["data"]


@pytest.mark.parametrize("extra, field", [(["--max-restarts", "2"], "--max-restarts"),
                                          (["--train.precision=fp16"], "train.precision")])
def test_replica_mode_refuses_what_it_cannot_honour(tmp_path, capsys, extra, field):
    from shardlab.cli import main as cli_main
    code = cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={tmp_path}/cache", "--parallel.dp_replicate=2",
                     "--train.fault_tolerance=replica", f"--logging.run_dir={tmp_path}/r", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and field in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "r").exists()
