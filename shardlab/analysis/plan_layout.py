"""One pinned layout, written as ``shardlab plan`` prints it (``--layout``), e.g.
``fsdp8 tp8sp pp8 interleaved:2 mb4x8 ac-full``; the parts and their refusals: docs/planner.md,
"One pinned layout"."""
from __future__ import annotations

import copy
import re

from ..errors import ConfigError

SCHEDULES = ("1f1b", "gpipe", "zb-h1", "dualpipev", "dualpipe", "interleaved")
AC_MODES = ("none", "selective", "op", "full")
SPLITS = ("balanced", "ends")
_DP = re.compile(r"^(fsdp|ddp|zero1-|zero2-)(\d+)$")
_PARTS = [
    (re.compile(r"^rep(\d+)$"), "rep"),
    (re.compile(r"^tp(\d+)(sp)?$"), "tp"),
    (re.compile(r"^cp(\d+)(?:-(ulysses)|-(unified)(\d+))?$"), "cp"),
    (re.compile(r"^ep(\d+)(?:-(hier|exact|padded))?$"), "ep"),
    (re.compile(r"^pp(\d+)(?::([a-z0-9-]+?)(?:v(\d+))?)?$"), "pp"),
    (re.compile(r"^(1f1b|gpipe|zb-h1|dualpipev|dualpipe|interleaved)(?::(\d+))?$"), "schedule"),
    (re.compile(r"^split-([a-z]+)$"), "split"),
    (re.compile(r"^mb(\d+)x(\d+)$"), "mb"),
    (re.compile(r"^ac-([a-z]+)$"), "ac"),
]
HELP = ("write it as shardlab plan prints layouts, e.g. \"fsdp8 tp8sp pp8 interleaved:2 mb4x8 ac-full\" "
        "(parts: fsdpN ddpN zero1-N zero2-N repN tpN[sp] cpN[-ulysses] epN[-hier] ppN SCHEDULE[:V] split-ends "
        "mbBxM ac-MODE)")


def _bad(part: str, fix: str) -> ConfigError:
    return ConfigError("--layout", f"{part!r}: {fix}")


def parse_layout(text: str) -> dict:
    """The settings ``text`` names: {zero, dp, rep, tp, sp, cp, cp_impl, cp_ulysses, ep, pp,
    schedule, virtual, mb, micro, ac} (absent keys: not given)."""
    out: dict = {}
    if not text.strip():
        raise ConfigError("--layout", f"empty; {HELP}")
    for part in text.split():
        m = _DP.match(part)
        if m:
            _once(out, "dp", part)
            out["zero"] = {"fsdp": 3, "ddp": 0, "zero1-": 1, "zero2-": 2}[m.group(1)]
            out["dp"] = _positive(m.group(2), part)
            continue
        for rx, kind in _PARTS:
            m = rx.match(part)
            if m:
                _set(out, kind, m, part)
                break
        else:
            raise _bad(part, f"not a layout part; {HELP}")
    return out


def _once(out: dict, key: str, part: str) -> None:
    if key in out:
        raise _bad(part, f"{key} is given twice; name each part once")


def _positive(s: str, part: str) -> int:
    n = int(s)
    if n < 1:
        raise _bad(part, "degrees and counts are >= 1")
    return n


def _set(out: dict, kind: str, m, part: str) -> None:
    if kind == "rep":
        _once(out, "rep", part)
        out["rep"] = _positive(m.group(1), part)
    elif kind == "tp":
        _once(out, "tp", part)
        out["tp"], out["sp"] = _positive(m.group(1), part), bool(m.group(2))
    elif kind == "cp":
        _once(out, "cp", part)
        out["cp"] = _positive(m.group(1), part)
        out["cp_impl"] = "ulysses" if m.group(2) else "unified" if m.group(3) else "ring"
        out["cp_ulysses"] = _positive(m.group(4), part) if m.group(3) else 1
    elif kind == "ep":
        _once(out, "ep", part)
        out["ep"] = _positive(m.group(1), part)
        if m.group(2):
            out["ep_dispatch"] = {"hier": "hierarchical"}.get(m.group(2), m.group(2))
    elif kind == "pp":
        _once(out, "pp", part)
        out["pp"] = _positive(m.group(1), part)
        if m.group(2):
            _schedule(out, m.group(2), m.group(3), part)
    elif kind == "schedule":
        _schedule(out, m.group(1), m.group(2), part)
    elif kind == "split":
        _once(out, "split", part)
        if m.group(1) not in SPLITS:
            raise _bad(part, f"the pipeline split is one of {', '.join('split-' + s for s in SPLITS)}")
        out["split"] = m.group(1)
    elif kind == "mb":
        _once(out, "mb", part)
        out["mb"], out["micro"] = _positive(m.group(1), part), _positive(m.group(2), part)
    elif kind == "ac":
        _once(out, "ac", part)
        if m.group(1) not in AC_MODES + ("fit", "layer"):
            raise _bad(part, f"recomputation is one of {', '.join('ac-' + a for a in AC_MODES + ('fit', 'layer'))}")
        out["ac"] = m.group(1)


def _schedule(out: dict, name: str, v, part: str) -> None:
    _once(out, "schedule", part)
    if name not in SCHEDULES:
        raise _bad(part, f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")
    if v is not None and name != "interleaved":
        raise _bad(part, "virtual stages (:V) go with the interleaved schedule only")
    out["schedule"] = name
    out["virtual"] = _positive(v, part) if v is not None else (2 if name == "interleaved" else 1)


def apply_layout(base, spec: dict, gpus: int, compile_: bool = False, batch_given: bool = False):
    """A validated copy of ``base`` with the parallel section of ``spec`` (parse_layout's) on
    ``gpus`` ranks. With ``mb``, the global batch is mb x micro x dp (refused when it differs from
    ``base.train.global_batch`` and ``batch_given``: the user set both). ``ac`` 'fit' is left as
    none. ``compile_``: parallel.compile on."""
    from ..train import checks  # noqa: F401  (registers every config check validate runs)
    cfg = copy.deepcopy(base)
    p, t = cfg.parallel, cfg.train
    p.tp, p.cp, p.pp, p.ep = spec.get("tp", 1), spec.get("cp", 1), spec.get("pp", 1), spec.get("ep", 1)
    p.ep_dispatch = spec.get("ep_dispatch", p.ep_dispatch)
    p.sequence_parallel = spec.get("sp", False)
    p.cp_impl, p.cp_ulysses = spec.get("cp_impl", "ring"), spec.get("cp_ulysses", 1)
    p.zero_stage = spec.get("zero", 0)
    rep = spec.get("rep", 1)
    if rep > 1 and p.zero_stage != 3:
        raise _bad(f"rep{rep}", "replicas (HSDP) go with an fsdpN part")
    p.dp_replicate = rep
    model_par = p.tp * p.cp * p.pp * rep
    if "dp" in spec:
        p.dp_shard = spec["dp"]
    elif gpus % model_par == 0:
        p.dp_shard = gpus // model_par  # the rest of the GPUs: plain data parallel
    world = p.dp_shard * model_par
    if world != gpus:
        raise ConfigError("--layout", f"its degrees multiply to {world} ranks, not --gpus {gpus}; "
                                      f"change a degree or --gpus")
    sched = spec.get("schedule", "1f1b")
    if p.pp == 1 and sched != "1f1b":
        raise _bad(sched, "a schedule needs a ppN part (pipeline stages >= 2)")
    p.pp_schedule, p.pp_virtual = sched, spec.get("virtual", 1)
    p.pp_split = spec.get("split", "balanced")
    if "mb" in spec:
        gb = spec["mb"] * spec["micro"] * p.dp
        if t.global_batch != gb and batch_given:
            raise _bad(f"mb{spec['mb']}x{spec['micro']}", f"{spec['mb']} x {spec['micro']} x dp {p.dp} = {gb} "
                                                           f"sequences, not --global-batch {t.global_batch}; "
                                                           "make them agree or drop one")
        t.global_batch, p.microbatches = gb, spec["micro"]
    else:
        p.microbatches = max(p.pp if p.pp > 1 else 1, 1)
        if t.global_batch % (p.dp * p.microbatches):
            raise ConfigError("--layout", f"global batch {t.global_batch} does not split into {p.microbatches} "
                                          f"micro-batches on {p.dp} data-parallel ranks; add an mbBxM part")
    ac = spec.get("ac", "none")
    p.activation_checkpointing = {"fit": "none", "layer": "full"}.get(ac, ac)  # ac-fit, ac-layer: predict_pinned
    p.compile = bool(compile_ or p.compile)
    try:
        return cfg.validate(gpus)
    except ConfigError as e:
        raise ConfigError("--layout", f"{e.field}: {e.detail}") from None


def predict_pinned(base, spec: dict, gpus: int, device: str, gpus_per_node: int | None = None,
                   efficiency: float = 1.0, compile_: bool = False, batch_given: bool = False, features=()):
    """(config, prediction) of one pinned layout. ``ac-fit``: the lightest recomputation (none,
    selective, op, full) whose peak rank fits plan_search.HEADROOM of the device; full when none
    does. ``features``: predict's (float8, async_tp, selective_layer_ac)."""
    from .devices import get_device
    from .plan_search import HEADROOM
    from .predict import predict
    cap = HEADROOM * get_device(device).memory
    modes = AC_MODES if spec.get("ac") == "fit" else (spec.get("ac", "none"),)
    if spec.get("ac") == "layer":  # every 2nd block fully recomputed (plan_features.layer_ac_blocks)
        features = tuple(features) + ("selective_layer_ac",)
    for ac in modes:
        cfg = apply_layout(base, {**spec, "ac": ac}, gpus, compile_, batch_given)
        pred = predict(cfg, device, gpus_per_node=gpus_per_node, per_rank=False, efficiency=efficiency,
                       features=features)
        if pred.peak.total <= cap:
            break
    return cfg, pred


def refused(features) -> list[str]:
    """The names in ``features`` the planner does not model (plan_features.MODELLED; unknown
    names included): a run that used one is refused by name, never predicted without it."""
    from .plan_features import MODELLED
    return [f for f in features if f not in MODELLED]
