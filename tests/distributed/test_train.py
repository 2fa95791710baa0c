"""Train loop: data-parallel parity with one process, bit-exact resume, mixed precision."""
import json
from pathlib import Path

import pytest
import torch

from shardlab import config as C
from shardlab import launch
from shardlab.analysis.verify import reference as verify_reference
from shardlab.cli import main as cli_main
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.train.data import TokenData, prepare
from shardlab.train.loop import Trainer
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=32", "--train.seq_len=32", "--train.global_batch=8", "--train.warmup_steps=2",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1"]


def _cfg(tmp, extra=()):
    return C.load(None, TINY + [f"--data.cache_dir={tmp}/cache", f"--logging.run_dir={tmp}/run", *extra])


def _dp_worker(ctx, cfg, data_dir, steps):
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    tr = Trainer(cfg, mesh, TokenData(data_dir))
    losses = [tr.engine.global_loss(tr.train_step()["local_loss"]) for _ in range(steps)]
    return losses, {n: p.detach().clone() for n, p in tr.engine.model.named_parameters()}


def _reference(cfg, data_dir, steps):
    """Independent single-process AdamW on the whole global batch (no shardlab engine): the
    reference of `shardlab verify`. Returns (losses, {name: parameter})."""
    losses, params = verify_reference(cfg, data_dir, steps)
    return losses, {k[len("model."):]: v for k, v in params.items()}


@pytest.mark.parametrize("dp,micro", [(2, 2), (4, 1)])
def test_data_parallel_matches_single_process(tmp_path, dp, micro):
    cfg = _cfg(tmp_path, ["--train.precision=fp64", f"--parallel.dp_replicate={dp}",
                          f"--parallel.microbatches={micro}", "--train.grad_clip=0.05"])
    cfg.validate(dp)
    data_dir = str(prepare(cfg.data))
    ref_losses, ref_params = _reference(cfg, data_dir, 3)
    out = launch.run(_dp_worker, dp, cfg, data_dir, 3, timeout_s=60)
    for losses, params in out:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10
        for n, p in params.items():
            assert (p - ref_params[n]).abs().max().item() < 1e-10, n


def _final_state(run_dir):
    """Every global tensor of the newest checkpoint (read back whole through the Reader) and its meta."""
    from shardlab.checkpoint.save import Reader, latest_valid
    reader = Reader(latest_valid(Path(run_dir) / "checkpoints"))
    tensors = {k: reader.read(k) for k in reader.keys()}
    return tensors, dict(reader.meta, step=reader.step)


def test_resume_is_bit_exact(tmp_path):
    base = TINY + [f"--data.cache_dir={tmp_path}/cache", "--train.steps=6", "--logging.log_every=1"]
    assert cli_main(["train", "--nproc", "2", *base, f"--logging.run_dir={tmp_path}/full"]) == 0
    assert cli_main(["train", "--nproc", "2", *base, f"--logging.run_dir={tmp_path}/half",
                     "--checkpoint.every=3", "--train.steps=3"]) == 0
    # resume with the full step count: the LR schedule must be the same as the uninterrupted run
    assert cli_main(["train", "--nproc", "2", *base, f"--logging.run_dir={tmp_path}/half",
                     "--checkpoint.every=3", "--resume"]) == 0
    full, fmeta = _final_state(tmp_path / "full")
    half, hmeta = _final_state(tmp_path / "half")
    assert fmeta["step"] == hmeta["step"] == 6
    assert set(full) == set(half)
    for k in full:
        if k.startswith(("model.", "optim.")):
            assert torch.equal(full[k], half[k]), k
    assert fmeta["data"] == hmeta["data"]

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("kind") == "train"]
    assert losses(tmp_path / "full") == losses(tmp_path / "half")


def _mixed_worker(ctx, cfg, data_dir):
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    tr = Trainer(cfg, mesh, TokenData(data_dir))
    outs = [tr.train_step() for _ in range(4)]
    return [tr.engine.global_loss(o["local_loss"]) for o in outs], tr.scaler.state_dict()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, precision):
    cfg = _cfg(tmp_path, [f"--train.precision={precision}", "--train.loss_scale_init=1e30"])
    data_dir = str(prepare(cfg.data))
    (losses, scaler), = launch.run(_mixed_worker, 1, cfg, data_dir)
    assert all(torch.isfinite(torch.tensor(losses)))
    if precision == "fp16":
        # 1e30 overflows fp16 gradients: steps are skipped and the scale halves until it fits
        assert scaler["skipped"] >= 1 and scaler["scale"] < 1e30


def test_cli_train_writes_metrics_plot_profile(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--nproc", "1", *TINY, f"--data.cache_dir={tmp_path}/cache", f"--logging.run_dir={run}",
            "--train.steps=4", "--logging.log_every=2", "--profile", "1", "--checkpoint.save=false",
            "--logging.tensorboard=true"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "validation loss" in out and str(run / "loss.png") in out
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_bytes_per_step"):
        assert key in train[-1]
    assert (run / "loss.png").stat().st_size > 1000
    assert json.loads((run / "profile" / "rank0.json").read_text())["traceEvents"]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert cli_main(["plot", str(run), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").exists()
    assert cli_main(["plot", str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize("transport", ["process_group", "shared", "shared+thread"])
def test_profile_reports_gradient_all_reduce_overlapping_backward(tmp_path, capsys, transport):
    """DDP with small buckets on 2 ranks: on gloo the Chrome traces show its all-reduces running
    while the loop thread computes backward (analysis/overlap.py), and the run's summary says how
    much; the shared-memory transport (the CPU default) runs them inline: communication, none of it
    overlapped; with ``parallel.comm_thread`` they run on that thread, which the profiler records
    (``profile_all_threads``: the lease of 2026-11-27 saw 0 ms without it), beside the loop's
    backward. The model is configs/tiny.toml's shape (a backward long enough to hide the buckets)."""
    from shardlab.analysis.overlap import overlap
    run = tmp_path / "run"
    shape = ["--model.d_model=128", "--model.n_layers=4", "--model.max_seq_len=64", "--train.seq_len=64",
             "--train.global_batch=16"]
    args = ["train", "--nproc", "2", *TINY, *shape, f"--data.cache_dir={tmp_path}/cache", f"--logging.run_dir={run}",
            "--train.steps=5", "--profile", "2", "--checkpoint.save=false", "--parallel.bucket_cap_mb=0.05",
            f"--parallel.comm_transport={transport.split('+')[0]}", f"--parallel.comm_thread={'+' in transport}"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "overlapped with compute" in out and "exposed per step" in out and str(run / "profile") in out
    for r in (0, 1):
        o = overlap(run / "profile" / f"rank{r}.json")
        assert o["comm_us"] > 0 and (o["fraction"] == 0 if transport == "shared" else o["fraction"] > 0.1), (r, o)


def test_progress_in_a_log_is_a_line_per_logged_step(tmp_path):
    """stderr not a terminal (a log file, a pipe, Ray's worker logs): rank 0 writes one line per
    logged step, not a tqdm bar redrawn with carriage returns; the lines hold the logged losses.
    A fresh process: ranks forked from an earlier test's forkserver write to that one's stderr."""
    import subprocess
    import sys
    args = [a for a in TINY if not a.startswith("--logging.progress")]
    run = subprocess.run([sys.executable, "-m", "shardlab.cli", "train", "--nproc", "2", *args, "--train.steps=4",
                          "--logging.log_every=2", f"--data.cache_dir={tmp_path}/cache",
                          f"--logging.run_dir={tmp_path}/run"], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("train: step")]
    assert [line.split()[2] for line in lines] == ["2/4", "4/4"], run.stderr
    assert "\r" not in run.stderr and "%|" not in run.stderr, run.stderr
    logged = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [f"{r['loss']:.3f}" for r in logged if r.get("kind") == "train"]
    assert [line.split()[4] for line in lines] == losses
