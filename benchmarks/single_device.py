"""shardlab's training loop vs a plain PyTorch loop written here, same model, one device.

    python benchmarks/single_device.py                       # CPU, configs/tiny.toml
    python benchmarks/single_device.py --config configs/gpt2-124m.toml --device cuda   # GPU (bf16, compile)

Both loops run in the same process, alternating in blocks (ABAB...) so that drift in machine
load hits both equally; the table reports the median step time of each and the tokens/s ratio
(shardlab / plain). Target: >= 0.97 on CPU, >= 1.0 on a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shardlab import config as C  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check validate runs)
from shardlab import launch  # noqa: E402
from shardlab.distributed.mesh import Mesh  # noqa: E402
from shardlab.distributed.topology import Topology  # noqa: E402
from shardlab.models import build_model  # noqa: E402
from shardlab.train.data import Loader, TokenData, prepare  # noqa: E402
from shardlab.train.loop import Trainer  # noqa: E402
from shardlab.train.metrics import flops_per_token, peak_flops  # noqa: E402
from shardlab.train.optim import lr_at  # noqa: E402


class PlainLoop:
    """The loop a PyTorch user writes: AdamW, autocast, clip, step. No shardlab code in the step."""

    def __init__(self, cfg, data, device):
        t = cfg.train
        self.cfg, self.device = cfg, device
        model = build_model(cfg.model, t.seed, device=device)
        self.model = torch.compile(model) if cfg.parallel.compile else model
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2]
        kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kw)
        self.loader = Loader(data, t.seq_len, t.global_batch, 1, 0, 1, t.seed, device)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.step = 0

    def train_step(self):
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.cfg.train)
        (x, y), = self.loader.next_batch()
        if self.dtype:
            with torch.autocast(self.device.type, dtype=self.dtype):
                loss = self.model(x, y)
        else:
            loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1


def _timed(step_fn, n, device):
    out = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def profile_steps(name, step_fn, n, device) -> str:
    """Where a loop's step time goes (``--profile-steps``): ``n`` steps under torch.profiler; the
    device's busy time (union of kernel intervals) per step against the wall time, host syncs per
    step, and the operators with the most device (CUDA) or CPU time."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    from shardlab.analysis.overlap import merge
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = sum(_timed(step_fn, n, device))
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        events = [e for e in json.loads(Path(fh.name).read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    busy = sum(b - a for a, b in merge((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"))
    syncs = sum(1 for e in events if "Synchronize" in e.get("name", "") or "DtoH" in e.get("name", ""))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return (f"## {name}: {1e3 * wall / n:.1f} ms/step wall, kernels busy {busy / 1e3 / n:.1f} ms/step, "
            f"{syncs / n:.1f} synchronisations or device-to-host copies per step\n"
            + prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))


def bench(ctx, cfgs, data_dir, blocks, per_block, warmup, prof_steps=0):
    """Each config of ``cfgs`` (the variants) as a shardlab Trainer, beside one plain loop (the
    first config's settings); all alternate in blocks. Returns the median step of each variant,
    then the plain loop's."""
    mesh = Mesh.build(Topology(), ctx.device)
    data = TokenData(data_dir)
    loops = [Trainer(c, mesh, data).train_step for c in cfgs] + [PlainLoop(cfgs[0], data, ctx.device).train_step]
    for step in loops:
        _timed(step, warmup, ctx.device)
    times = [[] for _ in loops]
    for _ in range(blocks):
        for t, step in zip(times, loops):
            t += _timed(step, per_block, ctx.device)
    if prof_steps:
        for k, step in enumerate(loops):
            name = "plain PyTorch" if k == len(cfgs) else f"shardlab, variant {k}"
            print(profile_steps(name, step, prof_steps, ctx.device), flush=True)
    block_medians = [[statistics.median(t[b * per_block:(b + 1) * per_block]) for b in range(blocks)] for t in times]
    return [statistics.median(t) for t in times], \
        (torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"), block_medians


def planner_line(cfg, kind: str, measured_tok_s: float) -> str:
    """The planner's tokens/s for this one-device run on ``kind`` (analysis/predict.py: bf16 or the
    config's precision, compile as configured) beside the measured shardlab loop: an own-hardware
    check of its compile, HBM and matmul terms (never a held-out row; docs/planner_validation.md)."""
    from shardlab.analysis.predict import predict
    pr = predict(cfg, kind, per_rank=False)
    err = (pr.tokens_per_s - measured_tok_s) / measured_tok_s
    return (f"planner on {kind} (compile {cfg.parallel.compile}): {pr.tokens_per_s:,.0f} tok/s predicted, "
            f"{measured_tok_s:,.0f} measured ({100 * err:+.1f}%)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--per-block", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the row as JSON here")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many steps of each loop: device busy time, syncs, top operators")
    ap.add_argument("--variants", default="",
                    help="';'-separated extra override sets, each a shardlab loop of its own measured beside "
                         "the default one, e.g. --variants='--parallel.compile_scope=blocks' (write it with =)")
    args, overrides = ap.parse_known_args(argv)
    sets = [[]] + [v.split() for v in args.variants.split(";") if v.strip()]
    cfgs = []
    for extra in sets:
        cfg = C.load(args.config, overrides + extra)
        cfg.train.device = args.device
        cfg.logging.progress = False
        cfg.validate(1)
        cfgs.append(cfg)
    cfg = cfgs[0]
    data_dir = str(prepare(cfg.data))
    (times, name, block_medians), = launch.run(bench, 1, cfgs, data_dir, args.blocks, args.per_block, args.warmup,
                                args.profile_steps, device=args.device)
    plain = times[-1]
    tokens = cfg.train.global_batch * cfg.train.seq_len
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    peak, label = peak_flops(torch.device(args.device), cfg.train.precision) if args.device != "cpu" else (None, "cpu")
    mfu = (lambda v: f"{100 * v:.1f}%" if v else "n/a")
    print("| config | device | precision | compile | variant | plain PyTorch tok/s | shardlab tok/s | ratio "
          "| ratio per block (min-max) | MFU plain / shardlab |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for k, (extra, ours) in enumerate(zip(sets, times[:-1])):
        spread = [p / o for p, o in zip(block_medians[-1], block_medians[k])]  # each block ran both loops in turn
        row = {"config": args.config, "device": name, "precision": cfg.train.precision, "compile": cfg.parallel.compile,
               "variant": " ".join(extra) or "default", "plain_tok_s": tokens / plain, "shardlab_tok_s": tokens / ours,
               "ratio": plain / ours, "plain_mfu": fpt * tokens / plain / peak if peak else None,
               "shardlab_mfu": fpt * tokens / ours / peak if peak else None, "block_ratios": spread}
        rows.append(row)
        print(f"| {Path(args.config).name} | {name} | {cfg.train.precision} | "
              f"{cfg.parallel.compile} | {row['variant']} | {row['plain_tok_s']:,.0f} | {row['shardlab_tok_s']:,.0f} | "
              f"{row['ratio']:.3f} | {min(spread):.3f}-{max(spread):.3f} | "
              f"{mfu(row['plain_mfu'])} / {mfu(row['shardlab_mfu'])} |")
    from shardlab.analysis.devices import gpu_kind
    kind = gpu_kind(name) if args.device == "cuda" else None
    if kind:
        print(planner_line(cfg, kind, rows[0]["shardlab_tok_s"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows if len(rows) > 1 else rows[0], indent=1))


if __name__ == "__main__":
    main()
