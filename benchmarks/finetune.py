"""Full fine-tuning vs LoRA on a pretrained model, side by side in one run: SmolLM2-135M-Instruct
(the packaged GGUF) on Shakespeare tokenised with the model's own BPE tokenizer.

    python benchmarks/finetune.py [--source smollm2] [--nproc 2] [--steps 20] [--ranks 0,8,16]

Every mode starts from the same base weights (``checkpoint.base``), runs the same steps on the same
global batches (DDP over ``--nproc`` CPU ranks, fp32, AdamW, cosine LR with warm-up) and reports:
trainable parameters; model state per rank *measured* after the first step (the storages of
parameters, gradients and optimizer state a rank holds: analysis/memory.measure); tokens/s over the
timed steps (the first step is warm-up); validation loss of the base (before) and after, on the
same held-out batches. Rank 0 prints a Markdown table (also written to --out).
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from shardlab import config as C
import shardlab.train.checks  # noqa: F401  (registers every config check validate runs)
from shardlab.analysis.measured_memory import measure
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models.spec import add_adapters, meta_model
from shardlab.train import finetune
from shardlab.train.data import TokenData
from shardlab.train.loop import Trainer

MIB = 2 ** 20


def make_cfg(args, rank: int) -> C.Config:
    cfg = C.from_dict({
        "checkpoint": {"base": args.source, "save": False},
        "parallel": {"dp_replicate": args.nproc},
        "train": {"steps": args.steps, "seq_len": args.seq_len, "global_batch": args.global_batch,
                  "lr": args.lr_lora if rank else args.lr_full, "warmup_steps": args.warmup, "weight_decay": 0.0,
                  "eval_batches": args.eval_batches, "lora_rank": rank, "lora_alpha": 2.0 * rank if rank else 16.0,
                  "seed": 1234},
        "logging": {"progress": False, "tensorboard": False},
    })
    finetune.resolve_base(cfg)
    return cfg.validate(args.nproc)


def trainable_params(cfg) -> int:
    model = meta_model(cfg.model)
    if cfg.train.lora_rank:
        add_adapters(model, cfg.train)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _worker(ctx, cfg, data_dir, steps):
    torch.set_num_threads(1)
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    tr = Trainer(cfg, mesh, TokenData(data_dir), init=False)
    tr.load_base()
    val = tr.loader.val_batches(cfg.train.eval_batches)
    before = tr.evaluate(val)
    tr.train_step()  # warm-up (allocates buckets and optimizer state)
    state = measure(tr.engine, tr.optimizer)
    world = mesh.comm("world")
    world.barrier()
    t0 = time.perf_counter()
    losses = [tr.train_step()["local_loss"] for _ in range(steps - 1)]
    world.barrier()
    seconds = time.perf_counter() - t0
    after = tr.evaluate(val)
    return {"before": before, "after": after, "seconds": seconds, "state": dataclasses.astuple(state),
            "last_train_loss": losses[-1] if losses else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2", help="pretrained source (smollm2, .gguf, HF dir, checkpoint)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per mode (the first is warm-up)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr-full", type=float, default=5e-5, help="peak LR of full fine-tuning")
    ap.add_argument("--lr-lora", type=float, default=2e-3, help="peak LR of the LoRA runs")
    ap.add_argument("--ranks", default="0,8,16", help="modes: 0 = full fine-tuning, r > 0 = LoRA rank r")
    ap.add_argument("--out", default="benchmarks/results/finetune.md")
    args = ap.parse_args()
    modes = [int(r) for r in args.ranks.split(",")]
    cfg0 = make_cfg(args, modes[0])
    data_dir = finetune.prepare_tokens(cfg0, _source(args))
    tokens_per_step = args.seq_len * args.global_batch
    rows = []
    for r in modes:
        cfg = make_cfg(args, r)
        res = run(_worker, args.nproc, cfg, str(data_dir), args.steps, threads=1, timeout_s=3600)
        st = res[0]["state"]
        rows.append({"mode": f"LoRA r={r}" if r else "full", "trainable": trainable_params(cfg),
                     "state_mib": [sum(x["state"]) / MIB for x in res], "params_mib": st[0] / MIB,
                     "grads_mib": st[1] / MIB, "optim_mib": st[2] / MIB,
                     "tok_s": tokens_per_step * (args.steps - 1) / max(x["seconds"] for x in res),
                     "before": res[0]["before"], "after": res[0]["after"]})
        print(f"{rows[-1]['mode']}: val {rows[-1]['before']:.4f} -> {rows[-1]['after']:.4f}", flush=True)
    table = render(args, rows)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table + "\n")


def _source(args):
    from shardlab.models.pretrained import open_source
    return open_source(args.source)


def render(args, rows) -> str:
    head = (f"SmolLM2 fine-tuning on Shakespeare ({args.source}), N={args.nproc} CPU ranks (DDP, fp32), "
            f"{args.steps} steps of {args.global_batch} x {args.seq_len} tokens; LR full {args.lr_full:g}, "
            f"LoRA {args.lr_lora:g} (alpha = 2r)\n\n"
            "| mode | trainable params | model state / rank (MiB): params + grads + optim | tokens/s | "
            "val loss before | val loss after | change |\n|---|---:|---|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['trainable']:,} | {max(r['state_mib']):.1f} = {r['params_mib']:.1f} + "
                     f"{r['grads_mib']:.1f} + {r['optim_mib']:.1f} | {r['tok_s']:.0f} | {r['before']:.4f} | "
                     f"{r['after']:.4f} | {r['after'] - r['before']:+.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
