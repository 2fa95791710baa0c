"""ZeRO-3 / FSDP on the CNN of PyTorch's MNIST example with an auto-wrap policy, on Fashion-MNIST.

    PYTHONPATH=. python examples/fsdp_cnn.py --nproc 2 --steps 60 --policy class:Conv2d,Linear

Every rank keeps 1/N of each unit's flat parameters, gradients and Adam states; the policy
(``blocks``, ``size:<N>`` or ``class:<Name>[,<Name>]``, as ``parallel.wrap_policy``) chooses the
units. Prints the units, the loss, the parameter bytes per rank and the test accuracy.
"""
from __future__ import annotations

import argparse
import time

import torch

from shardlab.config import Config
import shardlab.train.checks  # noqa: F401  (registers every config check validate runs)
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import meta_model
from shardlab.parallelize import parallelize
from shardlab.train.images import ImageData, ImageLoader, accuracy


def make_cfg(nproc: int, policy: str, steps: int) -> Config:
    cfg = Config()
    cfg.model.arch, cfg.model.d_model, cfg.model.dropout, cfg.data.dataset = "cnn", 128, 0.25, "fashion-mnist"
    cfg.parallel.dp_shard, cfg.parallel.zero_stage, cfg.parallel.wrap_policy = nproc, 3, policy
    cfg.train.global_batch, cfg.train.lr, cfg.train.steps = 64, 1e-3, steps
    return cfg.validate(nproc)


def worker(ctx, cfg: Config, limit_test: int):
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    engine = parallelize(meta_model(cfg.model), mesh, cfg)  # each rank materialises only its shards
    t = cfg.train
    opt = engine.make_optimizer(lambda g: torch.optim.AdamW(g, lr=t.lr))
    loader = ImageLoader(ImageData(limit_test=limit_test), t.global_batch, 1, mesh.rank, mesh.world_size, t.seed)
    t0, losses = time.perf_counter(), []
    for _ in range(t.steps):
        local = engine.forward_backward(loader.next_batch())
        opt.step()
        opt.zero_grad()
        losses.append(engine.global_loss(local))
    elapsed = time.perf_counter() - t0
    acc = accuracy(engine, loader)
    shard_bytes = sum(p.numel() * p.element_size() for p in engine.parameters())
    return {"units": [u.name or "<root>" for u in engine.units], "first_loss": losses[0], "last_loss": losses[-1],
            "accuracy": acc, "shard_bytes": shard_bytes, "step_s": elapsed / t.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--policy", default="class:Conv2d,Linear", help="blocks | size:<N> | class:<Name>[,<Name>]")
    ap.add_argument("--limit-test", type=int, default=2000, help="test images for the accuracy (0 = all 10,000)")
    args = ap.parse_args()
    cfg = make_cfg(args.nproc, args.policy, args.steps)
    r = run(worker, args.nproc, cfg, args.limit_test, timeout_s=120)[0]
    full = sum(p.numel() for p in meta_model(cfg.model).parameters()) * 4
    print(f"FSDP units ({args.policy}): {', '.join(r['units'])}")
    print(f"parameter bytes per rank: {r['shard_bytes']:,} of {full:,} ({r['shard_bytes'] / full:.2f}x)")
    print(f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} in {args.steps} steps ({r['step_s'] * 1e3:.0f} ms/step)")
    print(f"result: test accuracy {100 * r['accuracy']:.2f}% on {args.limit_test or 10000} test images")


if __name__ == "__main__":
    main()
