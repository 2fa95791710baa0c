"""Enumerate the layouts of a model on a cluster, drop those that do not fit, rank by predicted
tokens/s (``shardlab plan``). Validity is ``Config.validate``'s, never rules restated here; the
candidates and the pruning: docs/planner.md, "Planner"."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from ..errors import ConfigError

HEADROOM = 0.92
"""Fraction of a device's memory a layout may plan for (allocator fragmentation, CUDA context, NCCL)."""


@dataclass
class Candidate:
    cfg: object
    memory: dict            # peak rank's terms, bytes
    peak_bytes: float
    tokens_per_gpu: float
    mfu: float | None
    breakdown: dict

    def label(self) -> str:
        return layout_label(self.cfg)


def layout_label(cfg) -> str:
    p = cfg.parallel
    parts = []
    if p.dp_replicate > 1:
        parts.append(f"rep{p.dp_replicate}")
    if p.dp_shard > 1 or p.zero_stage:
        parts.append({0: "ddp", 1: "zero1-", 2: "zero2-", 3: "fsdp"}[p.zero_stage] + str(p.dp_shard))
    for name in ("tp", "cp", "ep"):
        if getattr(p, name) > 1:
            parts.append(f"{name}{getattr(p, name)}" + ("sp" if name == "tp" and p.sequence_parallel else "")
                         + ({"ulysses": "-ulysses", "unified": f"-unified{p.cp_ulysses}"}.get(p.cp_impl, "")
                            if name == "cp" else "")
                         + ("-hier" if name == "ep" and p.ep_dispatch == "hierarchical" else ""))
    if p.pp > 1:
        parts.append(f"pp{p.pp}:{p.pp_schedule}" + (f"v{p.pp_virtual}" if p.pp_virtual > 1 else ""))
        if p.pp_split != "balanced":
            parts.append(f"split-{p.pp_split}")
    mb = cfg.train.global_batch // p.dp // p.microbatches
    parts.append(f"mb{mb}x{p.microbatches}")
    if p.activation_checkpointing != "none":
        parts.append(f"ac-{p.activation_checkpointing}")
    return " ".join(parts) or "single"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def enumerate_layouts(base, gpus: int, gpus_per_node: int, fixed: dict | None = None, state_fits=None):
    """Yield validated configs (copies of ``base`` with the parallel section filled in);
    ``state_fits(cfg)``: False drops a (degrees, engine, schedule) group before its micro-batch
    and recomputation variants are built."""
    from ..train import checks  # noqa: F401  (registers every config check validate runs)
    fixed = fixed or {}
    m, t = base.model, base.train
    tps = [fixed["tp"]] if "tp" in fixed else [d for d in divisors(gpus) if d <= gpus_per_node]
    for tp in tps:
        rest = gpus // tp if gpus % tp == 0 else 0
        pps = [fixed["pp"]] if "pp" in fixed else [d for d in divisors(rest) if d <= m.n_layers] if rest else []
        for pp in pps:
            cps = [fixed["cp"]] if "cp" in fixed else [c for c in _pow2(8) if rest % (pp * c) == 0]
            for cp in cps:
                if rest % (pp * cp):
                    continue
                dp = rest // (pp * cp)
                for zero, rep, cp_impl, ep in _dp_options(dp, tp, cp, pp, gpus_per_node, fixed, m):
                    for sched, v in _schedules(pp, m.n_layers, fixed, zero):
                        outer = None
                        for mbs in ([fixed["mb"]] if "mb" in fixed else [1, 2, 4, 8]):
                            if t.global_batch % (dp * mbs):
                                continue
                            micro = t.global_batch // (dp * mbs)
                            if pp > 1 and (micro < pp or micro > 512):
                                continue
                            for ac in ([fixed["ac"]] if "ac" in fixed else ["none", "selective", "op", "full"]):
                                cfg = copy.deepcopy(base)
                                p = cfg.parallel
                                p.tp, p.pp, p.cp, p.zero_stage = tp, pp, cp, zero
                                p.cp_impl, p.ep = cp_impl, ep
                                p.cp_ulysses = 2 if cp_impl == "unified" else 1
                                p.dp_replicate, p.dp_shard = rep, dp // rep
                                p.pp_schedule, p.pp_virtual, p.microbatches = sched, v, micro
                                p.pp_split = fixed.get("pp_split", "balanced") if pp > 1 else "balanced"
                                p.activation_checkpointing = ac
                                p.sequence_parallel = tp > 1 and t.seq_len % tp == 0 and not m.n_experts
                                try:
                                    cfg.validate(gpus)
                                except ConfigError:
                                    continue
                                if outer is None:  # model state does not depend on mb or ac: check once
                                    outer = state_fits is None or state_fits(cfg)
                                if not outer:
                                    break
                                yield cfg
                            if outer is False:
                                break


def _dp_options(dp, tp, cp, pp, gpn, fixed, model):
    """(zero stage, dp_replicate, cp_impl, ep). Inside pipeline stages ZeRO-2 is ZeRO-1 (one
    gradient reduction per step either way, pipeline/sharded.py), so it is not enumerated."""
    zs = [fixed["zero"]] if "zero" in fixed else ([0, 1, 3] if pp > 1 else [0, 1, 2, 3])
    impls = ["ring"] if cp == 1 else ["ring", "ulysses"] + (["unified"] if cp >= 4 else [])
    eps = [1] if not model.n_experts else [e for e in _pow2(model.n_experts)
                                           if (dp * cp) % e == 0 and model.n_experts % e == 0]
    for z in zs:
        for impl in impls:
            for ep in eps:
                yield z, 1, impl, ep
                inner = gpn // (tp * cp) if gpn % (tp * cp) == 0 else 0
                if z == 3 and inner > 1 and dp % inner == 0 and dp > inner:
                    yield z, dp // inner, impl, ep  # HSDP: shard inside a node, replicate across nodes


def _schedules(pp, layers, fixed, zero=0):
    if pp == 1:
        return [("1f1b", 1)]
    names = [fixed["schedule"]] if "schedule" in fixed else \
        ["1f1b", "interleaved", "zb-h1", "dualpipev"] + (["dualpipe"] if zero == 0 else [])
    out = []
    for s in names:
        if s == "interleaved":  # uneven splits allowed: the engine balances stages by parameters
            out += [(s, v) for v in (2, 4) if layers >= pp * v]
        else:
            out.append((s, 1))
    return out


def evaluate(cfg, device: str, gpus_per_node: int, capacity: float, efficiency: float = 1.0, features=()):
    """A Candidate, or None when the layout does not fit (model state first, then all terms).
    ``features``: predict's, where they apply to the layout (plan_features.applicable)."""
    from .plan_features import applicable
    from .predict import predict
    p = cfg.parallel
    if not state_fits(cfg, capacity):
        return None
    pred = predict(cfg, device, gpus_per_node=gpus_per_node, per_rank=False, efficiency=efficiency,
                   features=applicable(cfg, features))
    peak = pred.peak
    if peak.total > capacity:
        return None
    gpus = p.world_size
    mem = {k: getattr(peak, k) for k in ("params", "grads", "optim", "activations", "buffers", "transient", "wgrad")}
    return Candidate(cfg, mem, peak.total, pred.tokens_per_s / gpus, pred.mfu, pred.breakdown)


def state_fits(cfg, capacity: float) -> bool:
    from .plan_memory import model_state
    worst = max(sum(model_state(cfg, r)[k] for k in ("params", "grads", "optim")) for r in _edge_ranks(cfg.parallel.pp))
    return worst <= capacity


def _edge_ranks(pp: int) -> list[int]:
    return sorted({0, pp - 1})


def search(base, gpus: int, device: str, gpus_per_node: int = 8, fixed: dict | None = None,
           efficiency: float = 1.0, features=(), progress=None):
    """(ranked candidates that fit, number of valid layouts, number dropped for memory). A layout
    with recomputation is not evaluated when the same layout without it fits (it cannot be
    faster); it still counts as valid. ``features``: float8 / async_tp priced (plan_features);
    ``progress(valid, fit)``, if given, is called after every valid layout (the CLI's status line)."""
    from .devices import get_device
    capacity = HEADROOM * get_device(device).memory
    fits, valid, dropped = [], 0, 0
    fit_without_ac = set()
    for cfg in enumerate_layouts(base, gpus, gpus_per_node, fixed, lambda c: state_fits(c, capacity)):
        valid += 1
        key = _without_ac(cfg)
        # a layout whose twin without recomputation fits is dominated (recomputation only adds
        # time, plan_time): counted as valid, not evaluated
        if key not in fit_without_ac:
            c = evaluate(cfg, device, gpus_per_node, capacity, efficiency, features)
            if c is not None and cfg.parallel.activation_checkpointing == "none":
                fit_without_ac.add(key)
            if c is None:
                dropped += 1
            else:
                fits.append(c)
        if progress is not None:
            progress(valid, len(fits))
    fits.sort(key=lambda c: -c.tokens_per_gpu)
    return fits, valid, dropped


def _without_ac(cfg) -> tuple:
    d = dict(vars(cfg.parallel))
    d.pop("activation_checkpointing")
    return tuple(sorted((k, str(v)) for k, v in d.items()))


def smallest_cluster(base, gpus: int, device: str, gpus_per_node: int, fixed=None, limit: int = 1 << 20):
    """The smallest GPU count (gpus x 2^k) with a layout that fits, or None up to ``limit``."""
    n = gpus * 2
    while n <= limit:
        b = copy.deepcopy(base)
        b.train.global_batch = max(b.train.global_batch, n)  # at least one sequence per data-parallel rank
        b.train.global_batch = n * ((b.train.global_batch + n - 1) // n)
        quick = dict(fixed or {}, ac="full", mb=1)
        if any(evaluate(c, device, gpus_per_node, HEADROOM * _capacity(device)) is not None
               for c in itertools.islice(enumerate_layouts(b, n, gpus_per_node, quick), 4000)):
            return n
        n *= 2
    return None


def _capacity(device: str) -> float:
    from .devices import get_device
    return get_device(device).memory


def step_sentence(c: Candidate) -> str:
    """'N tokens/s per GPU (MFU): of its step, compute, exposed communication, bubble (ZeRO-3's
    copies where priced) and optimizer.'"""
    b = c.breakdown
    return (f"{c.tokens_per_gpu:,.0f} tokens/s per GPU" + (f" (MFU {100 * c.mfu:.1f}%)" if c.mfu else "")
            + f": of its {b['step_s']:.3f} s step, {b['compute']:.3f} s is compute ({b['recompute']:.3f} s of it "
            f"recomputation), {b['exposed_comm']:.3f} s exposed communication, {b['bubble']:.3f} s pipeline bubble"
            + (f", {b['copies']:.3f} s FSDP copies" if b.get("copies") else "")
            + f" and {b['optimizer']:.3f} s optimizer step.")


def why(best: Candidate, others: list[Candidate], valid: int, dropped: int) -> str:
    """One paragraph: what the winner gains over the runner-up, from the time breakdown."""
    b = best.breakdown
    text = f"{best.label()} is predicted fastest at {step_sentence(best)} "
    if others:
        o = others[0]
        ob = o.breakdown
        diffs = []
        for key, name in (("exposed_comm", "exposed communication"), ("bubble", "bubble"),
                          ("recompute", "recomputation"), ("compute", "compute")):
            d = ob[key] - b[key]
            if abs(d) > 0.02 * b["step_s"]:
                diffs.append(f"{abs(d):.3f} s {'less' if d > 0 else 'more'} {name}")
        text += (f"The runner-up, {o.label()}, reaches {o.tokens_per_gpu:,.0f}; the winner spends "
                 + (", ".join(diffs) if diffs else "about the same time in every term") + " per step. ")
    text += (f"{valid} valid layouts were considered and {dropped} dropped because a rank would need more "
             f"than {HEADROOM:.0%} of the device memory.")
    return text
