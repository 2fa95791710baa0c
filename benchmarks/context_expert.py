"""Context and expert parallel, measured side by side (CPU gloo by default; --device cuda puts
all ranks' tensors on one GPU, gloo transport).

1. Activation memory per rank of a tiny Llama at a long sequence for cp = 1, 2, 4: the bytes
   autograd saves for backward (unique storages, parameters excluded; exact) and, on CUDA, the
   peak allocated memory of the forward+backward above the model's; on CPU, the peak resident
   set during the forward+backward above the resident set before it, with allocations of
   64 KiB and more mmapped individually so that freed memory leaves the resident set.
2. Ring attention: time of forward+backward, seconds blocked waiting on the ring (exposed
   communication), the same transfers alone (no compute), hidden fraction = 1 - exposed/alone.
   Blocked time also contains skew between ranks (a peer that computes slower sends later), so
   on shared CPUs the hidden fraction is a lower bound.
3. MoE layer under ep = 1, 2, 4: forward all-to-all dispatch + combine time vs expert compute,
   with the experts as a per-expert loop (``model.moe_impl = loop``) and as grouped GEMMs
   (``grouped``). The single-process kernel comparison (forward+backward, loop vs grouped vs
   the dense-GEMM floor) is benchmarks/moe_kernel.py.
4. ``--parts ulysses``: ring vs Ulysses (and unified 2x2 at cp 4) context parallel on a tiny
   Llama: fwd+bwd step time, bytes each rank sends per step (ledger), activation bytes saved.

5. ``--parts dispatch``: an MoE layer with capacity factor 1.25 under ep = 2, 4, the expert-parallel
   rows padded to the capacity (fixed all-to-all sizes, no host read) vs exact (only the kept rows,
   split sizes read on the host): forward+backward time, all-to-all bytes.

    PYTHONPATH=. python benchmarks/context_expert.py [--seq 8192] [--device cpu]
    PYTHONPATH=. python benchmarks/context_expert.py --parts ulysses --sizes 2 4

Numbers on the shared 2-core machines are noisy (other jobs run beside them); ratios within
one run are the meaningful part.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from shardlab.analysis.memtrace import reset_peak_rss
from shardlab.config import Config, ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model, get_spec
from shardlab.models.moe import MoE
from shardlab.parallel import context, expert, ulysses


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


def _exact_rss():
    """Make the CPU resident set track live tensors: every allocation >= 64 KiB gets its own
    mmap, returned to the OS when freed (glibc mallopt M_MMAP_THRESHOLD; torch's CPU allocator
    does not cache). Then the peak RSS of a phase measures its peak live memory."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
        return True
    except OSError:
        return False


def _rss_mib(field: str) -> float | None:
    """VmRSS (current) or VmHWM (peak since the last reset) from /proc, in MiB."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def memory(mesh, seq, dev):
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=seq)
    model = build_model(cfg, seed=0, device=dev)
    model = context.apply(model, mesh, None, get_spec(cfg).attention(model))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (1, seq + 1), generator=g)
    comm = mesh.comm("cp")
    x = context.shard_sequence(data[:, :-1], comm.rank, comm.size).to(dev)
    y = context.shard_sequence(data[:, 1:], comm.rank, comm.size).to(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    reset_peak_rss()
    rss0 = _rss_mib("VmRSS")
    nbytes, loss = activation_bytes(model, lambda: model(x, y))
    loss.backward()
    _sync(dev)
    hwm = _rss_mib("VmHWM")
    rss = None if rss0 is None or hwm is None else hwm - rss0
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else None
    return {"saved_MiB": nbytes / 2**20, "peak_MiB": None if peak is None else peak / 2**20, "rss_MiB": rss}


def _exchange(comm, kv, n):
    """``n`` ring steps of the K/V block with nothing else running."""
    cp, r = comm.size, comm.rank
    for _ in range(n):
        buf = torch.empty_like(kv)
        for req in comm.exchange([(kv, (r + 1) % cp)], [(buf, (r - 1) % cp)]):
            req.wait()


def _backward_timeline(comm, stats):
    """(blocked seconds, of which skew) of this rank's backward waits. At step s a rank waits for
    K/V from r-1 and for r+1 to take ours (both posted at their step s start) and for the partial
    dK/dV from r-1 (posted with its step s K/V); the final wait for the complete dK/dV
    from r-1 (end of its last step) and for r+1 to take our partial sums (its step s+1 start,
    or its final receive)."""
    cp, r = comm.size, comm.rank
    row = torch.tensor(stats["bwd_posts"] + stats["bwd_dkv_posts"] + stats["bwd_final_post"], dtype=torch.float64)
    every = comm.all_gather(row.unsqueeze(0))                               # (cp, 2cp+1)
    posts, dkv_posts, final_post = every[:, :cp], every[:, cp:2 * cp], every[:, 2 * cp]
    prev, nxt = (r - 1) % cp, (r + 1) % cp
    blocked = skew = 0.0
    for s, (w0, w1) in enumerate(stats["bwd_waits"]):
        ready = []
        if s < cp - 1:
            ready += [posts[prev, s], posts[nxt, s]]
        if s > 0:
            ready.append(dkv_posts[prev, s - 1])
        b = w1 - w0
        blocked += b
        skew += min(max(0.0, float(max(ready)) - w0), b)
    w0, w1 = stats["bwd_final_wait"][0]
    ready = [dkv_posts[prev, cp - 1], final_post[nxt]] + [posts[nxt, s + 1] for s in range(cp - 1)]
    blocked += w1 - w0
    skew += min(max(0.0, float(max(ready)) - w0), w1 - w0)
    return blocked, skew


def ring(mesh, seq, dev, iters=3):
    """Ring attention fwd+bwd; forward timeline analysed for overlap. A forward wait at step s
    waits for the block from rank r-1 (isend posted at that rank's step s) and for rank r+1 to
    take ours (irecv posted at its step s). The part of the wait before the later of those two
    posts is skew (a peer still computing), the rest is transfer time not hidden by compute."""
    comm = mesh.comm("cp")
    cp, r = comm.size, comm.rank
    B, H, D = 1, 4, 32
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (context.shard_sequence(torch.randn(B, H, seq, D, generator=g), r, cp, dim=2).to(dev)
                   for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    keys = ("fwd_bwd_s", "exposed_comm_s", "comm_alone_s", "fwd_alone_s", "fwd_blocked_s", "fwd_skew_s",
            "fwd_unhidden_s", "bwd_alone_s", "bwd_blocked_s", "bwd_skew_s", "bwd_unhidden_s")
    rec = {k_: [] for k_ in keys}
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
        _exchange(comm, kv, cp - 1)
        t3 = time.perf_counter()
        _exchange(comm, kv, cp - 1)
        _exchange(comm, kv, cp)
        _sync(dev)
        t4 = time.perf_counter()
        tl = torch.tensor([[p, w0, w1] for p, (w0, w1) in zip(stats["fwd_posts"], stats["fwd_waits"])],
                          dtype=torch.float64)
        every = comm.all_gather(tl.unsqueeze(0))                         # (cp, cp-1, 3)
        blocked = tl[:, 2] - tl[:, 1]
        peers_ready = torch.maximum(every[(r - 1) % cp, :, 0], every[(r + 1) % cp, :, 0])
        skew = torch.minimum((peers_ready - tl[:, 1]).clamp(min=0), blocked)
        bwd_blocked, bwd_skew = _backward_timeline(comm, stats)
        if it:  # first iteration is warm-up
            for key, val in zip(keys, (t1 - t0, stats["wait_s"], t4 - t2, t3 - t2, float(blocked.sum()),
                                       float(skew.sum()), float((blocked - skew).sum()), t4 - t3,
                                       bwd_blocked, bwd_skew, bwd_blocked - bwd_skew)):
                rec[key].append(val)
    return {key: statistics.median(vals) for key, vals in rec.items()}


def moe(mesh, dev, tokens=2048, iters=3, impl="grouped", capacity=0.0, dispatch="padded", backward=False):
    cfg = ModelConfig(d_model=256, ffn_hidden=512, n_experts=8, moe_top_k=2, n_layers=2, n_heads=4, moe_impl=impl,
                      moe_capacity_factor=capacity)
    ref = MoE(cfg).to(dev)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    layer = expert.ExpertParallelMoE(ref, mesh, cfg, "layers.0.feed_forward", dispatch)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(mesh.rank)).to(dev)
    walls = []
    for it in range(iters + 1):
        if it == 1:
            layer.timing = {k: 0.0 for k in layer.timing}
            snap = mesh.ledger.snapshot()
        mesh.comm("ep").barrier()
        t0 = time.perf_counter()
        y = layer(x)
        if backward:
            y.square().sum().backward()
        _sync(dev)
        walls.append(time.perf_counter() - t0)
    tm, n = layer.timing, layer.timing["calls"]
    sent = sum(e.bytes_sent for (op, grp), e in mesh.ledger.since(snap).items() if op == "all_to_all")
    return {"a2a_ms": 1e3 * (tm["dispatch_s"] + tm["combine_s"]) / n, "experts_ms": 1e3 * tm["experts_s"] / n,
            "a2a_MiB": sent / n / 2**20, "wall_ms": 1e3 * statistics.median(walls[1:]),
            "dropped": float(layer.last_stats.get("dropped_fraction", 0.0))}


def ulysses(n, seq, dev, iters=3):
    """Ring (on the lse kernel, and on the hand-written fallback) vs Ulysses (and unified 2x2 at
    cp 4): the whole tiny model, fwd+bwd, per rank."""
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=seq)
    cfg.train.seq_len = seq
    data = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, impl, u in [("ring", "ring", 1), ("ring, hand-written pairs", "ring", 1), ("ulysses", "ulysses", n)] + (
            [("unified 2x2", "unified", 2)] if n == 4 else []):
        context.KERNEL = "manual" if "hand-written" in name else "auto"
        cfg.parallel.cp, cfg.parallel.cp_impl, cfg.parallel.cp_ulysses = n, impl, (u if impl == "unified" else 1)
        mesh = Mesh.build(Topology(cp=n, cp_ulysses=u))
        model = build_model(cfg.model, seed=0, device=dev)
        model = (ulysses if impl != "ring" else context).apply(model, mesh, cfg, get_spec(cfg.model).attention(model))
        x, y = (context.shard_batch(data[:, :-1], data[:, 1:], mesh)[i].to(dev) for i in (0, 1))
        times = []
        for it in range(iters + 1):
            mesh.comm("cp").barrier()
            snap = mesh.ledger.snapshot()
            t0 = time.perf_counter()
            saved, loss = activation_bytes(model, lambda: model(x, y))
            loss.backward()
            _sync(dev)
            times.append(time.perf_counter() - t0)
            sent = sum(e.bytes_sent for e in mesh.ledger.since(snap).values())
        out[name] = {"step_s": statistics.median(times[1:]),
                     "sent_MiB": sent / 2**20, "saved_MiB": saved / 2**20}
    context.KERNEL = "auto"
    return out


def _ulysses_table(res, seq, device):
    print(f"\nRing vs Ulysses, tiny Llama (d 64, 2 layers, 4 heads, head_dim 16), seq {seq}, batch 1, fp32, "
          f"device {device}; fwd+bwd of the whole model (median of 3 after a warm-up, max over ranks), "
          "bytes each rank sends per step (ledger, max over ranks), activation bytes saved for backward")
    print("| cp | impl | fwd+bwd (ms) | sent per rank per step (MiB) | activations saved (MiB) |")
    print("|---|---|---|---|---|")
    for n, rr in res.items():
        for impl in rr[0].get("ulysses", {}):
            g = {k: max(r["ulysses"][impl][k] for r in rr) for k in ("step_s", "sent_MiB", "saved_MiB")}
            print(f"| {n} | {impl} | {1e3 * g['step_s']:.0f} | {g['sent_MiB']:.2f} | {g['saved_MiB']:.1f} |")


def worker(ctx, n, seq, device, parts):
    dev = torch.device(device)
    _exact_rss()
    out = {}
    mesh = Mesh.build(Topology(cp=n)) if n > 1 else Mesh.single(dev)
    if "memory" in parts:
        out["memory"] = memory(mesh, seq, dev)
    if "ring" in parts and n > 1:
        out["ring"] = ring(mesh, seq, dev)
    if "ulysses" in parts and n > 1:
        out["ulysses"] = ulysses(n, seq, dev)
    if "moe" in parts:
        ep_mesh = Mesh.build(Topology(dp_shard=n, ep=n)) if n > 1 else mesh
        out["moe"] = {impl: moe(ep_mesh, dev, impl=impl) for impl in ("loop", "grouped")}
    if "dispatch" in parts and n > 1:  # with a capacity: padded (fixed sizes, no host read) vs exact
        ep_mesh = Mesh.build(Topology(dp_shard=n, ep=n))
        out["dispatch"] = {d: moe(ep_mesh, dev, iters=5, capacity=1.25, dispatch=d, backward=True)
                           for d in ("padded", "exact", "padded", "exact")}  # (second pair: after warm-up)
    return out


def _rank_mean(rr, part, variant) -> dict:
    """Each figure of ``part`` / ``variant``, averaged over the ranks' results ``rr``."""
    return {k: statistics.mean(r[part][variant][k] for r in rr) for k in rr[0][part][variant]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", default="")
    ap.add_argument("--parts", nargs="+", default=["memory", "ring", "moe"], help="memory ring moe ulysses dispatch")
    args = ap.parse_args()
    res = {}
    for n in args.sizes:
        per_rank = run(worker, n, n, args.seq, args.device, args.parts, timeout_s=600)
        res[n] = per_rank
    if "memory" in args.parts:
        base = max(r["memory"]["saved_MiB"] for r in res[args.sizes[0]])
        base_rss = max(r["memory"]["rss_MiB"] or 1e-9 for r in res[args.sizes[0]])
        print(f"\nActivation memory per rank, tiny Llama (d 64, 2 layers, 4 heads), seq {args.seq}, batch 1, "
              f"fp32, device {args.device}")
        print("| cp | saved for backward, max over ranks (MiB) | vs cp=1 | peak RSS growth in fwd+bwd (MiB, vs cp=1) "
              "| CUDA peak alloc fwd+bwd (MiB) |")
        print("|---|---|---|---|---|")
        for n, rr in res.items():
            m = max(r["memory"]["saved_MiB"] for r in rr)
            pk = [r["memory"]["peak_MiB"] for r in rr]
            pk_s = f"{max(pk):.1f}" if pk[0] is not None else "n/a (CPU)"
            rss = [r["memory"]["rss_MiB"] for r in rr]
            rss_s = f"{max(rss):.1f} ({max(rss) / base_rss:.2f})" if None not in rss else "n/a"
            print(f"| {n} | {m:.1f} | {m / base:.3f} | {rss_s} | {pk_s} |")
    if "ring" in args.parts:
        print(f"\nRing attention, B 1, 4 heads, head_dim 32, seq {args.seq}, causal (median of 3 runs; times max "
              "over ranks, hidden fraction mean over ranks). blocked = time in wait, skew = part of it before "
              "the peers had posted the matching isend/irecv, unhidden = blocked - skew.")
        print("| cp | pass | fwd+bwd (ms) | transfers alone (ms) | blocked in wait (ms) "
              "| of which skew (ms) | unhidden (ms) | hidden = 1 - unhidden / alone |")
        print("|---|---|---|---|---|---|---|---|")
        for n, rr in res.items():
            if "ring" not in rr[0]:
                continue
            g = {k: max(r["ring"][k] for r in rr) for k in rr[0]["ring"]}
            for ps in ("fwd", "bwd"):
                hidden = statistics.mean(max(0.0, 1 - r["ring"][f"{ps}_unhidden_s"] / r["ring"][f"{ps}_alone_s"])
                                         for r in rr)
                print(f"| {n} | {ps} | {1e3 * g['fwd_bwd_s']:.1f} | {1e3 * g[f'{ps}_alone_s']:.1f} | "
                      f"{1e3 * g[f'{ps}_blocked_s']:.1f} | {1e3 * g[f'{ps}_skew_s']:.1f} | "
                      f"{1e3 * g[f'{ps}_unhidden_s']:.1f} | {hidden:.2f} |")
    if "moe" in args.parts:
        print("\nMoE layer forward, d 256, ffn 512, 8 experts top-2, 2048 tokens per rank, dropless, fp32 "
              "(mean over ranks)")
        print("| ep | experts | dispatch+combine all-to-all (ms) | expert compute (ms) | a2a / experts "
              "| a2a sent per rank (MiB) |")
        print("|---|---|---|---|---|---|")
        for n, rr in res.items():
            for impl in ("loop", "grouped"):
                g = _rank_mean(rr, "moe", impl)
                print(f"| {n} | {impl} | {g['a2a_ms']:.2f} | {g['experts_ms']:.2f} | {g['a2a_ms'] / g['experts_ms']:.2f} "
                      f"| {g['a2a_MiB']:.2f} |")
    if "dispatch" in args.parts:
        print("\nMoE layer forward+backward with capacity factor 1.25, expert-parallel dispatch padded to the "
              "capacity vs exact, d 256, ffn 512, 8 experts top-2, 2048 tokens per rank, fp32 (mean over ranks; "
              "forward split into all-to-all and experts)")
        print("| ep | dispatch | fwd+bwd (ms) | fwd all-to-all (ms) | fwd experts (ms) | a2a sent per rank (MiB) "
              "| dropped |")
        print("|---|---|---|---|---|---|---|")
        for n, rr in res.items():
            for d in ("padded", "exact"):
                if "dispatch" not in rr[0]:
                    continue
                g = _rank_mean(rr, "dispatch", d)
                print(f"| {n} | {d} | {g['wall_ms']:.1f} | {g['a2a_ms']:.2f} | {g['experts_ms']:.2f} "
                      f"| {g['a2a_MiB']:.2f} | {g['dropped']:.3f} |")
    if "ulysses" in args.parts:
        _ulysses_table(res, args.seq, args.device)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({str(k): v for k, v in res.items()}, fh, indent=1)


if __name__ == "__main__":
    main()
