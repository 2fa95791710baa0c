"""MoE experts on one process: the per-expert loop vs the grouped kernel, forward+backward, and
the floor that the matrix products themselves allow on this machine.

d 256, ffn 512, 8 experts top-2, dropless, for each dtype and token count T (k T = 2 T rows):
  layer       the whole MoE layer (router, grouping, experts, combine): loop vs grouped
  experts     the experts alone on rows grouped by expert: loop, grouped (``auto`` kernel: on CPU
              the per-expert segments), and the other kernels of models/moe_gemm.py: padded
              ``bmm`` and (fp32) ``torch._grouped_mm``
  dense       the same products as ONE dense SwiGLU MLP over all k T rows (one weight set):
              exactly the experts' FLOPs in three large GEMMs forward and four backward, i.e.
              what a perfect grouped GEMM could reach here; loop / dense is the largest
              speed-up any expert kernel can give over the loop
FLOPs of the experts' forward+backward: 7 products of 2 kT D H each (forward w1, w3, w2;
backward dW1, dW3, dW2, dA; the rows need no gradient, as in the layer, whose input here is a
tensor without grad). GFLOP/s = those FLOPs / median time. The variants alternate; median of
``--reps`` after a warm-up. Run it alone (flock): the machine's two cores are shared.

    PYTHONPATH=. python benchmarks/moe_kernel.py [--tokens 256 2048 8192] [--dtypes float32 float64]
    PYTHONPATH=. python benchmarks/moe_kernel.py --device cuda --dtypes bfloat16 float32 --tokens 2048 8192
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab.config import ModelConfig  # noqa: E402
from shardlab.models.moe import MoE  # noqa: E402
from shardlab.models.moe_gemm import expert_ffn, _grouped_mm_ok  # noqa: E402

D, H, E, K = 256, 512, 8, 2


def _time(fn, dev: str) -> float:
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn().square().mean().backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def case(dtype, tokens: int, reps: int, dev: str = "cpu") -> dict:
    cfg = ModelConfig(d_model=D, ffn_hidden=H, n_experts=E, moe_top_k=K, n_layers=2, n_heads=4)
    layer = MoE(cfg).to(dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05, generator=g)
    x = torch.randn(tokens, D, dtype=dtype, generator=torch.Generator().manual_seed(1))
    layer, x = layer.to(dev), x.to(dev)
    r = layer.route(x)  # the experts alone: rows grouped by expert, as the layer passes them
    rows = x[r.token[torch.argsort(r.expert, stable=True)]]
    counts = torch.bincount(r.expert, minlength=E)
    ex = layer.experts
    dense = [torch.nn.Parameter(w[0].detach().clone()) for w in (ex.w1, ex.w3, ex.w2)]

    def experts(impl, kernel="auto"):
        return lambda: expert_ffn(rows, counts, ex.w1, ex.w3, ex.w2, impl, kernel)

    def layer_with(impl):
        def fn():
            ex.impl = impl
            return layer(x)
        return fn

    variants = {"layer loop": layer_with("loop"), "layer grouped": layer_with("grouped"),
                "experts loop": experts("loop"), "experts grouped": experts("grouped"),
                "dense": lambda: F.linear(F.silu(F.linear(rows, dense[0])) * F.linear(rows, dense[1]), dense[2])}
    variants["experts padded"] = experts("grouped", "padded")
    if _grouped_mm_ok(rows, ex.w1):
        variants["experts grouped_mm"] = experts("grouped", "grouped_mm")
    times: dict = {}
    for _ in range(reps + 1):
        for name, fn in variants.items():
            times.setdefault(name, []).append(_time(fn, dev))
    out = {name: 1e3 * statistics.median(v[1:]) for name, v in times.items()}
    out["gflop"] = 7 * 2 * K * tokens * D * H / 1e9
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the grouped kernel is torch._grouped_mm "
                                                    "where it applies: bf16/fp32 on sm90+)")
    args = ap.parse_args()
    where = (f"cpu, {torch.get_num_threads()} threads" if args.device == "cpu"
             else torch.cuda.get_device_name(0))
    print(f"MoE forward+backward on one process ({where}, torch {torch.__version__}), "
          f"d {D}, ffn {H}, {E} experts top-{K}, dropless, median of {args.reps}; times in ms; GFLOP/s of the "
          "experts' 7 products")
    print("| dtype | tokens | layer loop | layer grouped | speed-up | experts loop | experts grouped | speed-up "
          "| experts padded bmm | experts grouped_mm | dense, same FLOPs | GFLOP/s loop / grouped / dense | max speed-up (loop / dense) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dt in args.dtypes:
        for tokens in args.tokens:
            c = case(getattr(torch, dt), tokens, args.reps, args.device)
            gf = c["gflop"] * 1e3
            gmm = f"{c['experts grouped_mm']:.1f}" if "experts grouped_mm" in c else "n/a"
            print(f"| {dt} | {tokens} | {c['layer loop']:.1f} | {c['layer grouped']:.1f} | "
                  f"{c['layer loop'] / c['layer grouped']:.2f}x | {c['experts loop']:.1f} | "
                  f"{c['experts grouped']:.1f} | {c['experts loop'] / c['experts grouped']:.2f}x | {c['experts padded']:.1f} | "
                  f"{gmm} | "
                  f"{c['dense']:.1f} | {gf / c['experts loop']:.0f} / {gf / c['experts grouped']:.0f} / "
                  f"{gf / c['dense']:.0f} | {c['experts loop'] / c['dense']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
