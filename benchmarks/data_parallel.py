"""Data parallel, side by side in one run: own DDP vs torch DDP, own ZeRO-3 vs FSDP2
``fully_shard``, own ZeRO-1/2/3 vs DeepSpeed stages 1/2/3; ledger bytes/step vs theory; ZeRO-3
with prefetch and reshard_after_forward on/off (step time, peak gathered parameters).

    python benchmarks/data_parallel.py --nproc 2 4 [--steps 5] [--no-deepspeed]

CPU gloo, fp32, a ~3.3M-parameter Llama (d_model 256, 4 layers, vocab 256), micro-batch 2 x 64
tokens per rank, gradient clipping 1.0, AdamW. Each rank runs one thread. Step time: median over
the timed steps of the slowest rank, after warm-up; configurations of one comparison run back
to back in the same processes. DeepSpeed: ``DS_BUILD_OPS=0 pip install deepspeed``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from shardlab.config import Config
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models.llama import build_model, count_params
from shardlab.parallelize import parallelize

MICRO, SEQ, LR = 2, 64, 1e-3


def make_cfg(n: int, **parallel) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len = 256, 256, 4, 8, SEQ
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.grad_clip = SEQ, MICRO * n, 1.0
    cfg.parallel.dp_shard = n
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _batch(cfg, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tok = torch.randint(0, cfg.model.vocab_size, (MICRO, SEQ + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _time(step_fn, cfg, rank, warmup, steps):
    times = []
    for s in range(warmup + steps):
        x, y = _batch(cfg, rank, s)
        dist.barrier()
        t0 = time.perf_counter()
        step_fn(x, y)
        t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if s >= warmup:
            times.append(float(t))
    return statistics.median(times)


# -- the contenders -----------------------------------------------------------------------------
def own(cfg, rank, warmup, steps):
    mesh = Mesh.build(Topology.from_config(cfg.parallel))
    engine = parallelize(build_model(cfg.model, 0), mesh, cfg)
    opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=LR))

    def step(x, y):
        engine.forward_backward([(x, y)])
        engine.clip_grads(cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()

    t = _time(step, cfg, rank, warmup, 0)  # warm-up, then one step measured in the ledger
    snap = mesh.ledger.snapshot()
    step(*_batch(cfg, rank, 99))
    sent = sum(e.bytes_sent for (op, group), e in mesh.ledger.since(snap).items() if group != "world")
    t = _time(step, cfg, rank, 0, steps)
    return t, sent, getattr(engine, "peak_gathered_bytes", 0)


def _torch_opt(params):
    return torch.optim.AdamW(params, lr=LR)


def torch_ddp(cfg, rank, warmup, steps):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(build_model(cfg.model, 0))
    opt = _torch_opt(model.parameters())

    def step(x, y):
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    return _time(step, cfg, rank, warmup, steps), None, None


def torch_fsdp2(cfg, rank, warmup, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(cfg.model, 0)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _torch_opt(model.parameters())

    def step(x, y):
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    return _time(step, cfg, rank, warmup, steps), None, None


def deepspeed_stage(cfg, rank, warmup, steps):
    import deepspeed
    ds_cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": cfg.parallel.zero_stage}, "gradient_clipping": cfg.train.grad_clip,
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=build_model(cfg.model, 0), config=ds_cfg)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return _time(step, cfg, rank, warmup, steps), None, None


def theory_bytes(cfg, psi: int, psi_root: int) -> float:
    """Ring bytes one rank sends per step (fp32 gradients/params, one micro-batch)."""
    n, z = cfg.parallel.dp_shard, cfg.parallel.zero_stage
    unit = 4 * (n - 1) / n
    if z == 0:
        return 2 * psi * unit                       # all-reduce
    if z in (1, 2):
        return 2 * psi * unit                       # reduce-scatter + all-gather
    regather = psi - psi_root if cfg.parallel.reshard_after_forward else 0
    return (2 * psi + regather) * unit              # AG fwd + AG bwd (blocks) + RS


def _bench(ctx, n, warmup, steps, with_ds):
    if with_ds:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = []
    plan = [("DDP", "own", own, dict(zero_stage=0)), ("DDP", "torch DDP", torch_ddp, dict(zero_stage=0)),
            ("ZeRO-3", "own", own, dict(zero_stage=3)), ("ZeRO-3", "torch FSDP2", torch_fsdp2, dict(zero_stage=3))]
    for z in (1, 2, 3):
        plan.append((f"ZeRO-{z}", "own", own, dict(zero_stage=z)))
        if with_ds:
            plan.append((f"ZeRO-{z}", "DeepSpeed", deepspeed_stage, dict(zero_stage=z)))
    for pf in (True, False):
        for rs in (True, False):
            plan.append(("ZeRO-3 variants", f"prefetch={pf} reshard={rs}", own,
                         dict(zero_stage=3, prefetch=pf, reshard_after_forward=rs)))
    for group, who, fn, par in plan:
        cfg = make_cfg(n, **par)
        t, sent, peak = fn(cfg, ctx.rank, warmup, steps)
        rows.append((group, who, par, t, sent, peak))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    with_ds = not args.no_deepspeed
    if with_ds:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("deepspeed not installed (DS_BUILD_OPS=0 pip install deepspeed): skipping it")
            with_ds = False
    cfg0 = make_cfg(1)
    model = build_model(cfg0.model, 0)
    psi = count_params(model)
    psi_root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    print(f"model: {psi:,} parameters (root unit {psi_root:,}); micro-batch {MICRO} x {SEQ} per rank; fp32")
    for n in args.nproc:
        rows = run(_bench, n, n, args.warmup, args.steps, with_ds, threads=1, timeout_s=600)[0]
        print(f"\n### N = {n}\n")
        print("| comparison | implementation | step ms | vs reference | ledger MB/step | theory MB/step | peak gathered MB |")
        print("|---|---|---:|---:|---:|---:|---:|")
        ref = {}
        for group, who, par, t, sent, peak in rows:
            if who != "own" and group != "ZeRO-3 variants":
                ref[(group, who)] = t
        for group, who, par, t, sent, peak in rows:
            cfg = make_cfg(n, **par)
            ratio = ""
            if who == "own":
                others = [(w, v) for (g, w), v in ref.items() if g == group]
                ratio = ", ".join(f"{t / v:.2f}x {w}" for w, v in others)
            elif group == "ZeRO-3 variants":
                ratio = f"{t / rows[-4][3]:.2f}x default"
            th = f"{theory_bytes(cfg, psi, psi_root) / 1e6:.2f}" if sent is not None else ""
            led = f"{sent / 1e6:.2f}" if sent is not None else ""
            pk = f"{peak / 1e6:.2f}" if peak else ""
            print(f"| {group} | {who} | {1000 * t:.0f} | {ratio} | {led} | {th} | {pk} |")


if __name__ == "__main__":
    main()
