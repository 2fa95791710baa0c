"""CPU checks of two factors the planner's time model states for GPUs, measured here as ratios,
side by side in one run (docs/planner_validation.md, "CPU checks of the compile and overlap
factors"). Timing: run it alone.

    flock -x /tmp/bench.lock env PYTHONPATH=. python benchmarks/planner_features.py [--d 512 --seq 1024 --batch 4 --rounds 5]

1. torch.compile. One Llama block of shardlab's model (fp32, one thread), forward + backward,
   eager and ``block.compile()`` (what ``parallel.compile`` does), alternating rounds, medians.
   Its matmuls (the block's seven linears, forward + backward) and its attention kernel are timed
   alone on the same shapes; the rest, block - matmuls - attention, is the block's other work
   (norms, rotary, SiLU x up, residual adds, copies), the work compile fuses. The model's GPU
   statement is ``plan_time.ELEMENTWISE_PASSES``: eager 12, fused 4 passes over the saved bytes,
   a factor 3.0 on that work.
2. Overlap. Two gloo ranks, each a ~T ms matmul loop and an all-reduce of M bytes: serial (the
   all-reduce, then the matmuls) against overlapped (all-reduce issued with ``async_op=True``,
   the matmuls, then the wait). Hidden fraction = (serial - overlapped) / all-reduce alone. The
   GPU model hides asynchronous collectives behind compute up to the compute's length (FSDP's
   gathers, CP's ring) and the CPU model hides nothing (gloo runs on the cores that compute).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _time(fn, n: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compile_ratio(d: int, seq: int, batch: int, rounds: int) -> dict:
    from shardlab.config import Config
    from shardlab.models.spec import build_model, get_spec
    torch.set_num_threads(1)
    cfg = Config()
    m = cfg.model
    m.d_model, m.n_heads, m.n_kv_heads, m.n_layers, m.max_seq_len = d, d // 64, d // 64, 1, seq
    m.ffn_hidden = 4 * d
    model = build_model(m, 0)
    block = next(iter(get_spec(m).blocks(model).values()))
    compiled = build_model(m, 0)
    cblock = next(iter(get_spec(m).blocks(compiled).values()))
    cblock.compile()
    pos = torch.arange(seq)
    x = torch.randn(batch, seq, d, requires_grad=True)

    def step(b):
        def run():
            b(x, pos).sum().backward()
        return run

    t0 = time.perf_counter()
    step(cblock)()  # compile (forward and backward graphs)
    compile_s = time.perf_counter() - t0
    ws = [mod.weight for mod in block.modules() if isinstance(mod, torch.nn.Linear)]
    xs = [torch.randn(batch * seq, w.shape[1]) for w in ws]
    gs = [torch.randn(batch * seq, w.shape[0]) for w in ws]

    def matmuls():  # forward x W^T, backward dX = g W, dW = g^T x
        for w, a, g in zip(ws, xs, gs):
            a @ w.t(), g @ w, g.t() @ a
    h = m.n_heads
    q, k, v = (torch.randn(batch, h, seq, d // h, requires_grad=True) for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    eager, comp, mm, attn = [], [], [], []
    for _ in range(rounds):
        eager.append(_time(step(block)))
        comp.append(_time(step(cblock)))
        mm.append(_time(matmuls))
        attn.append(_time(attention))
    e, c, a, t = (statistics.median(v) for v in (eager, comp, mm, attn))
    return {"eager_s": e, "compiled_s": c, "matmul_s": a, "attention_s": t, "compile_s": compile_s,
            "block_ratio": e / c, "other_eager_s": e - a - t, "other_compiled_s": c - a - t,
            "other_ratio": (e - a - t) / max(c - a - t, 1e-9)}


def _overlap_rank(rank: int, world: int, port: int, nbytes: int, mm_n: int, reps: int, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buf = torch.ones(nbytes // 4)
    a = torch.randn(mm_n, mm_n)

    def compute():
        for _ in range(8):
            a @ a

    def comm():
        dist.all_reduce(buf)

    def serial():
        comm()
        compute()

    def overlapped():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()
    res = {}
    for name, fn in (("compute", compute), ("comm", comm), ("serial", serial), ("overlapped", overlapped)):
        dist.barrier()
        res[name] = _time(fn, reps)
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        out.put({k: max(g[k] for g in gathered) for k in res})
    dist.destroy_process_group()


def overlap_ratio(nbytes: int, mm_n: int, reps: int) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_overlap_rank, args=(r, 2, port, nbytes, mm_n, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join()
    res["hidden"] = (res["serial"] - res["overlapped"]) / res["comm"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=float, default=16.0, help="all-reduce size, MiB")
    ap.add_argument("--mm", type=int, default=384, help="matmul size of the overlap's compute (8 per step)")
    args = ap.parse_args(argv)
    c = compile_ratio(args.d, args.seq, args.batch, args.rounds)
    print(f"torch.compile, one Llama block d={args.d} seq={args.seq} batch={args.batch} fp32, 1 thread, forward + backward "
          f"(medians of {args.rounds} alternating rounds; compiling took {c['compile_s']:.1f} s):")
    print("| part | eager ms | compiled ms | eager / compiled |\n|---|---:|---:|---:|")
    print(f"| whole block | {1e3 * c['eager_s']:.1f} | {1e3 * c['compiled_s']:.1f} | {c['block_ratio']:.2f} |")
    print(f"| its matmuls, alone | {1e3 * c['matmul_s']:.1f} | | |")
    print(f"| its attention kernel, alone | {1e3 * c['attention_s']:.1f} | | |")
    print(f"| the rest (norms, rotary, SiLU x up, adds, copies) | {1e3 * c['other_eager_s']:.1f} | "
          f"{1e3 * c['other_compiled_s']:.1f} | {c['other_ratio']:.2f} |")
    print("planner's GPU statement for that work: 12 / 4 passes = 3.00 (plan_time.ELEMENTWISE_PASSES)\n")
    o = overlap_ratio(int(args.mib * 2**20), args.mm, 5)
    print(f"overlap, 2 gloo ranks on this host, all-reduce of {args.mib:g} MiB beside 8 matmuls of {args.mm}^2 "
          f"(the slower rank's mean of 5):")
    print("| compute ms | all-reduce ms | serial ms | overlapped (async_op) ms | all-reduce hidden |\n|---:|---:|---:|---:|---:|")
    print(f"| {1e3 * o['compute']:.1f} | {1e3 * o['comm']:.1f} | {1e3 * o['serial']:.1f} | {1e3 * o['overlapped']:.1f} | "
          f"{100 * o['hidden']:.0f}% |")
    print("planner: on GPUs asynchronous collectives hide behind compute up to its length (100% here); on the CPU none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
