"""Legacy single-process DataParallel vs DDP (one process per rank) on the CNN, Fashion-MNIST.

    PYTHONPATH=. python examples/dataparallel_vs_ddp.py --nproc 2 --steps 30

Both train the same initial model on the same global batches (dropout off, AdamW): the losses
agree to float32 rounding. DataParallel scatters each batch, replicates the parameters every step
and runs the replicas in threads of one process (parallel/dataparallel_legacy.py); DDP runs one
process per rank and all-reduces gradient buckets during backward (parallel/ddp.py). On a CPU the
"devices" share the same cores, so the timings compare the overheads, not a speed-up.
"""
from __future__ import annotations

import argparse
import time

import torch

from shardlab.config import Config
import shardlab.train.checks  # noqa: F401  (registers every config check validate runs)
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel import DataParallel, DistributedDataParallel
from shardlab.train.images import ImageData, ImageLoader


def make_cfg(steps: int) -> Config:
    cfg = Config()
    cfg.model.arch, cfg.model.d_model, cfg.model.dropout, cfg.data.dataset = "cnn", 128, 0.0, "fashion-mnist"
    cfg.train.global_batch, cfg.train.lr, cfg.train.steps = 64, 1e-3, steps
    return cfg.validate()


def train(model, loss_fn, loader, steps: int, lr: float):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        (x, y), = loader.next_batch()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, (time.perf_counter() - t0) / steps


def ddp_worker(ctx, cfg: Config):
    t = cfg.train
    model = DistributedDataParallel(build_model(cfg.model, t.seed), device_ids=None)
    loader = ImageLoader(ImageData(limit_test=1), t.global_batch, 1, ctx.rank, ctx.world_size, t.seed)
    losses, step_s = train(model, lambda m, x, y: m(x, y), loader, t.steps, t.lr)
    out = []
    for loss in losses:  # the global loss: mean of the ranks' equal-size shard losses
        v = loss.detach().clone()
        torch.distributed.all_reduce(v)
        out.append(float(v) / ctx.world_size)
    return out, step_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="DDP ranks = DataParallel replicas")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    cfg = make_cfg(args.steps)
    t = cfg.train
    torch.set_num_threads(max(1, torch.get_num_threads()))
    legacy = DataParallel(build_model(cfg.model, t.seed), device_ids=["cpu"] * args.nproc)
    loader = ImageLoader(ImageData(limit_test=1), t.global_batch, 1, 0, 1, t.seed)
    dp_losses, dp_s = train(legacy, lambda m, x, y: m(x, y).mean(), loader, t.steps, t.lr)
    dp_losses = [float(v) for v in dp_losses]
    ddp_losses, ddp_s = run(ddp_worker, args.nproc, cfg, timeout_s=120)[0]
    diff = max(abs(a - b) for a, b in zip(dp_losses, ddp_losses))
    print(f"{'step':>5} {'DataParallel':>13} {'DDP':>10}")
    for i in sorted({0, args.steps // 2, args.steps - 1}):
        print(f"{i:>5} {dp_losses[i]:>13.5f} {ddp_losses[i]:>10.5f}")
    print(f"time per step: DataParallel {dp_s * 1e3:.0f} ms (1 process, {args.nproc} replicas)   "
          f"DDP {ddp_s * 1e3:.0f} ms ({args.nproc} processes)")
    print(f"result: max |loss difference| {diff:.2e} over {args.steps} steps")


if __name__ == "__main__":
    main()
