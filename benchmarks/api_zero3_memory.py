"""Peak memory per rank of a transformers Llama trained through ``shardlab.initialize`` with a
DeepSpeed ZeRO-3 JSON, beside DeepSpeed's own ZeRO-3 on the same model and JSON (docs/api.md,
ZeRO-3 on your model).

    PYTHONPATH=. python benchmarks/api_zero3_memory.py                 # 2 ranks, ~60M parameters
    PYTHONPATH=. python benchmarks/api_zero3_memory.py --n 4 --layers 16 --out results.md

Rows, each in fresh rank processes: shardlab with the JSON (units: the model's repeated blocks and
the modules outside them as large as one, ``parallel.wrap_policy = blocks``); shardlab with the
decoder layers alone as units (what ``blocks`` gave before 2026-12-07: embedding and head in the
root unit); shardlab with the one root unit that a user model got before
2026-12-07 (the whole model gathered through each micro-batch); DeepSpeed 0.19's ZeRO-3 (CPU
accelerator, torch's AdamW); shardlab's DDP for scale. The peak is VmHWM (the rank's peak RSS),
the largest over ranks; "before the model" is the RSS after imports and joining the job.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._ranks import max_over_ranks, peak_mib, reset_peak, rss_mib, write_table  # noqa: E402

MiB = 2**20


def model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d, intermediate_size=args.d * 8 // 3 // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=args.d // 64, num_key_value_heads=args.d // 128,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def ds_json(args, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}


def _worker(ctx, row: str, args):
    import torch
    if row == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_RANK"] = str(ctx.rank)
        import deepspeed
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__ = {}  # no JIT builds (tests/distributed/test_deepspeed_parity.py)
        lib = deepspeed
    else:
        import shardlab as lib
    import transformers  # noqa: F401  (imported before "before the model")
    torch.set_num_threads(1)
    before = rss_mib()
    net = model(args)
    params = sum(p.numel() for p in net.parameters())
    policies = {"shardlab root unit": f"size:{10**15}", "shardlab layers only": "class:LlamaDecoderLayer"}
    if row in policies:
        config = {"parallel": {"zero_stage": 3, "wrap_policy": policies[row]},
                  "train": {"global_batch": args.micro * ctx.world_size, "lr": 1e-4, "warmup_steps": 0, "device": "cpu",
                            "weight_decay_params": "all", "grad_clip": 1.0}}
    else:
        config = ds_json(args, 0 if row == "shardlab ddp" else 3)
    engine, *_ = lib.initialize(model=net, config=config, model_parameters=net.parameters())
    del net
    import gc
    gc.collect()
    built, after = peak_mib(), rss_mib()
    reset = reset_peak()  # from here VmHWM is the training steps' peak
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq), generator=g)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    steps = peak_mib()
    return {"peak": max_over_ranks(max(built, steps)), "before": max_over_ranks(before), "params": params,
            "after": max_over_ranks(after), "steps": max_over_ranks(steps) if reset else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2, help="ranks")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the table to this .md file")
    args = ap.parse_args()
    from shardlab import launch
    rows = ["shardlab (JSON, repeated blocks)", "shardlab layers only", "shardlab root unit", "shardlab ddp"]
    try:
        import deepspeed  # noqa: F401
        rows.insert(1, "deepspeed")
    except ImportError:
        print("deepspeed is not installed: its row is left out")
    got = {}
    for row in rows:
        got[row] = launch.run(_worker, args.n, row, args, timeout_s=900)[0]
        print(f"{row}: peak {got[row]['peak']:.0f} MiB", flush=True)
    psi = got[rows[0]]["params"]
    head = (f"transformers LlamaForCausalLM, {psi / 1e6:.1f}M parameters ({args.layers} layers, d {args.d}, vocab "
            f"{args.vocab}), {args.n} ranks, micro-batch {args.micro} x {args.seq} tokens, {args.steps} AdamW steps, fp32; "
            f"ZeRO-3's model state 16 B x params / N = {16 * psi / args.n / MiB:.0f} MiB, DDP's 16 B x params = "
            f"{16 * psi / MiB:.0f} MiB")
    lines = ["| run | peak RSS per rank, MiB | before the model | after initialize | peak of the steps | "
             "steps' peak - after initialize |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        r = got[row]
        lines.append(f"| {row} | {r['peak']:.0f} | {r['before']:.0f} | {r['after']:.0f} | {r['steps']:.0f} | "
                     f"{r['steps'] - r['after']:.0f} |")
    table = "\n".join(lines)
    print(head)
    print(table)
    write_table(args.out, head, table, json.dumps({k: v for k, v in vars(args).items() if k != "out"}))


if __name__ == "__main__":
    main()
