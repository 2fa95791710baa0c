"""A plain-PyTorch CNN training script (the MNIST example's CNN) converted to shardlab.initialize
with a DeepSpeed JSON (examples/ds_config.json: ZeRO-2, bf16, gradient_accumulation_steps 2).

    shardlab launch --nproc 2 examples/deepspeed_cnn.py --config examples/ds_config.json
    shardlab launch --nproc 2 examples/deepspeed_cnn.py --synthetic --steps 5     # no download

The conversion, line for line (docs/api.md has the three loops side by side):

    model = Net().to(device)                         model = Net()
    opt = torch.optim.AdamW(model.parameters())      engine = shardlab.initialize(model, config="ds_config.json")
    out = model(x)                                   out = engine(x)
    loss.backward(); opt.step(); opt.zero_grad()     engine.backward(loss); engine.step()

Data: Fashion-MNIST through ``shardlab.train.images.fashion_mnist(split, limit)`` (uint8 images
(N, 28, 28), int64 labels), or random images with ``--synthetic``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import shardlab


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


def load(split: str, limit: int, synthetic: bool):
    """(images float (N, 1, 28, 28) normalised, labels int64 (N,))."""
    if synthetic:
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        images = torch.randint(0, 256, (limit, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, 10, (limit,), generator=g)
    else:
        from shardlab.train.images import fashion_mnist
        images, labels = fashion_mnist(split, limit=limit)
    return (images.float().unsqueeze(1) / 255.0 - 0.2860) / 0.3530, labels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).with_name("ds_config.json")))
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--train-limit", type=int, default=8192)
    ap.add_argument("--test-limit", type=int, default=1000)
    ap.add_argument("--synthetic", action="store_true", help="random images instead of Fashion-MNIST")
    args = ap.parse_args()
    torch.manual_seed(0)
    engine = shardlab.initialize(Net(), config=args.config)
    mb, ga = engine.train_micro_batch_size_per_gpu(), engine.accumulation
    x, y = load("train", args.train_limit, args.synthetic)
    per_step = mb * ga * engine.world_size
    g = torch.Generator().manual_seed(1234)  # the same order on every rank; each takes its rows
    order = torch.randperm(len(x), generator=g)
    t0, loss = time.perf_counter(), torch.zeros(())
    engine.train()
    for step in range(args.steps):
        start = (step * per_step) % max(1, len(x) - per_step + 1)
        rows = order[start:start + per_step][engine.global_rank::engine.world_size]
        for m in range(ga):
            idx = rows[m * mb:(m + 1) * mb]
            out = engine(x[idx].to(engine.device))
            loss = F.cross_entropy(out.float(), y[idx].to(engine.device))
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}", flush=True)
    engine.eval()
    tx, ty = load("test", args.test_limit, args.synthetic)
    with torch.no_grad():
        correct = sum(int((engine(tx[i:i + 256].to(engine.device)).argmax(1).cpu() == ty[i:i + 256]).sum())
                      for i in range(0, len(tx), 256))
    if engine.global_rank == 0:
        print(f"test accuracy {correct / len(tx):.3f} after {args.steps} steps "
              f"({engine.world_size} ranks, {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
