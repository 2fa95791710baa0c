"""MoE experts on one process: the per-expert loop vs the grouped kernel, forward+backward, and
the floor that the matrix products themselves allow on this machine.

d 256, ffn 512 (``--d-model``, ``--ffn``), 8 experts top-2, dropless or with a capacity
(``--capacity-factor``), for each dtype and token count T (k T = 2 T assignments):
  layer       the whole MoE layer (router, grouping, experts, combine): loop vs grouped
  experts     the experts alone on the layer's rows (grouped by expert, dropped ones last): loop,
              grouped (the ``auto`` kernel: on CPU padded to the capacity for small experts,
              else one mm per expert), and each kernel of models/moe_gemm.py forced: segments,
              padded ``bmm`` and (fp32/bf16) ``torch._grouped_mm``
  dense       the same products as ONE dense SwiGLU MLP over all the kept rows (one weight set):
              exactly the experts' FLOPs in three large GEMMs forward and four backward, i.e.
              what a perfect grouped GEMM could reach here; loop / dense is the largest
              speed-up any expert kernel can give over the loop
FLOPs of the experts' forward+backward: 7 products of 2 n D H each (n kept rows) (forward w1, w3, w2;
backward dW1, dW3, dW2, dA; the rows need no gradient, as in the layer, whose input here is a
tensor without grad). GFLOP/s = those FLOPs / median time. Each call starts from gradients set
to None, as a training step does after ``zero_grad``. Steady state: in each of ``--blocks``
rounds every variant runs ``--calls`` times in a row and the calls after a warm-up give its
median (alternating variant by variant instead re-faults freshly freed memory on every call and
moves the loop's time by 20-40%). bfloat16/float16 run under autocast with float32 weights, as a
mixed-precision training step does. Run it alone (flock): the machine's two cores are shared.

    PYTHONPATH=. python benchmarks/moe_kernel.py [--tokens 256 2048 8192] [--dtypes float32 bfloat16 float64]
    PYTHONPATH=. python benchmarks/moe_kernel.py --d-model 64 --ffn 96 --capacity-factor 1.25 --tokens 512
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

E, K = 8, 2
WARM = 5   # calls of a round left out of its median (allocator and caches settling)


def _step(fn, params, dev: str, amp) -> float:
    """One forward+backward from gradients set to None (as after ``zero_grad(set_to_none=True)``,
    the first micro-batch of a step); ``amp``: the autocast dtype, or None."""
    for p in params:
        p.grad = None
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast(dev, dtype=amp, enabled=amp is not None):
        y = fn()
    y.float().square().mean().backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def case(dtype, tokens: int, blocks: int, calls: int, dev: str = "cpu", D: int = 256, H: int = 512,
         capacity_factor: float = 0.0) -> dict:
    """Median ms per variant: ``blocks`` rounds, each running every variant ``calls`` times in a
    row (steady state: the last ``calls - WARM`` timed); bf16/fp16 run as training does, fp32
    weights under autocast. Also the per-round loop / grouped ratios (rounds are adjacent in time)."""
    amp = dtype if dtype in (torch.bfloat16, torch.float16) else None
    wdt = torch.float32 if amp else dtype
    cfg = ModelConfig(d_model=D, ffn_hidden=H, n_experts=E, moe_top_k=K, n_layers=2, n_heads=4,
                      moe_capacity_factor=capacity_factor)
    layer = MoE(cfg).to(dtype=wdt)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05, generator=g)
    x = torch.randn(tokens, D, dtype=wdt, generator=torch.Generator().manual_seed(1))
    layer, x = layer.to(dev), x.to(dev)
    r = layer.route(x)  # the experts alone: rows grouped by expert, as the layer passes them
    key = torch.where(r.keep, r.expert, E)                             # dropped assignments last
    rows = x[r.token[torch.argsort(key, stable=True)]]
    counts = torch.bincount(key, minlength=E + 1)[:E]
    cap = layer.capacity(tokens)
    ex = layer.experts
    dense = [torch.nn.Parameter(w[0].detach().clone()) for w in (ex.w1, ex.w3, ex.w2)]
    params = list(layer.parameters()) + dense

    def experts(impl, kernel="auto"):
        return lambda: expert_ffn(rows, counts, ex.w1, ex.w3, ex.w2, impl, kernel, cap)

    def layer_with(impl):
        def fn():
            ex.impl = impl
            return layer(x)
        return fn

    variants = {"layer loop": layer_with("loop"), "layer grouped": layer_with("grouped"),
                "experts loop": experts("loop"), "experts grouped": experts("grouped"),
                "dense": lambda: F.linear(F.silu(F.linear(rows, dense[0])) * F.linear(rows, dense[1]), dense[2])}
    variants["experts segments"] = experts("grouped", "segments")
    variants["experts padded"] = experts("grouped", "padded")
    if _grouped_mm_ok(rows.to(amp or wdt), ex.w1.to(amp or wdt)):
        variants["experts grouped_mm"] = experts("grouped", "grouped_mm")
    rounds: dict = {name: [] for name in variants}
    for _ in range(blocks):
        for name, fn in variants.items():
            ts = [_step(fn, params, dev, amp) for _ in range(calls)]
            rounds[name].append(1e3 * statistics.median(ts[WARM:]))
    out = {name: statistics.median(v) for name, v in rounds.items()}
    for what in ("layer", "experts"):
        out[what + " ratios"] = [a / b for a, b in zip(rounds[what + " loop"], rounds[what + " grouped"])]
    out["gflop"] = 7 * 2 * int(counts.sum()) * D * H / 1e9     # the kept rows' products
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float64"],
                    choices=["float32", "bfloat16", "float16", "float64"],
                    help="bfloat16/float16 run under autocast with float32 weights")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512, help="each expert's hidden width")
    ap.add_argument("--capacity-factor", type=float, default=0.0,
                    help="0 = dropless; with a capacity the CPU kernel may pad every expert to it (padded)")
    ap.add_argument("--blocks", type=int, default=3, help="rounds over the variants")
    ap.add_argument("--calls", type=int, default=15, help=f"calls per variant and round (the first {WARM} untimed)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda (on cuda the grouped kernel is torch._grouped_mm "
                                                    "where it applies: bf16 on sm90+)")
    args = ap.parse_args()
    if args.calls <= WARM:
        ap.error(f"--calls must be above {WARM} (the untimed warm-up calls of each round)")
    where = (f"cpu, {torch.get_num_threads()} threads" if args.device == "cpu"
             else torch.cuda.get_device_name(0))
    print(f"MoE forward+backward on one process ({where}, torch {torch.__version__}), "
          f"d {args.d_model}, ffn {args.ffn}, {E} experts top-{K}, "
          f"{'capacity factor %g' % args.capacity_factor if args.capacity_factor else 'dropless'}, gradients from None; median over {args.blocks} rounds "
          f"of the median of {args.calls - WARM} steady-state calls; times in ms; speed-up = loop / grouped "
          "(range over the rounds); GFLOP/s of the experts' 7 products")
    print("| dtype | tokens | layer loop | layer grouped | speed-up | experts loop | experts grouped | speed-up "
          "| experts segments | experts padded bmm | experts grouped_mm | dense, same FLOPs "
          "| GFLOP/s loop / grouped / dense | max speed-up (loop / dense) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dt in args.dtypes:
        for tokens in args.tokens:
            c = case(getattr(torch, dt), tokens, args.blocks, args.calls, args.device, args.d_model, args.ffn,
                     args.capacity_factor)
            gf = c["gflop"] * 1e3
            gmm = f"{c['experts grouped_mm']:.1f}" if "experts grouped_mm" in c else "n/a"
            sp = {w: f"{c[w + ' loop'] / c[w + ' grouped']:.2f}x ({min(c[w + ' ratios']):.2f}-{max(c[w + ' ratios']):.2f})"
                  for w in ("layer", "experts")}
            print(f"| {dt} | {tokens} | {c['layer loop']:.1f} | {c['layer grouped']:.1f} | {sp['layer']} | "
                  f"{c['experts loop']:.1f} | {c['experts grouped']:.1f} | {sp['experts']} | {c['experts segments']:.1f} | "
                  f"{c['experts padded']:.1f} | "
                  f"{gmm} | {c['dense']:.1f} | {gf / c['experts loop']:.0f} / {gf / c['experts grouped']:.0f} / "
                  f"{gf / c['dense']:.0f} | {c['experts loop'] / c['dense']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
