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
   Bytes (deterministic, no timing: ``--only bytes``): every non-matmul, non-attention operator
   of the eager forward + backward counted by the bytes it reads and writes (a dispatch mode; views
   and in-place ops write no storage), against the bytes inductor's fused kernels read and write
   in the compiled graphs (its scheduler's nodes after fusion; extern matmul / attention kernels
   apart), both over the block's saved bytes: the passes ``ELEMENTWISE_PASSES`` states.
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
    block, pos, x, m = _block(d, seq, batch)
    cblock = _block(d, seq, batch)[0]
    cblock.compile()

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


def compile_bytes(d: int, seq: int, batch: int, bf16: bool = False) -> dict:
    """Bytes the block's non-matmul work moves, eager and compiled, and the bytes it saves
    (``bf16``: under CPU autocast, as a bf16 run computes: the weight casts count)."""
    import contextlib
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import scheduler as sched
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    block, pos, x, m = _block(d, seq, batch)
    aten = torch.ops.aten
    mm_ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
              aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default}

    class Bytes(TorchDispatchMode):
        ew = mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            ptrs = {t.untyped_storage().data_ptr() for t in ins}
            if outs and all(o.untyped_storage().data_ptr() in ptrs for o in outs):
                return out  # a view or an in-place op: no new storage written
            n = sum(t.numel() * t.element_size() for t in ins + outs)
            if func in mm_ops:
                self.mm += n
            else:
                self.ew += n
            return out
    params = {q.untyped_storage().data_ptr() for q in block.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    with Bytes() as eager, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp():
        block(x, pos).float().sum().backward()
    fused = {"ew": 0, "extern": 0, "kernels": 0}
    original = sched.Scheduler.codegen

    def codegen(self):  # the nodes after fusion: one generated kernel each, or an extern call
        for node in self.nodes:
            if isinstance(node, sched.ExternKernelSchedulerNode):
                fused["extern"] += node.get_read_write_buffers_sizes()
            elif not isinstance(node, sched.NopKernelSchedulerNode):
                fused["ew"] += node.get_read_write_buffers_sizes()
                fused["kernels"] += 1
        return original(self)
    sched.Scheduler.codegen = codegen
    inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = False, False  # compile anew
    try:
        torch._dynamo.reset()
        block.compile()
        with amp():
            block(x, pos).float().sum().backward()
    finally:
        sched.Scheduler.codegen = original
    s = sum(saved.values())
    return {"saved": s, "eager_ew": eager.ew, "eager_mm": eager.mm, "fused_ew": fused["ew"],
            "fused_extern": fused["extern"], "kernels": fused["kernels"]}


def _block(d: int, seq: int, batch: int):
    from shardlab.config import Config
    from shardlab.models.spec import build_model, get_spec
    torch.set_num_threads(1)
    m = Config().model
    m.d_model, m.n_heads, m.n_kv_heads, m.n_layers, m.max_seq_len = d, d // 64, d // 64, 1, seq
    m.ffn_hidden = 4 * d
    block = next(iter(get_spec(m).blocks(build_model(m, 0)).values()))
    return block, torch.arange(seq), torch.randn(batch, seq, d, requires_grad=True), m


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
    ap.add_argument("--only", choices=("all", "bytes"), default="all",
                    help="bytes: the deterministic byte count only (no timing: needs no exclusive lock)")
    args = ap.parse_args(argv)
    for bf16 in (False, True):
        b = compile_bytes(args.d, args.seq, args.batch, bf16)
        print(f"bytes moved by one Llama block's non-matmul, non-attention work (d={args.d} seq={args.seq} "
              f"batch={args.batch}, {'bf16 autocast' if bf16 else 'fp32'}, forward + backward), over the "
              f"{b['saved'] / 2**20:.1f} MiB it saves:")
        print("| | MiB | passes over the saved bytes |\n|---|---:|---:|")
        print(f"| eager operators (read + written) | {b['eager_ew'] / 2**20:.1f} | {b['eager_ew'] / b['saved']:.2f} |")
        print(f"| compiled: {b['kernels']} fused kernels (read + written) | {b['fused_ew'] / 2**20:.1f} | "
              f"{b['fused_ew'] / b['saved']:.2f} |")
        print(f"| eager / compiled | | {b['eager_ew'] / b['fused_ew']:.2f} |")
        print(f"(matmul + attention bytes: eager {b['eager_mm'] / 2**20:.1f} MiB, compiled extern kernels "
              f"{b['fused_extern'] / 2**20:.1f} MiB); planner's GPU statement: 12 and 4 passes, 3.00\n")
    if args.only == "bytes":
        return 0
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
