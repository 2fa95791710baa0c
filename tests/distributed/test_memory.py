"""Measured per-rank model-state bytes (every allocated storage counted once, after one real
AdamW step) equal the ZeRO formula within 2% for DDP and ZeRO stages 1, 2 and 3."""

from shardlab.analysis.memory import _measure_worker, formula
from shardlab.config import Config
from shardlab.launch import run
from shardlab.models import build_model, count_params


def _cfg(stage: int, n: int) -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = 96, 64, 2, 4
    cfg.model.max_seq_len = cfg.train.seq_len = 16
    cfg.train.global_batch = 2 * n
    cfg.parallel.dp_shard, cfg.parallel.zero_stage, cfg.parallel.microbatches = n, stage, 2
    cfg.parallel.bucket_cap_mb = 0.05  # several buckets: padding per bucket is counted too
    return cfg


def _all_stages(ctx, n):
    return [_measure_worker(ctx, _cfg(stage, n)) for stage in range(4)]


def test_measured_model_state_matches_zero_formula():
    n = 2
    psi = count_params(build_model(_cfg(0, n).model, 0))
    per_rank = run(_all_stages, n, n, threads=1, timeout_s=120)
    for rank, stages in enumerate(per_rank):
        for stage, (params, grads, optim) in enumerate(stages):
            want = formula(psi, n, stage, "fp32")
            for what, got, exp in (("params", params, want.params), ("grads", grads, want.grads),
                                   ("optim", optim, want.optim)):
                assert abs(got - exp) <= 0.02 * exp, f"rank {rank} stage {stage} {what}: {got} vs {exp}"


def test_memory_command_measures_a_non_transformer(capsys):
    """`shardlab memory` on the CNN: real images through every stage's engine (ModelSpec.sample_batch),
    measured bytes equal the formula; no transformer activation estimate is printed for it."""
    from shardlab.cli import main
    for stage in (0, 3):
        assert main(["memory", "configs/cnn-fashion-mnist.toml", "--nproc", "2",
                     f"--parallel.zero_stage={stage}"]) == 0
        out = capsys.readouterr().out
        assert "no estimate for model.arch=cnn" in out and out.count("ratio 1.000") == 2, out
