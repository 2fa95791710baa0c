"""Predicted vs measured peak memory per rank, one line per layout (docs/benchmarks.md, Memory peaks).

A ~100M Llama (d_model 1024, 8 layers, vocab 256, seq 64, fp32, global batch 16) over N ranks, two
real AdamW steps per layout (``analysis.measured_memory.measure_run``): the prediction of ``shardlab
memory`` (analysis/predict.py, with the empty rank's RSS measured in the same run) next to the
peak the ranks reached (CPU: VmHWM; CUDA: max_memory_allocated and reserved), the largest
predicted category, and for ZeRO-3 the bound of issue 31: 16 B x params / N + the largest unit
gathered with its gradient + activations + the empty rank.

    PYTHONPATH=. python benchmarks/memory_peaks.py                  # N=4 layouts and N=8 rows
    PYTHONPATH=. python benchmarks/memory_peaks.py --only zero3 --n 2 4 8
    PYTHONPATH=. python benchmarks/memory_peaks.py --malloc jemalloc   # LD_PRELOAD for the ranks
    PYTHONPATH=. python benchmarks/memory_peaks.py --transport process_group   # gloo, as off x86-64
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--model.vocab_size=256", "--model.d_model=1024", "--model.n_layers=8", "--model.n_heads=8",
         "--model.max_seq_len=64", "--train.seq_len=64", "--train.global_batch=16", "--train.threads=1"]
# name -> (overrides, which world sizes); dp_shard is set to what the other degrees leave
LAYOUTS = {
    "ddp": (["--parallel.zero_stage=0"], (4,)),
    "zero1": (["--parallel.zero_stage=1"], (4,)),
    "zero2": (["--parallel.zero_stage=2"], (4,)),
    "zero3": (["--parallel.zero_stage=3"], (4, 8)),
    "zero3-noprefetch": (["--parallel.zero_stage=3", "--parallel.prefetch=false"], (4,)),
    "zero3-keep-gathered": (["--parallel.zero_stage=3", "--parallel.reshard_after_forward=false"], (4,)),
    "hsdp-2x2": (["--parallel.zero_stage=3", "--parallel.dp_replicate=2"], (4,)),
    "tp2-sp-dp2": (["--parallel.tp=2", "--parallel.sequence_parallel=true"], (4,)),
    "tp4": (["--parallel.tp=4"], (4,)),
    "fsdp-tp2": (["--parallel.zero_stage=3", "--parallel.tp=2"], (4, 8)),
    "pp2-1f1b-dp2": (["--parallel.pp=2", "--parallel.microbatches=4"], (4,)),
    "pp4-gpipe": (["--parallel.pp=4", "--parallel.pp_schedule=gpipe", "--parallel.microbatches=4"], (4,)),
    "pp4-zb-h1": (["--parallel.pp=4", "--parallel.pp_schedule=zb-h1", "--parallel.microbatches=4"], (4,)),
    "pp4-interleaved": (["--parallel.pp=4", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2",
                         "--parallel.microbatches=4"], (4,)),
    "pp4-dualpipev": (["--parallel.pp=4", "--parallel.pp_schedule=dualpipev", "--parallel.microbatches=8"], (4,)),
    "pp2-zero1-dp2": (["--parallel.pp=2", "--parallel.zero_stage=1", "--parallel.microbatches=4"], (4,)),
    "cp2-dp2": (["--parallel.cp=2"], (4,)),
    "cp2-zero3": (["--parallel.cp=2", "--parallel.zero_stage=3"], (4,)),
    "ddp-bf16": (["--parallel.zero_stage=0", "--train.precision=bf16"], (4,)),
    "zero3-bf16": (["--parallel.zero_stage=3", "--train.precision=bf16", "--train.param_dtype=bf16"], (4,)),
    "moe-ep2-dp2": (["--model.n_experts=4", "--model.moe_top_k=2", "--parallel.ep=2"], (4,)),
    "moe-ep2-zero3": (["--model.n_experts=4", "--model.moe_top_k=2", "--parallel.ep=2", "--parallel.zero_stage=3"], (4,)),
}
MALLOC = {"glibc": "", "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
          "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}


def _degrees(over: list[str], n: int) -> list[str]:
    get = {o.split("=")[0].split(".")[-1]: int(o.split("=")[1]) for o in over
           if o.split("=")[1].isdigit()}
    rest = n // (get.get("tp", 1) * get.get("pp", 1) * get.get("cp", 1) * get.get("dp_replicate", 1))  # ep borrows from it
    return over + [f"--parallel.dp_shard={rest}"]


def row(name: str, n: int, device: str, model: list[str], transport: str = "auto") -> dict:
    from shardlab.analysis.measured_memory import measure_run
    from shardlab.analysis.predict import memory_per_rank
    from shardlab.config import load
    import shardlab.train.checks  # noqa: F401  (registers every config check validate runs)
    over, _ = LAYOUTS[name]
    cfg = load(None, model + _degrees(over, n) + [f"--train.device={device}",
                                                  f"--parallel.comm_transport={transport}"]).validate(world_size=n)
    pred = memory_per_rank(cfg, "cpu" if device == "cpu" else "h100")
    t0 = time.time()
    results = measure_run(cfg, n)
    def predicted(r):  # the empty rank as this run measured it (a prediction without one: as it was)
        fixed = getattr(pred[r], "fixed", None)
        return pred[r].total if fixed is None else pred[r].total - fixed + results[r][1].baseline

    worst = max(range(n), key=lambda r: results[r][1].peak / predicted(r))
    p, (_, tr) = pred[worst], results[worst]
    want = predicted(worst)
    terms = {"params": p.params, "grads": p.grads, "optimizer states": p.optim, "activations": p.activations,
             "gathered/buffers": p.buffers, "unit gradients": getattr(p, "bwd_transient", 0),
             "optimizer temporaries": getattr(p, "opt_transient", 0), "empty rank": tr.baseline}
    out = dict(layout=name, n=n, predicted=want, measured=tr.peak, reserved=tr.reserved,
               largest=max(terms, key=terms.get), seconds=time.time() - t0, split=tr.split)
    if cfg.parallel.zero_stage == 3 and cfg.parallel.tp == 1 and cfg.parallel.cp == 1 and cfg.parallel.dp_replicate == 1:
        from shardlab.models import count_params, meta_model
        model = meta_model(cfg.model)
        unit = max(sum(q.numel() for q in blk.parameters()) for blk in model.layers.values()) * 4  # fp32 block
        out["bound"] = 16 * count_params(model) / n + 2 * unit + p.activations + tr.baseline  # unit + its gradient
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=sorted(LAYOUTS), help="layouts to run (default all)")
    ap.add_argument("--n", nargs="*", type=int, help="world sizes (default each layout's own: 4, and 8 for some)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--malloc", default="glibc", choices=sorted(MALLOC), help="the ranks' allocator (LD_PRELOAD)")
    ap.add_argument("--transport", default="auto", choices=("auto", "shared", "process_group"),
                    help="parallel.comm_transport (process_group: gloo on CPU, the default off x86-64)")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    if MALLOC[args.malloc]:
        if not os.path.exists(MALLOC[args.malloc]):
            print(f"--malloc {args.malloc}: {MALLOC[args.malloc]} is missing; apt-get install libjemalloc2 "
                  "libtcmalloc-minimal4", file=sys.stderr)
            return 2
        os.environ["LD_PRELOAD"] = MALLOC[args.malloc]  # the spawned ranks start with it
    model = [o for o in MODEL if not o.startswith(("--model.d_model", "--model.n_layers"))] + \
        [f"--model.d_model={args.d_model}", f"--model.n_layers={args.layers}"]
    mib = 2**20
    kind = "VmHWM" if args.device == "cpu" else "max allocated"
    print(f"| layout | N | predicted peak MiB | measured peak MiB ({kind}) | measured / predicted | largest predicted "
          f"category | ZeRO-3 bound MiB (measured / bound) | heap / libraries / shm arena MiB | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.only or LAYOUTS:
        for n in args.n or LAYOUTS[name][1]:
            r = row(name, n, args.device, model, args.transport)
            bound = f"{r['bound'] / mib:,.0f} ({r['measured'] / r['bound']:.2f})" if "bound" in r else "-"
            split = " / ".join(f"{r['split'].get(k, 0) / mib:,.0f}" for k in ("RssAnon", "RssFile", "RssShmem")) \
                if r["split"] else ""
            if args.device != "cpu":  # the caching allocator's reserved peak beside the allocated one
                split = f"reserved {r['reserved'] / mib:,.0f} ({r['reserved'] / r['measured']:.2f}x allocated)" + \
                    (f"; host {split}" if split else "")
            print(f"| {name} | {n} | {r['predicted'] / mib:,.0f} | {r['measured'] / mib:,.0f} | "
                  f"{r['measured'] / r['predicted']:.2f} | {r['largest']} | {bound} | {split} | {r['seconds']:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
