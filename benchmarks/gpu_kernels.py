"""The kernel rates behind the planner's device constants, measured on the device at hand
(docs/planner.md, Time model; docs/gpu.md): bf16 matrix products at a Llama's shapes forward and
backward (the planner's ``mm_eff``), the same products in fp8 through ``torch._scaled_mm`` (what
the planner's ``float8`` feature assumes: the fp8 peak at the same ``mm_eff``), causal attention
forward and backward through
``scaled_dot_product_attention`` at long sequences (``attn_eff``, in the planner's own FLOP
convention), and an elementwise add (the HBM rate the elementwise terms use). Each rate is
printed beside the stated constant of the device kind (analysis/devices.py, ``gpu_kind``).

    PYTHONPATH=. python benchmarks/gpu_kernels.py --device cuda [--json out.json]
    PYTHONPATH=. python benchmarks/gpu_kernels.py --device cpu --quick     (the code path, tiny sizes)

FLOPs: a product (M, K) x (K, N) is 2MKN; forward + its two backward products 3 x that. Attention:
the non-causal forward is 4 s^2 d h per sequence; causal kernels execute half; a flash backward
executes 2.5 x its forward (FlashAttention-2, section 3; plan_time.FLASH_BWD_EXTRA). So
``attn_eff`` = 0.5 x 4 s^2 d h x 3.5 / (forward + backward seconds x peak), the rate at which
the planner's ``t_attn`` is computed. Times: the median of ``--reps`` after ``--warmup`` runs,
CUDA events on a GPU, the wall clock on the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

LLAMA8B_GEMMS = ((16384, 4096, 6144), (16384, 4096, 4096), (16384, 4096, 28672), (16384, 14336, 4096))
"""(tokens, in, out) of Llama-3.1-8B's block products at 2 x 8,192 tokens: q/k/v fused, o, gate/up
fused, down."""


def _timer(device: str):
    """A function that times ``fn`` (seconds, median of reps) on ``device``."""
    def timed(fn, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(reps):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return statistics.median(out)
    return timed


def gemm_rows(shapes, device, dtype, timed, warmup, reps) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        dy = torch.randn(m, n, device=device, dtype=dtype)

        def step():
            F.linear(x, w)         # forward
            dy @ w                 # input gradient
            dy.t() @ x             # weight gradient
        s = timed(step, warmup, reps)
        rows.append({"kind": "matmul", "shape": f"{m}x{k}->{n}", "flops": 3 * 2 * m * k * n, "seconds": s})
    return rows


def fp8_gemm_rows(shapes, device, timed, warmup, reps) -> list[dict]:
    """The three products of a Float8 linear through ``torch._scaled_mm`` (tensorwise scales, bf16
    out): forward x(e4m3) W^T, input gradient dY(e5m2) W, weight gradient dY^T x; each operand
    already cast and laid out as the kernel takes it (the first row-major, the second
    column-major), so only the products are timed (the casts are the planner's fp8_casts term).
    Empty where this torch or device has no fp8 products (before sm89 on CUDA)."""
    if not hasattr(torch, "_scaled_mm") or (device == "cuda" and torch.cuda.get_device_capability() < (8, 9)):
        return []
    e4, e5, rows = torch.float8_e4m3fn, torch.float8_e5m2, []
    one = torch.tensor(1.0, device=device)
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device).to(e4)
        w = torch.randn(n, k, device=device).to(e4)
        dy = torch.randn(m, n, device=device).to(e5)
        w_t, dy_t, x_t = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()

        def step():
            torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16)       # forward
            torch._scaled_mm(dy, w_t.t(), one, one, out_dtype=torch.bfloat16)    # input gradient
            torch._scaled_mm(dy_t, x_t.t(), one, one, out_dtype=torch.bfloat16)  # weight gradient
        row = {"kind": "matmul-fp8", "shape": f"{m}x{k}->{n}", "backend": "_scaled_mm"}
        try:
            row.update(flops=3 * 2 * m * k * n, seconds=timed(step, warmup, reps))
        except RuntimeError as e:  # this build / device refuses a layout or dtype pair
            row = {**row, "error": str(e).splitlines()[0][:80]}
        rows.append(row)
    return rows


def attention_rows(seqs, tokens, heads, head_dim, device, dtype, timed, warmup, reps, backends) -> list[dict]:
    rows = []
    for s in seqs:
        b = max(1, tokens // s)
        q, k, v = (torch.randn(b, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, heads, s, head_dim, device=device, dtype=dtype)
        nc_fwd = 4 * s * s * head_dim * heads * b
        shape = f"b{b} h{heads} s{s} d{head_dim}"
        for name in backends:
            ctx = _backend(name)
            if ctx is None:
                continue
            try:
                with ctx:
                    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup, reps)

                    def both():
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        torch.autograd.backward(out, g)
                    total = timed(both, warmup, reps)
            except RuntimeError as e:  # the backend refuses these shapes / this device
                rows.append({"kind": "attention", "shape": shape, "backend": name,
                             "error": str(e).splitlines()[0][:80]})
                continue
            rows.append({"kind": "attention", "shape": shape, "backend": name,
                         "fwd_s": fwd, "bwd_s": max(total - fwd, 1e-12), "seconds": total,
                         "fwd_flops": 0.5 * nc_fwd, "bwd_flops": 0.5 * nc_fwd * 2.5, "flops": 0.5 * nc_fwd * 3.5})
            q.grad = k.grad = v.grad = None
    return rows


def _backend(name: str):
    """The ``sdpa_kernel`` context of one SDPA backend ("default": whatever SDPA picks)."""
    if name == "default":
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    backend = getattr(SDPBackend, name.upper(), None)  # a backend this torch does not have: skipped
    return None if backend is None else sdpa_kernel([backend])


def elementwise_row(n, device, dtype, timed, warmup, reps) -> dict:
    a = torch.randn(n, device=device, dtype=dtype)
    b = torch.randn(n, device=device, dtype=dtype)
    out = torch.empty_like(a)
    s = timed(lambda: torch.add(a, b, out=out), warmup, reps)
    return {"kind": "elementwise", "shape": f"add {n}", "bytes": 3 * n * a.element_size(), "seconds": s}


def _stated(device: str):
    """(kind, Device) of the device at hand in the planner's table, or (None, None)."""
    if device != "cuda":
        return None, None
    from shardlab.analysis.devices import DEVICES, gpu_kind
    kind = gpu_kind(torch.cuda.get_device_name())
    return kind, DEVICES.get(kind)


def _rate(x: float) -> str:
    return f"{x / 1e12:,.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.2f} GFLOP/s"


def table(rows: list[dict], dev) -> list[str]:
    """The markdown table: each rate, and its share of the stated device's peak (the fp8 peak for
    the fp8 products) beside the stated efficiency (``n/a`` without a known device)."""
    out = ["| kernel | shape | backend | seconds | rate | of stated peak | stated |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['kind']} | {r['shape']} | {r['backend']} | refused: {r['error']} | | | |")
            continue
        if r["kind"] == "elementwise":
            rate = r["bytes"] / r["seconds"]
            share, stated = (f"{rate / dev.hbm_bw:.2f}", f"HBM {dev.hbm_bw / 1e12:.2f} TB/s") if dev else ("n/a", "")
            out.append(f"| elementwise | {r['shape']} | | {r['seconds']:.2e} | {rate / 1e9:,.1f} GB/s | {share} | {stated} |")
            continue
        rate = r["flops"] / r["seconds"]
        peak = (dev.peak_fp8 if r["kind"] == "matmul-fp8" else dev.peak_flops) if dev else 0.0
        share = f"{rate / peak:.3f}" if peak else "n/a"
        stated = (f"{dev.attn_eff:.2f}" if r["kind"] == "attention" else f"{dev.mm_eff:.2f}") if dev else ""
        extra = ""
        if r["kind"] == "attention":
            extra = f" (fwd {_rate(r['fwd_flops'] / r['fwd_s'])}, bwd {_rate(r['bwd_flops'] / r['bwd_s'])})"
        out.append(f"| {r['kind']} | {r['shape']} | {r.get('backend', '')} | {r['seconds']:.2e} | "
                   f"{_rate(rate)}{extra} | {share} | {stated} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the code path on a CPU)")
    ap.add_argument("--seqs", type=int, nargs="*", default=[8192, 16384, 32768], help="attention sequence lengths")
    ap.add_argument("--tokens", type=int, default=32768, help="attention tokens per call (batch = tokens / seq)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backends", nargs="*", default=["default", "flash_attention", "cudnn_attention"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device: no CUDA device here; use --device cpu (with --quick) on a CPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    timed = _timer(a.device)
    shapes, seqs, tokens, heads, n_ew = LLAMA8B_GEMMS, a.seqs, a.tokens, a.heads, 2**28
    backends = a.backends if a.device == "cuda" else ["default"]
    if a.quick:
        shapes, seqs, tokens, heads, n_ew = ((64, 32, 48), (64, 48, 32)), [32, 64], 128, 2, 2**12
    kind, dev = _stated(a.device)
    rows = gemm_rows(shapes, a.device, dtype, timed, a.warmup, a.reps)
    rows += fp8_gemm_rows(shapes, a.device, timed, a.warmup, a.reps)
    rows += attention_rows(seqs, tokens, heads, a.head_dim if not a.quick else 16, a.device, dtype, timed,
                           a.warmup, a.reps, backends)
    rows.append(elementwise_row(n_ew, a.device, dtype, timed, a.warmup, a.reps))
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"{name} ({kind or 'not in the planner table'}), {str(dtype).replace('torch.', '')}, "
          f"median of {a.reps} after {a.warmup} warm-up runs")
    print("\n".join(table(rows, dev)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "kind": kind, "dtype": str(dtype), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
