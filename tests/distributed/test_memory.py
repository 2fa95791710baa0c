"""Measured per-rank model-state bytes (every allocated storage counted once, after one real
AdamW step) equal the ZeRO formula within 2% for DDP and ZeRO stages 1, 2 and 3, with and without
LoRA adapters (optimizer state and gradients for the trainable adapters only)."""
import re

import pytest

from shardlab.analysis.measured_memory import _measure_worker, formula
from shardlab.config import Config
from shardlab.launch import run
from shardlab.models import build_model, count_params


def _cfg(stage: int, n: int, lora: int = 0) -> Config:
    cfg = Config()
    cfg.train.lora_rank = lora
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = 96, 64, 2, 4
    cfg.model.max_seq_len = cfg.train.seq_len = 16
    cfg.train.global_batch = 2 * n
    cfg.parallel.dp_shard, cfg.parallel.zero_stage, cfg.parallel.microbatches = n, stage, 2
    cfg.parallel.bucket_cap_mb = 0.05  # several buckets: padding per bucket is counted too
    return cfg


def _all_stages(ctx, n, lora=0):
    return [_measure_worker(ctx, _cfg(stage, n, lora), 1)[0] for stage in range(4)]


@pytest.mark.parametrize("lora", [0, 4])
def test_measured_model_state_matches_zero_formula(lora):
    """With LoRA (rank 4 on every linear of the blocks) the frozen base is held whole on every rank
    and only the adapters take gradients and optimizer state: the formula with ``trainable``."""
    n = 2
    psi = count_params(build_model(_cfg(0, n).model, 0))
    trainable = None
    if lora:  # adapters: r x in + out x r per linear of each block, counted from the shapes
        cfg = _cfg(0, n)
        d, h = cfg.model.d_model, build_model(cfg.model, 0).layers["0"].feed_forward.w1.out_features
        kv = d // cfg.model.n_heads * (cfg.model.n_kv_heads or cfg.model.n_heads)
        per_block = sum(lora * (i + o) for i, o in ((d, d), (d, kv), (d, kv), (d, d), (d, h), (d, h), (h, d)))
        trainable = cfg.model.n_layers * per_block
        psi += trainable
    per_rank = run(_all_stages, n, n, lora, threads=1, timeout_s=120)
    for rank, stages in enumerate(per_rank):
        for stage, (params, grads, optim) in enumerate(stages):
            want = formula(psi, n, stage, "fp32", trainable)
            for what, got, exp in (("params", params, want.params), ("grads", grads, want.grads),
                                   ("optim", optim, want.optim)):
                assert abs(got - exp) <= 0.02 * exp, f"rank {rank} stage {stage} {what}: {got} vs {exp}"


def test_memory_command_measures_a_non_transformer(capsys):
    """`shardlab memory` on the CNN: real images through every stage's engine (ModelSpec.sample_batch),
    measured bytes equal the formula; its activations come from the whole-model trace
    (analysis/plan_images.py) and the evaluation pass's line is printed."""
    from shardlab.cli import main
    for stage in (0, 3):
        assert main(["memory", "configs/cnn-fashion-mnist.toml", "--nproc", "2",
                     f"--parallel.zero_stage={stage}"]) == 0
        out = capsys.readouterr().out
        assert "evaluation (every 500 steps and after the last" in out, out
        # the two state rows (params + grads + optim) equal the formula; the peak rows' ratio varies by host
        assert len(re.findall(r"rank \d: params .*, ratio 1\.000\)", out)) == 2, out
        row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["0", "0"])
        assert float(row[5]) > 20, row  # activ. MiB: 64 images' saved tensors (23.4 MiB, test_plan_images.py)
