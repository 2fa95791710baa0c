"""`shardlab train` with a ds_* schedule and fp16: a step skipped for an overflow does not advance
the schedule, as DeepSpeed's scheduler steps only after an applied step (before 2026-12-08 the
schedule counted every step, so overflows at the start used up the warm-up). The lrs the run
logged against DeepSpeed's own WarmupLR stepped on the run's applied steps. Also: the CPU peak
probe leaves the global RNG alone (train.seed's dropout masks depended on whether it ran)."""
import json

import pytest
import torch

from shardlab.cli import main as cli_main

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=2", "--model.max_seq_len=16",
        "--train.seq_len=16", "--train.global_batch=4", "--logging.log_every=1", "--logging.tensorboard=false",
        "--logging.progress=false", "--train.eval_every=0", "--checkpoint.save=false"]


def test_fp16_overflows_do_not_advance_a_deepspeed_schedule(tmp_path):
    lrs = pytest.importorskip("deepspeed.runtime.lr_schedules")
    run = tmp_path / "run"
    assert cli_main(["train", "configs/tiny.toml", "--nproc", "2", *TINY, f"--data.cache_dir={tmp_path}/cache",
                     f"--logging.run_dir={run}", "--train.steps=10", "--train.precision=fp16",
                     "--train.loss_scale_init=8e6", "--train.lr_schedule=ds_warmup", "--train.warmup_steps=6",
                     "--train.warmup_type=linear", "--train.lr=1e-2"]) == 0
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    sched = lrs.WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=6, warmup_type="linear")
    skipped = 0
    for r in rows:
        assert r["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), r["step"]
        if r["skipped_steps"] == skipped:  # applied: DeepSpeed's engine steps its scheduler
            sched.step()
        skipped = r["skipped_steps"]
    assert 0 < skipped < len(rows)  # the run had overflows and applied steps, so the check can fail


def test_the_cpu_peak_probe_leaves_the_global_rng_alone():
    from shardlab.train import metrics
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    metrics.matmul_rate(64, 0.01)
    assert torch.equal(torch.rand(4), want)
