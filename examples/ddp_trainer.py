"""The PyTorch DDP tutorial trainer (multigpu_torchrun.py), on shardlab.initialize.

    shardlab launch --nproc 2 examples/ddp_trainer.py --epochs 3 --save-every 1
    (or: torchrun --nproc_per_node 2 examples/ddp_trainer.py ...)

What changed from the tutorial: ``DDP(model, device_ids=[...])`` + ``optimizer`` become
``shardlab.initialize(model, config)``; ``loss.backward(); optimizer.step()`` become
``engine.backward(loss); engine.step()``; the snapshot is a sharded checkpoint
(``engine.save_checkpoint`` / ``engine.load_checkpoint``: model, optimizer, step count, RNG), so
a run killed mid-way resumes where the last snapshot left it when started again.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import shardlab


class MyTrainDataset(Dataset):
    """A toy regression set: y = a fixed linear function of x plus noise."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 20, generator=g)
        w = torch.randn(20, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Trainer:
    def __init__(self, engine, train_data: DataLoader, save_every: int, snapshot_dir: str):
        self.engine = engine
        self.train_data = train_data
        self.save_every = save_every
        self.snapshot_dir = snapshot_dir
        self.epochs_run = 0
        self._load_snapshot()

    def _load_snapshot(self):
        path, _ = self.engine.load_checkpoint(self.snapshot_dir)  # (path, client_state), as DeepSpeed's
        if path is not None:
            self.epochs_run = self.engine.global_steps // len(self.train_data)
            if self.engine.global_rank == 0:
                print(f"Resuming training from snapshot {path} at epoch {self.epochs_run}")

    def _run_batch(self, source, targets) -> float:
        output = self.engine(source)
        loss = F.mse_loss(output, targets)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> float:
        self.train_data.sampler.set_epoch(epoch)
        total = 0.0
        for source, targets in self.train_data:
            total += self._run_batch(source.to(self.engine.device), targets.to(self.engine.device))
        return total / len(self.train_data)

    def _save_snapshot(self, epoch: int):
        path = self.engine.save_checkpoint(self.snapshot_dir)
        if self.engine.global_rank == 0:
            print(f"Epoch {epoch} | Training snapshot saved at {path}")

    def train(self, max_epochs: int) -> float:
        loss = float("nan")
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if self.engine.global_rank == 0:
                print(f"[GPU{self.engine.global_rank}] Epoch {epoch} | Batches {len(self.train_data)} | loss {loss:.4f}")
            if (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)
        return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--size", type=int, default=2048, help="dataset size")
    ap.add_argument("--snapshot-dir", default="runs/ddp_trainer/snapshots")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = {"parallel": {"zero_stage": 0},
              "train": {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 0,
                        "min_lr_ratio": 1.0, "device": "cpu"}}
    engine = shardlab.initialize(model, config)
    data = MyTrainDataset(args.size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False,
                        sampler=DistributedSampler(data, engine.world_size, engine.global_rank))
    loss = Trainer(engine, loader, args.save_every, args.snapshot_dir).train(args.epochs)
    if engine.global_rank == 0:
        print(f"final loss {loss:.4f} (world size {engine.world_size})")


if __name__ == "__main__":
    main()
