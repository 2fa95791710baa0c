"""DeepSeek-V3 on 2,048 H800s as the planner sees it, beside the published configuration
(docs/planner_deepseek.md).

    PYTHONPATH=. python benchmarks/planner_deepseek.py [--gpu h800]

Prints the published setup and figures (DeepSeek-V3 technical report, 2024), the shape shardlab
builds for it (configs/deepseek-v3.toml) with its parameter counts, and the planner's prediction
of the nearest layout shardlab's engine runs (ZeRO-1 with DualPipe is not implemented: DDP inside
the stages) for the flat and the hierarchical dispatch, without and with node-limited routing
(M = 4), without and with DualPipe's overlap; then which published figures the model reproduces.
Predictions, not measurements.
"""
from __future__ import annotations

import argparse
import copy
import time

from shardlab.analysis.devices import get_device
from shardlab.analysis.plan_layout import parse_layout, predict_pinned
from shardlab.analysis.plan_search import HEADROOM
from shardlab.commands.plan_cmd import load_model
from shardlab.models.llama import matmul_params_per_token

GiB = 2**30
LAYOUT = "ddp128 ep64 pp16 dualpipe mb1x120 ac-full"
"""The published layout (PP 16 DualPipe, EP 64 over 8 nodes, DP 128 of 2,048 GPUs, 15,360 x 4,096-token
sequences per step) with what shardlab's engine runs instead of ZeRO-1 (DDP inside the stages), one
sequence per micro-batch (not published) and full recomputation (DeepSeek recomputes the RMSNorms and
MLA's up-projections only: the planner has no such policy)."""

PUBLISHED = [
    ("GPUs", "2,048 H800 (8 per node; NVLink 160 GB/s, InfiniBand 50 GB/s per GPU)", "section 3.1, 3.2.2"),
    ("layout", "PP 16 (DualPipe), EP 64 over 8 nodes, ZeRO-1 DP, no TP", "section 3.2"),
    ("routing", "256 routed experts + 1 shared, top-8, each token to at most M = 4 nodes", "section 2.1.2, 4.2"),
    ("shape", "61 layers, d 7,168, 128 heads, MLA, first 3 layers dense, MTP depth 1; 671B / 37B active",
     "section 4.2"),
    ("batch", "15,360 sequences x 4,096 tokens (after a ramp from 3,072 over the first 469B tokens)", "section 4.2"),
    ("precision", "FP8 GEMMs (1x128 / 128x128 block scaling), BF16 AdamW moments, FP32 master weights",
     "section 3.3"),
    ("throughput", "180K H800 GPU-hours per trillion tokens = 1,543 tokens/s per GPU", "section 1, Table 1"),
]


def shape_params(m) -> tuple[float, float]:
    """(total, activated per token) parameters of the shape shardlab builds."""
    attn = 4 * m.d_model * m.d_model  # q, k, v, o with n_kv_heads = n_heads
    expert = 3 * m.d_model * m.ffn_hidden
    per_layer = attn + m.n_experts * expert + m.d_model * m.n_experts  # + router
    total = m.n_layers * per_layer + 2 * m.vocab_size * m.d_model
    return total, matmul_params_per_token(m)


def row(base, gpu: str, dispatch: str, max_nodes: int, overlap: bool, layout: str = LAYOUT) -> dict:
    b = copy.deepcopy(base)
    b.parallel.ep_dispatch, b.model.moe_max_nodes = dispatch, max_nodes
    cfg, pr = predict_pinned(b, parse_layout(layout), 2048, gpu, 8,
                             features=("dualpipe_overlap",) if overlap else ())
    bd = pr.breakdown
    t = bd.get("ep_tiers") or {}
    mbs = cfg.parallel.microbatches
    return {"tok": pr.tokens_per_s / 2048, "mfu": pr.mfu, "mem": pr.peak.total / GiB, "step": bd["step_s"],
            "a2a": bd["ep_comm"], "exposed": bd["ep_exposed"], "compute": bd["compute"],
            "slow": t.get("slow", 0) / 2**20, "fast": t.get("fast", 0) / 2**20, "nodes": t.get("nodes_hit", 0),
            "ratio": bd["ep_comm"] / (bd["compute"] - bd["recompute"]) if mbs else 0.0,
            "params": pr.peak.params / GiB}


MEASURED_KIB = {  # docs/expert-parallel.md, "Two tiers" (benchmarks/moe_dispatch.py): the ledger's slow-tier
    # KiB sent per rank per step, MoE layer fwd + bwd, 2 simulated nodes x 2 ranks, ep 4, 16 experts, 512
    # tokens per rank, d 128, fp32, uniform routing
    (8, "exact", 0): 4069, (8, "hierarchical", 0): 1088, (8, "exact", 1): 4124, (8, "hierarchical", 1): 548,
    (2, "exact", 0): 1030, (2, "hierarchical", 0): 787, (2, "exact", 1): 1027, (2, "hierarchical", 1): 522,
}


def cpu_check() -> None:
    """The planner's slow-tier bytes for benchmarks/moe_dispatch.py's layer against the ledger's."""
    from shardlab.analysis.devices import with_nodes
    from shardlab.analysis.plan_moe import a2a_seconds
    from shardlab.config import Config
    from shardlab.distributed.topology import Topology
    print("\n## CPU check: slow-tier bytes against the ledger (benchmarks/moe_dispatch.py)\n")
    print("| top-k | dispatch | M | planner KiB per rank per step | measured (ledger) | planner / measured |")
    print("|---:|---|---:|---:|---:|---:|")
    for (k, dispatch, M), measured in MEASURED_KIB.items():
        cfg = Config()
        m, p = cfg.model, cfg.parallel
        m.d_model, m.n_heads, m.ffn_hidden, m.n_experts, m.moe_top_k = 128, 4, 256, 16, k
        m.moe_node_groups, m.moe_max_nodes = (2, 1) if M else (0, 0)
        p.dp_shard, p.ep, p.ep_dispatch = 4, 4, dispatch
        _, b = a2a_seconds(cfg, Topology.from_config(p), with_nodes(get_device("h100"), 2), 512, 4)
        got = 4 * b["slow"] / 1024  # dispatch and combine, forward and backward
        print(f"| {k} | {'flat' if dispatch == 'exact' else dispatch} | {M or 'all'} | {got:,.0f} | {measured:,} | "
              f"{got / measured:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h800")
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = load_model("deepseek-v3")
    dev = get_device(args.gpu)
    print("## Published (DeepSeek-V3 technical report, arXiv 2412.19437)\n")
    print("| what | published | where |\n|---|---|---|")
    for k, v, s in PUBLISHED:
        print(f"| {k} | {v} | {s} |")
    total, active = shape_params(base.model)
    print(f"\nshape built (configs/deepseek-v3.toml): {total / 1e9:.0f}B parameters, {active / 1e9:.1f}B matmul "
          f"parameters per token (published 671B / 37B)\n")
    print(f"## Planner, {dev.name}, layout `{LAYOUT}` (bf16)\n")
    print("| dispatch | M | DualPipe overlap | tok/s/GPU | MFU | peak GiB | network MiB / pass | NVLink MiB / pass | "
          "nodes per token | all-to-all s/step | exposed s | all-to-all / compute |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for dispatch in ("exact", "hierarchical"):
        for M in (0, 4):
            for ov in (False, True):
                r = rows[dispatch, M, ov] = row(base, args.gpu, dispatch, M, ov)
                print(f"| {dispatch} | {M or 'all'} | {'on' if ov else 'off'} | {r['tok']:,.0f} | {100 * r['mfu']:.1f}% | "
                      f"{r['mem']:.1f} | {r['slow']:,.0f} | {r['fast']:,.0f} | {r['nodes']:.2f} | {r['a2a']:.2f} | "
                      f"{r['exposed']:.2f} | {r['ratio']:.2f} |")
    v = LAYOUT.replace("dualpipe", "dualpipev")
    print(f"\nDualPipeV (one parameter copy; the same F&B pairs), `{v}`, hierarchical, M = 4:\n")
    print("| DualPipe overlap | tok/s/GPU | MFU | peak GiB | fits |\n|---|---:|---:|---:|---|")
    for ov in (False, True):
        r = row(base, args.gpu, "hierarchical", 4, ov, v)
        print(f"| {'on' if ov else 'off'} | {r['tok']:,.0f} | {100 * r['mfu']:.1f}% | {r['mem']:.1f} | "
              f"{'yes' if r['mem'] * GiB <= HEADROOM * dev.memory else 'no'} |")
    one = row(base, args.gpu, "hierarchical", 4, False, LAYOUT.replace("dualpipe", "1f1b"))
    h = rows["hierarchical", 4, True]
    flat = rows["exact", 0, False]
    print(f"\ncapacity planned: {HEADROOM:.0%} of {dev.memory / GiB:.0f} GiB = {HEADROOM * dev.memory / GiB:.1f} GiB; "
          f"DualPipe's parameters {h['params']:.1f} GiB against 1F1B's {one['params']:.1f} GiB on the peak rank "
          f"({h['params'] / one['params']:.2f}x)")
    print("\n## Published figures against the model\n")
    print(f"- at most 4 nodes per token: {rows['hierarchical', 4, False]['nodes']:.2f} expected with M = 4, "
          f"{rows['hierarchical', 0, False]['nodes']:.2f} without the limit (uniform routing)")
    print(f"- hierarchical dispatch with M = 4 sends {h['slow'] / flat['slow']:.2f} of the flat dispatch's network bytes")
    print(f"- NVLink / InfiniBand: published 160 / 50 = 3.2 experts per node at equal time; device table "
          f"{dev.intra_bw / 1e9:.0f} / {dev.inter_bw / 1e9:.0f} = {dev.intra_bw / dev.inter_bw:.2f}")
    print(f"- cross-node all-to-all : compute about 1 : 1 (published, FP8 compute): "
          f"{flat['ratio']:.2f} flat, {h['ratio']:.2f} hierarchical with M = 4 (bf16 compute, recomputation excluded)")
    print(f"- DualPipe's overlap hides {1 - h['exposed'] / h['a2a']:.0%} of the all-to-all time "
          f"({h['a2a']:.2f} s -> {h['exposed']:.2f} s per step)")
    print(f"- throughput: 1,543 tokens/s per GPU published with FP8 GEMMs; {h['tok']:,.0f} predicted in bf16 "
          f"(Float8 is refused on MoE models: not comparable)")
    cpu_check()
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
