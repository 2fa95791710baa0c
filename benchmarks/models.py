"""Other architectures, side by side in one run: own DDP vs torch DDP and own ZeRO-3/FSDP vs
torch FSDP2 ``fully_shard``, for every architecture named (default: GPT-2 and the CNN).

    python benchmarks/models.py [--arch gpt2 cnn] [--nproc 2] [--steps 6] [--warmup 2]

CPU gloo, fp32, one thread per rank, AdamW, gradient clipping 1.0. GPT-2: d_model 256, 4 layers,
8 heads, vocab 256 (byte-level), micro-batch 2 x 64 tokens per rank. CNN: the seeds' CNN
(fc1 width 128) on 32 random 28x28 images per rank. Both FSDPs wrap each of the architecture's
blocks (``ModelSpec.blocks``) and the root. Step time: median over the timed steps of the slowest
rank; the contenders of a comparison are built together and timed in turns (A, B, A, B, ...).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from shardlab.config import Config
from shardlab.launch import run
from shardlab.models import build_model, count_params, get_spec
from shardlab.models.spec import sample_batch
from data_parallel import own, time_step, torch_ddp, torch_fsdp2  # the same contenders and timer as the Llama benchmark

SHAPES = {  # arch -> (model fields, per-rank micro-batch)
    "gpt2": (dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, max_seq_len=64), 2),
    "cnn": (dict(d_model=128, n_classes=10), 32),
    "llama": (dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, max_seq_len=64), 2),
}
SEQ = 64


def make_cfg(arch: str, n: int, zero_stage: int) -> Config:
    cfg = Config()
    fields, micro = SHAPES[arch]
    cfg.model.arch = arch
    for k, v in fields.items():
        setattr(cfg.model, k, v)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.grad_clip = SEQ, micro * n, 1.0
    cfg.parallel.dp_shard, cfg.parallel.zero_stage = n, zero_stage
    return cfg


def _batch(cfg, rank, step):
    return sample_batch(cfg, SHAPES[cfg.model.arch][1], torch.Generator().manual_seed(1000 * step + rank))


def _bench(ctx, archs, n, warmup, steps):
    rows = []
    for arch in archs:
        for group, stage, contenders in (("DDP", 0, [("own", own), ("torch DDP", torch_ddp)]),
                                         ("ZeRO-3/FSDP", 3, [("own", own), ("torch FSDP2", torch_fsdp2)])):
            cfg = make_cfg(arch, n, stage)
            built = [(name, fn(cfg)[0]) for name, fn in contenders]  # (step, extra) -> step
            times = {name: [] for name, _ in built}
            for s in range(warmup + steps):
                for name, step in built[s % 2:] + built[:s % 2]:  # rotate who goes first
                    t = time_step(step, *_batch(cfg, ctx.rank, s))
                    if s >= warmup:
                        times[name].append(t)
            rows.append((arch, group, {k: statistics.median(v) for k, v in times.items()}))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["gpt2", "cnn"], choices=sorted(SHAPES))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    for arch in args.arch:
        cfg = make_cfg(arch, 1, 0)
        print(f"{arch}: {count_params(build_model(cfg.model, 0)):,} parameters, "
              f"{SHAPES[arch][1]} {'images' if get_spec(arch).task == 'classify' else f'x {SEQ} tokens'} per rank")
    rows = run(_bench, args.nproc, args.arch, args.nproc, args.warmup, args.steps, threads=1, timeout_s=1200)[0]
    print(f"\n### N = {args.nproc}, CPU gloo, fp32\n")
    print("| arch | comparison | own step ms | torch step ms | own / torch |")
    print("|---|---|---:|---:|---:|")
    for arch, group, t in rows:
        other = next(k for k in t if k != "own")
        print(f"| {arch} | {group} (vs {other}) | {1000 * t['own']:.1f} | {1000 * t[other]:.1f} | "
              f"{t['own'] / t[other]:.2f}x |")


if __name__ == "__main__":
    main()
