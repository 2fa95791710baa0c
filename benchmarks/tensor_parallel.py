"""Tensor parallel: shardlab vs PyTorch DTensor (``parallelize_module`` with ColwiseParallel /
RowwiseParallel, SequenceParallel and loss_parallel), same model, same batch, CPU gloo.

    PYTHONPATH=. python benchmarks/tensor_parallel.py [--nproc 2 4] [--steps 8]

For each N and with/without sequence parallel, both implementations run forward + backward
(no optimizer) on the same global batch, interleaved step by step so that machine noise hits
both alike. Reported: median step time over ranks' max, the ratio shardlab / DTensor, the
step-0 losses (they must agree), and the activation memory per rank: bytes of the distinct
non-parameter tensors autograd saves for backward during one forward (saved-tensor hooks;
CPU has no allocator peak counter).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from shardlab import launch
from shardlab.config import Config, ModelConfig
import shardlab.train.checks  # noqa: F401  (registers every config check validate runs)
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.models import build_model, get_spec
from shardlab.parallel import tensor


def make_cfg(n: int, sp: bool) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8, max_seq_len=128)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = n, sp
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed = 128, 4, 0
    return cfg.validate(n)


def dtensor_model(cfg: Config, device_mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    model = build_model(cfg.model, cfg.train.seed)
    sp = cfg.parallel.sequence_parallel
    act = Shard(1) if sp else Replicate()          # layout of the activations between blocks
    parallelize_module(model, device_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
    } if sp else {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        plan = {
            # one input conversion per attention / MLP so the gradient is reduced once
            "attention": PrepareModuleInput(input_layouts=(act, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, device_mesh, plan)
    return model


class SavedBytes:
    """Bytes of distinct non-parameter storages saved for backward (activation memory)."""

    def __init__(self, model):
        self.params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t):
        s = _local(t).untyped_storage()
        if s.data_ptr() not in self.params:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _local(t):
    """The plain tensor under DTensor / AsyncCollectiveTensor wrappers."""
    for attr in ("_local_tensor", "elem"):
        if hasattr(t, attr):
            return _local(getattr(t, attr))
    return t


def _worker(ctx, sp: bool, steps: int, warmup: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    n = ctx.world_size
    cfg = make_cfg(n, sp)
    mesh = Mesh.build(Topology(tp=n), transport="process_group")  # gloo, as DTensor's: engines compared, not transports
    ours = tensor.apply(build_model(cfg.model, cfg.train.seed), mesh, cfg, get_spec(cfg.model).tp_plan)
    theirs = dtensor_model(cfg, init_device_mesh("cpu", (n,)))
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1), generator=g)
    x, y = tok[:, :-1], tok[:, 1:]

    def step(model, dt, meter=None):
        model.zero_grad(set_to_none=True)
        with (meter.hooks() if meter else _Null()), (loss_parallel() if dt else _Null()):
            loss = model(x, y)
            loss.backward()
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    times = {"shardlab": [], "dtensor": []}
    losses, mem = {}, {}
    for name, model in (("shardlab", ours), ("dtensor", theirs)):
        meter = SavedBytes(model)
        losses[name] = step(model, name == "dtensor", meter)
        mem[name] = sum(meter.seen.values())
    for i in range(warmup + steps):
        for name, model in (("shardlab", ours), ("dtensor", theirs)):
            dist.barrier()
            t0 = time.perf_counter()
            step(model, name == "dtensor")
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)   # a step ends when the slowest rank ends
            if i >= warmup:
                times[name].append(float(dt))
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "loss": losses, "mem": mem}


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    c = make_cfg(2, False).model
    print(f"model: d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, vocab {c.vocab_size}, "
          f"batch 4 x seq 128, fp32, forward+backward, median of {args.steps} steps (max over ranks)")
    print("| N | SP | shardlab ms | DTensor ms | ratio | loss shardlab | loss DTensor "
          "| act. MiB/rank shardlab | act. MiB/rank DTensor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.nproc:
        for sp in (False, True):
            r = launch.run(_worker, n, sp, args.steps, args.warmup, timeout_s=600)[0]
            t, lo, m = r["times"], r["loss"], r["mem"]
            print(f"| {n} | {'on' if sp else 'off'} | {t['shardlab'] * 1e3:.1f} | {t['dtensor'] * 1e3:.1f} | "
                  f"{t['shardlab'] / t['dtensor']:.3f} | {lo['shardlab']:.6f} | {lo['dtensor']:.6f} | "
                  f"{m['shardlab'] / 2**20:.2f} | {m['dtensor'] / 2**20:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
