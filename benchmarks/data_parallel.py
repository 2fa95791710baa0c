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
from shardlab.models import build_model, count_params, get_spec
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


def _timed(step_fn, cfg, rank, s) -> float:
    return time_step(step_fn, *_batch(cfg, rank, s))


def time_step(step_fn, x, y) -> float:
    """Seconds of one ``step_fn(x, y)`` on the slowest rank (barrier before, max after)."""
    dist.barrier()
    t0 = time.perf_counter()
    step_fn(x, y)
    t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return float(t)


# -- the contenders: each returns (step function, extra measurements or None) ---------------------
def own(cfg):
    # gloo, as every contender here: the comparison is of engines, not of transports (shardlab's
    # default on one CPU host is its shared-memory transport: docs/collectives.md)
    mesh = Mesh.build(Topology.from_config(cfg.parallel), transport="process_group")
    engine = parallelize(build_model(cfg.model, 0), mesh, cfg)
    opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=LR))

    def step(x, y):
        engine.forward_backward([(x, y)])
        engine.clip_grads(cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()

    def extra(rank):  # one more step, counted by the ledger (the grad-norm all-reduce excluded)
        snap = mesh.ledger.snapshot()
        step(*_batch(cfg, rank, 99))
        sent = sum(e.bytes_sent for (op, group), e in mesh.ledger.since(snap).items() if group != "world")
        return sent, getattr(engine, "peak_gathered_bytes", 0)
    return step, extra


def _plain_step(model, opt, cfg):
    def step(x, y):
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    return step


def torch_ddp(cfg):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(build_model(cfg.model, 0))
    return _plain_step(model, torch.optim.AdamW(model.parameters(), lr=LR), cfg), None


def torch_fsdp2(cfg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(cfg.model, 0)
    for block in get_spec(cfg.model).blocks(model).values():  # the architecture's blocks, as own FSDP
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _plain_step(model, torch.optim.AdamW(model.parameters(), lr=LR), cfg), None


def deepspeed_stage(cfg):
    import deepspeed
    ds_cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": cfg.parallel.zero_stage}, "gradient_clipping": cfg.train.grad_clip,
              "steps_per_print": 10**9}
    plain = torch.nn.functional.linear
    engine, *_ = deepspeed.initialize(model=build_model(cfg.model, 0), config=ds_cfg)
    # ZeRO-3 swaps in its memory-efficient F.linear process-wide: give it to DeepSpeed's own
    # steps only, so the other contenders run with the plain one.
    ds_linear, torch.nn.functional.linear = torch.nn.functional.linear, plain

    def step(x, y):
        torch.nn.functional.linear = ds_linear
        try:
            engine.backward(engine(x, y))
            engine.step()
        finally:
            torch.nn.functional.linear = plain
    return step, None


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


def _plan(with_ds: bool):
    """Comparison groups; the contenders of a group are built together and timed in turns
    (A, B, A, B, ...) so that the load of the shared machine hits them alike."""
    ds = [("DeepSpeed", deepspeed_stage)] if with_ds else []
    groups = [("DDP", dict(zero_stage=0), [("own", own), ("torch DDP", torch_ddp)])]
    for z in (1, 2):  # DeepSpeed last in every group
        groups.append((f"ZeRO-{z}", dict(zero_stage=z), [("own", own)] + ds))
    groups.append(("ZeRO-3", dict(zero_stage=3), [("own", own), ("torch FSDP2", torch_fsdp2)] + ds))
    variants = [(f"prefetch={'on' if pf else 'off'}, reshard={'on' if rs else 'off'}",
                 dict(zero_stage=3, prefetch=pf, reshard_after_forward=rs))
                for pf in (True, False) for rs in (True, False)]
    groups.append(("ZeRO-3 options", None, [(name, own, par) for name, par in variants]))
    return groups


def _bench(ctx, n, warmup, steps, with_ds, only=None):
    if with_ds:  # DeepSpeed reads its launch contract from the environment
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_RANK"] = str(ctx.rank)
    rows, linear = [], torch.nn.functional.linear
    for group, par, contenders in _plan(with_ds):
        if only and group not in only:
            continue
        built = []
        for c in contenders:
            name, fn = c[0], c[1]
            cfg = make_cfg(n, **(c[2] if par is None else par))
            built.append((name, cfg, *fn(cfg)))
        times = {name: [] for name, *_ in built}
        for s in range(warmup + steps):
            for name, cfg, step, _ in built[s % len(built):] + built[:s % len(built)]:  # rotate who goes first
                t = _timed(step, cfg, ctx.rank, s)
                if s >= warmup:
                    times[name].append(t)
        for name, cfg, step, extra in built:
            sent, peak = extra(ctx.rank) if extra else (None, None)
            rows.append((group, name, vars(cfg.parallel).copy(), statistics.median(times[name]), sent, peak))
    if torch.nn.functional.linear is not linear:  # would make the comparison unfair: say so
        print("warning: F.linear was patched during the run (DeepSpeed ZeRO-3 memory-efficient linear)")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="comparison groups to run, e.g. DDP ZeRO-3")
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
        rows = run(_bench, n, n, args.warmup, args.steps, with_ds, args.only, threads=1, timeout_s=900)[0]
        print(f"\n### N = {n}\n")
        print("| comparison | implementation | step ms (median) | own / other | ledger MB/step | theory MB/step | peak gathered MB |")
        print("|---|---|---:|---:|---:|---:|---:|")
        first = {}
        for group, who, par, t, sent, peak in rows:
            first.setdefault(group, (who, t))
        for group, who, par, t, sent, peak in rows:
            cfg = make_cfg(n, **{k: par[k] for k in ("zero_stage", "prefetch", "reshard_after_forward")})
            base_who, base_t = first[group]
            if group == "ZeRO-3 options":
                ratio = f"{t / base_t:.2f}x first row"
            elif who == "own":
                ratio = ", ".join(f"{t / v:.2f}x {w}" for g, w, _, v, *_ in rows if g == group and w != "own")
            else:
                ratio = ""
            th = f"{theory_bytes(cfg, psi, psi_root) / 1e6:.2f}" if sent is not None else ""
            led = f"{sent / 1e6:.2f}" if sent is not None else ""
            pk = f"{peak / 1e6:.2f}" if peak else ""
            print(f"| {group} | {who} | {1000 * t:.0f} | {ratio} | {led} | {th} | {pk} |")


if __name__ == "__main__":
    main()
