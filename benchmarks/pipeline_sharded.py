"""Pipeline x data-parallel sharding: DDP vs ZeRO-1 vs ZeRO-3 inside the stages, CPU gloo.

    PYTHONPATH=. python benchmarks/pipeline_sharded.py [--steps 6] [--microbatches 4 8]

pp = 2 x dp_shard = 2 (4 ranks), 1F1B, fp32, one thread per rank, through ``parallelize`` from a
meta model, AdamW. Printed per layout: bytes each rank sends per step over the data-parallel
group and over pp (ledger; identical every step), model-state bytes a rank holds between steps
(parameters + gradients + optimizer states, rank 0) and during the step (adds the gathered
parameters and full gradients), and the median / fastest step time (forward, backward,
optimizer) of the slowest rank. Every engine is built first and the steps go round-robin over
them, so load from other processes hits all alike.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab.config import Config  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check validate runs)
from shardlab.distributed.mesh import Mesh  # noqa: E402
from shardlab.distributed.topology import Topology  # noqa: E402
from shardlab.launch import run  # noqa: E402
from shardlab.models.spec import meta_model  # noqa: E402

LAYOUTS = [("DDP (zero 0)", 0), ("ZeRO-1", 1), ("ZeRO-3 / FSDP", 3)]


def make_cfg(zero: int, m: int) -> Config:
    cfg = Config()
    md = cfg.model
    md.vocab_size, md.d_model, md.n_layers, md.n_heads, md.max_seq_len, md.tie_embeddings = 512, 128, 8, 4, 64, False
    p = cfg.parallel
    p.pp, p.dp_shard, p.microbatches, p.zero_stage, p.pp_schedule = 2, 2, m, zero, "1f1b"
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.precision = 64, 2 * 2 * m, "fp32"
    return cfg


def state_bytes(engine, opt) -> tuple[int, int]:
    """(between steps, during a step) bytes of parameters + gradients + optimizer states."""
    opt_b = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    if not hasattr(engine, "flats"):  # DDP: everything whole all the time
        full = sum(p.numel() * p.element_size() for p in engine.parameters())
        return 2 * full + opt_b, 2 * full + opt_b
    shard = sum(f.shard.numel() * f.shard.element_size() for f in engine.flats)  # slice; its grad the same
    full = sum(f.padded * f.shard.element_size() for f in engine.flats)
    if engine.stage == 3:  # separate fp32 slice; the gathered buffer only during the step
        return 2 * shard + opt_b, 2 * full + 2 * shard + opt_b
    return full + shard + opt_b, 2 * full + shard + opt_b  # the slice aliases the whole parameters


def _worker(ctx, ms, steps):
    from shardlab.parallelize import parallelize
    torch.set_num_threads(1)
    mesh = Mesh.build(Topology(pp=2, dp_shard=2))
    runs = []
    for m in ms:
        for label, zero in LAYOUTS:
            cfg = make_cfg(zero, m)
            cfg.validate(ctx.world_size)
            engine = parallelize(meta_model(cfg.model, torch.float32), mesh, cfg)
            opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=1e-3))
            runs.append(dict(label=label, m=m, engine=engine, opt=opt, cfg=cfg, times=[], sent={}))
    g = torch.Generator().manual_seed(0)
    for step in range(steps + 1):
        for r in runs:
            cfg, m = r["cfg"], r["m"]
            tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch // 2, cfg.train.seq_len + 1),
                                   generator=g)
            x, y = tokens[:, :-1], tokens[:, 1:]
            mbs = list(zip(x.chunk(m), y.chunk(m)))
            snap = mesh.ledger.snapshot()
            mesh.comm("world").barrier()
            t0 = time.perf_counter()
            r["engine"].forward_backward(mbs)
            r["opt"].step()
            r["opt"].zero_grad()
            dt = torch.tensor([time.perf_counter() - t0])
            mesh.comm("world").all_reduce(dt, op="max")
            if step:  # the first step warms up (and lets Adam allocate its states)
                r["times"].append(float(dt))
                r["sent"] = {g: sum(e.bytes_sent for (op, grp), e in mesh.ledger.since(snap).items() if grp == g)
                             for g in ("pp", "dp_cp", "dp_shard_cp")}
    return [dict(label=r["label"], m=r["m"], times=r["times"], sent=r["sent"],
                 state=state_bytes(r["engine"], r["opt"])) for r in runs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args()
    out = run(_worker, 4, args.microbatches, args.steps, timeout_s=600)
    print(f"pp=2 x dp_shard=2, 1F1B, 8 layers d_model 128 seq 64 micro-batch 2, fp32, AdamW, {args.steps} steps")
    print("| layout | m | dp bytes sent/step (rank 0) | pp bytes sent/step (rank 0) | "
          "model state MiB between steps (rank 0) | during the step | step ms median | fastest |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out[0]:
        dp = r["sent"]["dp_cp"] + r["sent"]["dp_shard_cp"]
        between, during = r["state"]
        print(f"| {r['label']} | {r['m']} | {dp:,} | {r['sent']['pp']:,} | {between / 2**20:.2f} | "
              f"{during / 2**20:.2f} | {1e3 * statistics.median(r['times']):.1f} | {1e3 * min(r['times']):.1f} |")


if __name__ == "__main__":
    main()
