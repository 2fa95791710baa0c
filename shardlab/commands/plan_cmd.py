"""``shardlab plan MODEL --gpus N --gpu h100 [--gpus-per-node 8] [--global-batch B] [--seq S]``

Enumerates the valid layouts of MODEL (a config file, a preset name from configs/, or a Hugging
Face config.json) on the cluster, drops those that do not fit a device, ranks the rest by
predicted tokens/s and prints the top ones with the peak rank's memory breakdown, predicted
tokens/s per GPU and MFU, and why the winner wins (analysis/plan_search.py, docs/planner.md).
Degrees given on the command line (``--tp 8``) are fixed; an impossible one is refused naming
the field. When nothing fits, the smallest cluster that would is named.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..errors import ConfigError, at_least, output_file

GiB = 2**30


def configure(p):
    p.add_argument("model", help="config (.toml/.json), preset name from configs/ (e.g. llama-8b), or an HF config.json")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    p.add_argument("--gpu", default="h100", help="device kind: h100, h100-gt, h200, h800, a100")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the config's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the config's)")
    p.add_argument("--top", type=int, default=5, help="layouts to print")
    p.add_argument("--efficiency", choices=("stated", "fitted"), default="stated",
                   help="stated: the device constants only (default); fitted: compute-bound time also divided by "
                        "the one global efficiency fitted to published runs (devices.FITTED_EFFICIENCY, docs/planner.md)")
    p.add_argument("--plot", default="", help="save a memory-breakdown bar chart of the top layouts here (PNG)")
    for name in ("tp", "pp", "cp"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"fix parallel.{name}")
    p.add_argument("--zero", type=int, default=-1, help="fix parallel.zero_stage (0-3)")
    p.add_argument("--schedule", default="", help="fix parallel.pp_schedule")
    p.add_argument("--ac", default="", help="fix parallel.activation_checkpointing (none, selective, op, full)")
    p.add_argument("--pp-split", default=None, choices=("balanced", "ends"),
                   help="the pipeline layouts' split (parallel.pp_split): balanced (the search's default) or ends "
                        "(Llama 3's: the embedding and the head in stages of their own)")
    p.add_argument("--layout", default=None, help="evaluate one pinned layout instead of searching, written as the "
                   "table prints it: \"fsdp8 tp8sp pp8 interleaved:2 mb4x8 ac-full\" (analysis/plan_layout.py)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (fused elementwise work)")
    p.add_argument("--float8", action="store_true", help="Float8 linears (torchao, tensorwise): the blocks' GEMMs at the "
                   "device's fp8 peak, the scaling casts' passes (analysis/plan_features.py; H100/H200 only)")
    p.add_argument("--async-tp", action="store_true", help="asynchronous TP: the blocks' TP collectives in tp chunks "
                   "behind their matmuls (layouts with tpNsp)")
    p.add_argument("--dualpipe-overlap", action="store_true", help="DualPipe's F&B pairs overlap one chunk's expert "
                   "all-to-alls with the other's compute (DeepSeek-V3; analysis/plan_moe.py; epN with ppN dualpipe)")
    p.add_argument("--torch-cp", action="store_true", help="CP as PyTorch's context_parallel runs it (torchtitan): "
                   "K/V at the query heads gathered per call, fp32 merges and dK/dV (ring cpN layouts, GPUs; "
                   "Ulysses and unified CP stay shardlab's)")
    p.add_argument("--fsdp2", action="store_true", help="ZeRO-3 as PyTorch's FSDP2 (fully_shard) runs it: each gather's "
                   "copy-out and the reduce-scatter's copy-in on the compute stream (fsdpN layouts, GPUs)")
    p.add_argument("--foreach-adamw", action="store_true", help="the optimizer as torch.optim.AdamW(foreach=True) "
                   "and clip_grad_norm_ step it (torchtitan's default): one pass per foreach op (GPUs)")
    p.add_argument("--megatron-tp-overlap", action="store_true", help="Megatron-LM's backward TP collectives of the "
                   "column-parallel linears behind their GEMMs (tpN layouts, GPUs)")
    p.add_argument("--half-params", action="store_true", help="the weights stored in bf16/fp16 as Megatron-LM's "
                   "Float16Module keeps them, fp32 main weights in the optimizer: no per-micro-batch weight copies "
                   "(GPUs)")
    p.add_argument("--compile-blocks", action="store_true", help="with --compile: only the blocks compiled, as "
                   "torchtitan does; the embedding, head and loss priced eager")
    p.add_argument("--compare", default="", help="after the search, also evaluate this layout (e.g. a published "
                   "one, written as for --layout) and print it under the table")


def load_model(arg: str):
    """A Config whose model section is MODEL's."""
    from ..config import Config, load
    path = Path(arg)
    if not path.exists():
        preset = Path(__file__).resolve().parents[2] / "configs" / f"{arg}.toml"
        if not preset.exists():
            raise ConfigError("MODEL", f"{arg!r} is neither a file nor a preset in configs/; pass a config, "
                                       "an HF config.json or a preset name such as llama-8b")
        path = preset
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if "model_type" in data:  # a Hugging Face config.json
            from ..models.hf import model_config_from_hf
            cfg = Config()
            cfg.model = model_config_from_hf(data)
            cfg.train.precision = "bf16"
            return cfg
    from ..train.finetune import resolve_base
    cfg = load(path)
    resolve_base(cfg)  # a fine-tuning config's model is its checkpoint.base's
    return cfg


def _status_line(t0: float):
    """A progress callback for ``search``: one line on the terminal, redrawn at most twice a second."""
    last = [0.0]

    def show(valid: int, fit: int) -> None:
        now = time.perf_counter()
        if now - last[0] >= 0.5:
            last[0] = now
            sys.stderr.write(f"\r\033[Ksearching: {valid:,} valid layouts, {fit:,} fit so far ({now - t0:.0f} s)")
            sys.stderr.flush()
    return show


def main(args) -> int:
    from ..analysis.devices import FITTED_EFFICIENCY, get_device
    from ..analysis.plan_search import HEADROOM, search, smallest_cluster, why
    t0 = time.perf_counter()
    base = load_model(args.model)
    _check_counts(args)
    output_file(args.plot, "--plot")
    features = tuple(name for name in ("float8", "async_tp", "dualpipe_overlap", "torch_cp", "fsdp2", "compile_blocks",
                                       "foreach_adamw", "megatron_tp_overlap", "half_params")
                     if getattr(args, name, False))
    if args.gpu == "cpu":  # before the CPU's probe (a minute on a fresh machine) is measured
        from ..analysis.plan_features import refuse_on_cpu
        refuse_on_cpu(features)
    dev = get_device(args.gpu)  # unknown kinds refused, never guessed
    t = base.train
    t.precision = "bf16" if t.precision in ("fp32", "fp64") else t.precision
    if args.seq is not None:
        t.seq_len = args.seq
    base.model.max_seq_len = max(base.model.max_seq_len, t.seq_len)
    if args.global_batch is not None:
        t.global_batch = args.global_batch
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "cp") if getattr(args, k) is not None}
    if args.zero >= 0:
        fixed["zero"] = args.zero
    if args.schedule:
        fixed["schedule"] = args.schedule
    if args.ac:
        fixed["ac"] = args.ac
    if args.pp_split:
        fixed["pp_split"] = args.pp_split
    base.parallel.compile = base.parallel.compile or getattr(args, "compile", False)
    eta = FITTED_EFFICIENCY if getattr(args, "efficiency", "stated") == "fitted" else 1.0
    if getattr(args, "layout", None) is not None and not args.layout.strip():  # ran the whole search, silently
        raise ConfigError("--layout", "is empty; give a layout, e.g. --layout \"fsdp8 tp8 mb1x8\", or drop it to search")
    if getattr(args, "layout", ""):
        if fixed:
            raise ConfigError("--layout", f"give {', '.join('--' + k.replace('_', '-') for k in fixed)} inside --layout, not beside it")
        if getattr(args, "compare", ""):
            raise ConfigError("--compare", "goes with a search, not with --layout; drop one of them")
        return _pinned(base, args, dev, eta, t0, features)
    _check_fixed(base, args.gpus, fixed)
    status = _status_line(t0) if sys.stderr.isatty() else None
    fits, valid, dropped = search(base, args.gpus, args.gpu, args.gpus_per_node, fixed, eta, features, status)
    if status is not None:
        sys.stderr.write("\r\033[K")  # the status line gives way to the table
    print(f"{base.model.arch} {base.model.n_layers} layers d={base.model.d_model} on {args.gpus} x {dev.name} "
          f"({args.gpus_per_node} per node), global batch {t.global_batch} x seq {t.seq_len}: "
          f"{valid} valid layouts, {len(fits)} fit (search: {time.perf_counter() - t0:.1f} s wall)"
          + (f"; compute time / {eta:.3f} (--efficiency fitted)" if eta != 1.0 else ""))
    if not fits:
        n = smallest_cluster(base, args.gpus, args.gpu, args.gpus_per_node, fixed)
        where = f"the smallest cluster that fits is {n} GPUs" if n else "no cluster up to 2^20 GPUs fits"
        print(f"no layout fits: every one needs more than {HEADROOM:.0%} of {dev.memory / GiB:.0f} GiB "
              f"on some rank; {where} (try --gpus {n})" if n else f"no layout fits; {where}")
        _compare(base, args, dev, eta, features)
        return 1
    top = fits[:args.top]
    _print_rows(top, args.gpu)
    print("\n" + why(top[0], top[1:], valid, dropped))
    if tier_line(top[0].breakdown):
        print(tier_line(top[0].breakdown))
    _compare(base, args, dev, eta, features)
    if args.plot:
        plot(top, dev.memory * HEADROOM, args.plot)
        print(f"memory breakdown plot: {args.plot}")
    return 0


MEMORY_NOTE = "memory: allocated bytes at the peak rank's peak (as torch.cuda.max_memory_allocated counts them)"
RESERVED_NOTE = ("; 'reserved': what the caching allocator is predicted to hold, {ratio:.2f}x allocated (the median "
                 "of nine H100 measurements, docs/planner.md: a stated ratio, not a model of its segments); "
                 "the plan keeps allocated bytes within 92% of the device")


def _print_rows(cands, device: str = "") -> None:
    from ..analysis.predict import RESERVED_PER_ALLOCATED, reserved
    gpu = device not in ("", "cpu")
    print(MEMORY_NOTE + (RESERVED_NOTE.format(ratio=RESERVED_PER_ALLOCATED) if gpu else ""))
    labels = [getattr(c, "shown", "") or c.label() for c in cands]
    w = max([44] + [len(x) + 1 for x in labels])  # the longest label and a space
    print(f"{'#':>2} {'layout':<{w}}{'params':>8}{'grads':>7}{'optim':>7}{'act':>7}{'W':>6}{'buf':>6}{'trans':>7}"
          f"{'total GiB':>10}" + (f"{'reserved':>9}" if gpu else "") + f"{'tok/s/GPU':>11}{'MFU':>7}")
    for i, (c, label) in enumerate(zip(cands, labels), 1):
        m = c.memory
        print(f"{i:>2} {label:<{w}}" + "".join(f"{m[k] / GiB:>{n}.1f}" for k, n in
              (("params", 8), ("grads", 7), ("optim", 7), ("activations", 7), ("wgrad", 6), ("buffers", 6),
               ("transient", 7)))
              + f"{c.peak_bytes / GiB:>10.1f}" + (f"{reserved(c.peak_bytes, device) / GiB:>9.1f}" if gpu else "")
              + f"{c.tokens_per_gpu:>11,.0f}" + (f"{100 * c.mfu:>6.1f}%" if c.mfu else f"{'':>7}"))


def _pinned_row(base, args, layout: str, eta: float, features=()):
    """(candidate, prediction) of one layout written as for ``--layout``."""
    from ..analysis.plan_layout import parse_layout, predict_pinned
    from ..analysis.plan_search import Candidate
    cfg, pred = predict_pinned(base, parse_layout(layout), args.gpus, args.gpu, args.gpus_per_node, eta,
                               getattr(args, "compile", False), bool(args.global_batch), features)
    peak = pred.peak
    mem = {k: getattr(peak, k) for k in ("params", "grads", "optim", "activations", "buffers", "transient", "wgrad")}
    c = Candidate(cfg, mem, peak.total, pred.tokens_per_s / args.gpus, pred.mfu, pred.breakdown)
    if "layer_ac_share" in pred.breakdown:  # ac-layer runs as full on the config: show what was asked
        c.shown = c.label().replace("ac-full", "ac-layer")
    return c, pred


def _verdict(c, dev) -> str:
    from ..analysis.plan_search import HEADROOM, step_sentence
    cap = HEADROOM * dev.memory
    if c.peak_bytes > cap:
        return (f"does not fit: its peak rank needs {c.peak_bytes / GiB:.1f} GiB, more than "
                f"{HEADROOM:.0%} of {dev.memory / GiB:.0f} GiB ({cap / GiB:.1f} GiB)")
    return f"{getattr(c, 'shown', '') or c.label()} is predicted at {step_sentence(c)}"


def tier_line(bd: dict) -> str:
    """The expert all-to-all over two tiers (plan_moe.py), when the ep group spans nodes."""
    t = bd.get("ep_tiers") or {}
    if not t:
        return ""
    return (f"expert all-to-all over {t['N']} nodes x {t['L']} ranks: a token's experts on {t['nodes_hit']:.2f} nodes "
            f"on average; per pass and micro-batch {t['slow'] / 2**20:,.0f} MiB over the network, "
            f"{t['fast'] / 2**20:,.0f} MiB over NVLink; {bd['ep_comm']:.2f} s of all-to-all per step, "
            f"{bd['ep_exposed']:.2f} s exposed")


def _compare(base, args, dev, eta: float, features=()) -> None:
    """``--compare LAYOUT``: one more layout's row under the search's (a published layout)."""
    if not getattr(args, "compare", ""):
        return
    c, _ = _pinned_row(base, args, args.compare, eta, features)
    print(f"\ncompared (--compare {args.compare!r}):")
    _print_rows([c], args.gpu)
    print(_verdict(c, dev))
    if tier_line(c.breakdown):
        print(tier_line(c.breakdown))


def _pinned(base, args, dev, eta: float, t0: float, features=()) -> int:
    """``--layout``: the one layout's memory and time (exit 1 when it does not fit)."""
    from ..analysis.plan_search import HEADROOM
    c, pred = _pinned_row(base, args, args.layout, eta, features)
    t = c.cfg.train
    print(f"{base.model.arch} {base.model.n_layers} layers d={base.model.d_model} on {args.gpus} x {dev.name} "
          f"({args.gpus_per_node} per node), global batch {t.global_batch} x seq {t.seq_len}: the layout given "
          f"({time.perf_counter() - t0:.1f} s wall)" + (f"; compute time / {eta:.3f} (--efficiency fitted)" if eta != 1.0 else ""))
    _print_rows([c], args.gpu)
    if tier_line(c.breakdown):
        print(tier_line(c.breakdown))
    print("\n" + _verdict(c, dev).replace("its peak rank", f"its peak rank (pipeline stage {pred.peak.stage})"))
    return 1 if c.peak_bytes > HEADROOM * dev.memory else 0


def _check_counts(args) -> None:
    """Every count the command takes is at least 1 (``--zero`` 0-3, ``--top`` at least 1): one line
    naming the flag, exit 2, before anything is loaded or searched."""
    for flag in ("gpus", "gpus_per_node", "global_batch", "seq", "tp", "pp", "cp", "top"):
        if getattr(args, flag, None) is not None:
            at_least(getattr(args, flag), 1, "--" + flag.replace("_", "-"))
    gpus, per_node = args.gpus, args.gpus_per_node
    if gpus > per_node and gpus % per_node:  # a partial node: its links and placement are not modelled
        raise ConfigError("--gpus-per-node", f"--gpus {gpus} is not a whole number of nodes of {per_node}; "
                                             f"give --gpus {gpus + per_node - gpus % per_node} or a --gpus-per-node "
                                             f"that divides {gpus}")
    if not -1 <= getattr(args, "zero", -1) <= 3:
        raise ConfigError("--zero", f"must be 0, 1, 2 or 3 (parallel.zero_stage), got {args.zero}")


def _check_fixed(base, gpus: int, fixed: dict) -> None:
    """Refuse impossible user-fixed degrees with the field's own message (Config.validate)."""
    import copy
    from ..train import checks  # noqa: F401  (registers every config check validate runs)
    for name in ("tp", "pp", "cp"):
        if name in fixed and (fixed[name] < 1 or gpus % fixed[name]):
            raise ConfigError(f"parallel.{name}", f"{fixed[name]} does not divide --gpus {gpus}; "
                                                  f"choose a divisor of {gpus}")
    if not fixed:
        return
    cfg = copy.deepcopy(base)
    p = cfg.parallel
    for name in ("tp", "pp", "cp"):
        setattr(p, name, fixed.get(name, 1))
    if "zero" in fixed:
        p.zero_stage = fixed["zero"]
    if "schedule" in fixed:
        p.pp_schedule = fixed["schedule"]
    if "ac" in fixed:
        p.activation_checkpointing = fixed["ac"]
    p.dp_shard = gpus // (p.tp * p.pp * p.cp) if gpus % (p.tp * p.pp * p.cp) == 0 else 1
    p.microbatches = max(p.pp * (2 if p.pp_schedule in ("dualpipe", "dualpipev") else 1), 1)  # their minimum
    cfg.train.global_batch = p.dp_shard * p.microbatches * max(1, cfg.train.global_batch // (p.dp_shard * p.microbatches))
    cfg.validate(p.world_size)  # raises ConfigError naming the field (exit 2)


def plot(cands, capacity: float, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ("params", "grads", "optim", "activations", "wgrad", "buffers", "transient")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cands)), 4.5))
    bottom = [0.0] * len(cands)
    for k in keys:
        vals = [c.memory[k] / GiB for c in cands]
        ax.bar(range(len(cands)), vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(capacity / GiB, color="k", ls="--", lw=1, label="planned capacity")
    ax.set_xticks(range(len(cands)))
    ax.set_xticklabels([c.label().replace(" ", "\n") for c in cands], fontsize=7)
    ax.set_ylabel("GiB on the peak rank")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
