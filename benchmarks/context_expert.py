"""Context and expert parallel, measured side by side (CPU gloo by default; --device cuda puts
all ranks' tensors on one GPU, gloo transport).

1. Activation memory per rank of a tiny Llama at a long sequence for cp = 1, 2, 4: the bytes
   autograd saves for backward (unique storages, parameters excluded; exact) and, on CUDA, the
   peak allocated memory of the forward+backward above the model's.
2. Ring attention: time of forward+backward, seconds blocked waiting on the ring (exposed
   communication), the same transfers alone (no compute), hidden fraction = 1 - exposed/alone.
3. MoE layer under ep = 1, 2, 4: forward all-to-all dispatch + combine time vs expert compute.

    PYTHONPATH=. python benchmarks/context_expert.py [--seq 8192] [--device cpu]

Numbers on the shared 2-core machines are noisy (other jobs run beside them); ratios within
one run are the meaningful part.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardlab.config import ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models.llama import build_model
from shardlab.models.moe import MoE
from shardlab.parallel import context, expert


def activation_bytes(model, fn) -> int:
    """Bytes of the unique non-parameter storages autograd saves while ``fn()`` runs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(saved.values()), out


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def memory(mesh, seq, dev):
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=seq)
    model = context.apply(build_model(cfg, seed=0, device=dev), mesh)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (1, seq + 1), generator=g)
    comm = mesh.comm("cp")
    x = context.shard_sequence(data[:, :-1], comm.rank, comm.size).to(dev)
    y = context.shard_sequence(data[:, 1:], comm.rank, comm.size).to(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    nbytes, loss = activation_bytes(model, lambda: model(x, y))
    loss.backward()
    _sync(dev)
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else None
    return {"saved_MiB": nbytes / 2**20, "peak_MiB": None if peak is None else peak / 2**20}


def ring(mesh, seq, dev, iters=3):
    comm = mesh.comm("cp")
    cp, r = comm.size, comm.rank
    B, H, D = 1, 4, 32
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (context.shard_sequence(torch.randn(B, H, seq, D, generator=g), r, cp, dim=2).to(dev)
                   for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    totals, waits, alone = [], [], []
    for it in range(iters + 1):
        stats: dict = {}
        comm.barrier()
        t0 = time.perf_counter()
        context.ring_attention(q, k, v, comm, True, stats).backward(do)
        _sync(dev)
        t1 = time.perf_counter()
        comm.barrier()
        # the same transfers with no compute: fwd (cp-1) K/V blocks, bwd (cp-1) K/V + cp dK/dV
        kv = torch.stack([k.detach(), v.detach()]).contiguous()
        t2 = time.perf_counter()
        for tag, n in ((0, 2 * (cp - 1)), (1, cp)):
            for _ in range(n):
                buf = torch.empty_like(kv)
                for req in (comm.isend(kv, (r + 1) % cp, tag), comm.irecv(buf, (r - 1) % cp, tag)):
                    req.wait()
        _sync(dev)
        t3 = time.perf_counter()
        if it:  # first iteration is warm-up
            totals.append(t1 - t0)
            waits.append(stats["wait_s"])
            alone.append(t3 - t2)
    tot, wait, comm_s = (statistics.median(v) for v in (totals, waits, alone))
    return {"fwd_bwd_s": tot, "exposed_comm_s": wait, "comm_alone_s": comm_s,
            "hidden_fraction": max(0.0, 1 - wait / comm_s)}


def moe(mesh, dev, tokens=2048, iters=3):
    cfg = ModelConfig(d_model=256, ffn_hidden=512, n_experts=8, moe_top_k=2, n_layers=2, n_heads=4)
    ref = MoE(cfg).to(dev)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    layer = expert.ExpertParallelMoE(ref, mesh, cfg, "layers.0.feed_forward")
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(mesh.rank)).to(dev)
    if mesh.size("ep") == 1:  # no all-to-all: time the expert compute alone
        times = []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            layer(x)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        return {"a2a_ms": 0.0, "experts_ms": 1e3 * statistics.median(times[1:]), "a2a_MiB": 0.0}
    for it in range(iters + 1):
        if it == 1:
            layer.timing = {k: 0.0 for k in layer.timing}
            snap = mesh.ledger.snapshot()
        mesh.comm("ep").barrier()
        layer(x)
    tm, n = layer.timing, layer.timing["calls"]
    sent = sum(e.bytes_sent for (op, grp), e in mesh.ledger.since(snap).items() if op == "all_to_all")
    return {"a2a_ms": 1e3 * (tm["dispatch_s"] + tm["combine_s"]) / n, "experts_ms": 1e3 * tm["experts_s"] / n,
            "a2a_MiB": sent / n / 2**20}


def worker(ctx, n, seq, device):
    dev = torch.device(device)
    out = {}
    mesh = Mesh.build(Topology(cp=n)) if n > 1 else Mesh.single(dev)
    out["memory"] = memory(mesh, seq, dev)
    if n > 1:
        out["ring"] = ring(mesh, seq, dev)
    ep_mesh = Mesh.build(Topology(dp_shard=n, ep=n)) if n > 1 else mesh
    out["moe"] = moe(ep_mesh, dev)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    res = {}
    for n in args.sizes:
        per_rank = run(worker, n, n, args.seq, args.device, timeout_s=600)
        res[n] = per_rank
    base = max(r["memory"]["saved_MiB"] for r in res[args.sizes[0]])
    print(f"\nActivation memory per rank, tiny Llama (d 64, 2 layers, 4 heads), seq {args.seq}, batch 1, "
          f"fp32, device {args.device}")
    print("| cp | saved for backward, max over ranks (MiB) | vs cp=1 | peak alloc fwd+bwd (MiB) |")
    print("|---|---|---|---|")
    for n, rr in res.items():
        m = max(r["memory"]["saved_MiB"] for r in rr)
        pk = [r["memory"]["peak_MiB"] for r in rr]
        pk_s = f"{max(pk):.1f}" if pk[0] is not None else "n/a (CPU)"
        print(f"| {n} | {m:.1f} | {m / base:.3f} | {pk_s} |")
    print(f"\nRing attention fwd+bwd, B 1, 4 heads, head_dim 32, seq {args.seq}, causal (median of 3, max over ranks)")
    print("| cp | fwd+bwd (ms) | comm alone (ms) | exposed comm (ms) | hidden fraction |")
    print("|---|---|---|---|---|")
    for n, rr in res.items():
        if "ring" not in rr[0]:
            continue
        g = {k: max(r["ring"][k] for r in rr) for k in rr[0]["ring"]}
        hidden = min(r["ring"]["hidden_fraction"] for r in rr)
        print(f"| {n} | {1e3 * g['fwd_bwd_s']:.1f} | {1e3 * g['comm_alone_s']:.1f} | "
              f"{1e3 * g['exposed_comm_s']:.1f} | {hidden:.2f} |")
    print("\nMoE layer forward, d 256, ffn 512, 8 experts top-2, 2048 tokens per rank, dropless (mean over ranks)")
    print("| ep | dispatch+combine all-to-all (ms) | expert compute (ms) | a2a / experts | a2a sent per rank (MiB) |")
    print("|---|---|---|---|---|")
    for n, rr in res.items():
        a = statistics.mean(r["moe"]["a2a_ms"] for r in rr)
        e = statistics.mean(r["moe"]["experts_ms"] for r in rr)
        mib = statistics.mean(r["moe"]["a2a_MiB"] for r in rr)
        print(f"| {n} | {a:.2f} | {e:.2f} | {a / e:.2f} | {mib:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({str(k): v for k, v in res.items()}, fh, indent=1)


if __name__ == "__main__":
    main()
