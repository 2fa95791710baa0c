"""Per-rank memory of a layout, before launch: model state as the engines allocate it,
activations as autograd saves them, communication buffers and the largest transient.

Model state (bytes; the categories of ``analysis.memory.measure``, so a measured run compares to
the byte). The rank's parameters come from :func:`shadow.local_model` (TP/EP slices, pipeline
split, LoRA adapters); then, per engine:

  plain / pipeline (DDP on top)  params P*psi, grads P*trainable, optim 2*P*trainable (AdamW m, v)
  DDP (zero_stage 0)             the same; gradient buckets in ``train.reduce_dtype`` if set
  ZeRO-1/2                       flat buffers (``ddp.make_buckets`` per weight-decay group) padded
                                 to a multiple of N = dp*cp (expert weights: N = edp, buffers of
                                 their own, zero.shard_groups): params = padded buffers (low dtype with
                                 ``train.param_dtype``, then + an fp32 master slice in optim), grads
                                 = padded buffers (ZeRO-1) or one slice per buffer (ZeRO-2),
                                 optim = 2 slices (m, v)
  ZeRO-3 / FSDP                  one flat buffer per unit (``wrap_policy``) and weight-decay group,
                                 padded to N = dp_shard*cp (experts: edp): shard, gradient shard, m
                                 and v; the shard counts as optimizer state (a master) when the
                                 gathered dtype differs
  ZeRO inside pipeline stages    pipeline/sharded.py: one flat buffer per weight-decay group of the
                                 rank's stages; ZeRO-1/2 keep it whole, ZeRO-3 its slice; gradient,
                                 m, v slices; the whole gradient (and ZeRO-3's gathered stage) are
                                 buffers during the step

P is the parameter element size (fp64 runs 8, else 4). Frozen parameters (a LoRA base) are held
whole on every rank and take no gradient or optimizer state.

Activations: plan_activations.py.
"""
from __future__ import annotations

import functools
import json
import math

import torch

ELEM = {"fp64": 8}
LOW = {"bf16": 2, "fp16": 2, "fp32": 4}


def param_elem(cfg, device: str = "cpu") -> int:
    """Bytes per element of the parameters the engines store (train/optim.param_dtype)."""
    return ELEM.get(cfg.train.precision, 4)


def act_dtype(cfg, device: str = "cpu"):
    """Activation dtype of a trace: the parameters' on CPU runs; bf16 when a GPU run computes in
    bf16 (autocast or FSDP's gathered bf16 parameters)."""
    if cfg.train.precision == "fp64":
        return torch.float64
    if device != "cpu" and cfg.train.precision in ("bf16", "fp16"):
        return torch.bfloat16
    return torch.float32


@functools.lru_cache(maxsize=256)
def _local_inventory(key: str, cfg_json: str, pp_rank: int):
    from ..config import from_dict
    from ..models.spec import get_spec
    from .shadow import local_model
    from ..distributed.topology import Topology
    cfg = from_dict(json.loads(cfg_json))
    topo = Topology.from_config(cfg.parallel)
    model = local_model(cfg, topo.rank(pp=pp_rank))
    spec = get_spec(cfg.model)
    return model, spec


def _canonical(cfg) -> str:
    """The config fields a rank's local model depends on (TP, EP, the pipeline split, LoRA):
    data-parallel and context degrees are normalised away so that layouts share one build."""
    d = {k: v for k, v in cfg.to_dict().items() if k in ("model", "parallel", "train")}
    par = d["parallel"]
    par.update(dp_replicate=1, dp_shard=par["ep"], cp=1, cp_ulysses=1, zero_stage=0, microbatches=max(par["pp"], 1))
    if par["pp_schedule"] == "interleaved":
        par["microbatches"] = par["pp"]
    if par["pp_schedule"] in ("dualpipe", "dualpipev"):
        par["microbatches"] = 2 * par["pp"]
    d["train"] = {k: d["train"][k] for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "precision")}
    return json.dumps(d, sort_keys=True)


def local_model_for(cfg, pp_rank: int):
    """(the rank's local model, spec). With pp > 1 the unsplit model (one build per TP/EP/LoRA
    shape, shared by every pipeline degree and schedule) is filtered to the parameters the
    rank's stages keep: the layers of its stages (``shadow.stage_ranges`` and the schedule's
    ``rank_of``, as ``stage.split_model`` keeps them) and the first/last modules if it owns the
    stage starting at layer 0 / ending at the last layer."""
    if cfg.parallel.pp == 1:
        cfg_json = _canonical(cfg)
        return _local_inventory(cfg_json, cfg_json, pp_rank)
    import copy
    from .plan_pipeline import layout
    from .shadow import stage_ranges
    flat = copy.deepcopy(cfg)
    flat.parallel.pp, flat.parallel.pp_virtual, flat.parallel.pp_schedule = 1, 1, "1f1b"
    cfg_json = _canonical(flat)
    model, spec = _local_inventory(cfg_json, cfg_json, 0)
    ranges, owner = stage_ranges(cfg), layout(cfg).rank_of
    end = max(r.stop for r in ranges)
    mine = [r for s, r in enumerate(ranges) if owner(s) == pp_rank]
    layers = {f"layers.{i}." for r in mine for i in r}
    ends = (tuple(spec.pp_first or ()) if any(r.start == 0 for r in mine) else ()) \
        + (tuple(spec.pp_last) if any(r.stop == end for r in mine) else ())
    ends = tuple(f"{n}." for n in ends)
    kept = [(n, q) for n, q in model.named_parameters()
            if (n.startswith("layers.") and n[:n.index(".", 7) + 1] in layers) or n.startswith(ends)]
    return _Kept(kept), spec


class _Kept:
    """The parameters a pipeline rank keeps, as (global name, meta parameter) pairs."""

    def __init__(self, named):
        self._named = named

    def named_parameters(self):
        return iter(self._named)


def _fast_key(cfg, *extra) -> tuple:
    """A cheap hashable key of what the memory terms depend on (the planner evaluates thousands)."""
    p, t = cfg.parallel, cfg.train
    return (tuple(sorted(vars(cfg.model).items())), t.lora_rank, t.lora_alpha, tuple(t.lora_targets), t.precision,
            t.param_dtype, t.reduce_dtype, t.weight_decay, t.seq_len, p.tp, p.pp, p.pp_virtual, p.ep, p.zero_stage,
            p.dp_replicate, p.dp_shard, p.cp, p.bucket_cap_mb, p.wrap_policy, p.prefetch, p.reshard_after_forward,
            p.sequence_parallel,
            p.pp_schedule, p.cp_impl, p.cp_ulysses, p.ep_dispatch,
            t.global_batch // p.dp // p.microbatches) + extra


_STATE: dict = {}


def model_state(cfg, pp_rank: int = 0) -> dict:
    """Cached :func:`compute_model_state`."""
    key = _fast_key(cfg, pp_rank)
    if key not in _STATE:
        _STATE[key] = compute_model_state(cfg, pp_rank)
    return dict(_STATE[key])


def compute_model_state(cfg, pp_rank: int = 0) -> dict:
    """{params, grads, optim, buffers}: bytes of the rank's model state and its data-parallel
    engine's communication buffers (FSDP: the gathered units in flight; ZeRO-2: one staging bucket)."""
    from ..parallel.ddp import make_buckets
    model, spec = local_model_for(cfg, pp_rank)
    p, t = cfg.parallel, cfg.train
    el = param_elem(cfg)
    named = [(n, q) for n, q in model.named_parameters()]
    train = [(n, q) for n, q in named if q.requires_grad]
    frozen = sum(q.numel() for _, q in named if not q.requires_grad) * el
    psi_t = sum(q.numel() for _, q in train)
    out = {"params": 0.0, "grads": 0.0, "optim": 0.0, "buffers": 0.0}
    if p.pp > 1 and p.zero_stage:
        return _stage_sharded(cfg, train, frozen, el, out)
    if p.pp > 1 or p.zero_stage == 0:
        gel = LOW.get(t.reduce_dtype, el) if (p.pp == 1 and p.dp * p.cp > 1 and p.tp == 1) else el
        out.update(params=frozen + psi_t * el, grads=psi_t * gel, optim=2 * psi_t * el,
                   opt_transient=step_transient(psi_t * el, max((q.numel() for _, q in train), default=0) * el))
        if p.dp * p.cp == 1 or p.pp > 1:  # p.grad kept as autograd made it: kv heads copied over tp
            out["grads"] += _copied_grad_extra(train, el)  # (tp > n_kv_heads) are views of n_slots x
        if p.pp > 1:  # receive buffers posted ahead (engine.lookahead + 1 activations)
            b = t.global_batch // p.dp // p.microbatches
            out["buffers"] = 3 * b * (t.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)) \
                * cfg.model.d_model * act_dtype(cfg).itemsize
        return out
    from ..distributed.topology import Topology
    topo = Topology.from_config(p)
    if p.zero_stage in (1, 2):  # expert weights in buffers of their own over edp (zero.shard_groups)
        low = LOW.get(t.param_dtype) if t.param_dtype in ("bf16", "fp16") else None
        fel = low or el
        out["params"] = frozen
        cap = p.bucket_cap_mb * 2**20
        biggest = largest_shard = 0
        for n, group in _flat_groups(train, "dp_cp", topo, t.weight_decay):
            for bucket in make_buckets([q for _, q in group], cap):
                total = sum(q.numel() for q in bucket)
                shard = max(1, math.ceil(total / n))
                padded = shard * n
                biggest, largest_shard = max(biggest, padded), max(largest_shard, shard)
                out["params"] += padded * fel
                out["grads"] += (padded if p.zero_stage == 1 else shard) * fel
                out["optim"] += 2 * shard * el + (shard * el if low else 0)
        if p.zero_stage == 2:
            out["buffers"] = 2 * biggest * fel  # the bucket being filled and the one reduce-scattering
        out["opt_transient"] = step_transient(out["optim"] / (3 if low else 2), largest_shard * el)
        return out
    from ..parallel.fsdp import wrap_policy
    units = wrap_policy(model, p.wrap_policy, spec)
    compute = LOW.get(t.param_dtype) or (2 if t.precision in ("bf16", "fp16") else None)
    master = compute is not None and compute != el
    out["params"] = frozen
    gathered, reduce_total, largest_shard = [], 0, 0
    for prefix in [""] + units:
        mod = model.get_submodule(prefix) if prefix else model
        seen, mine = set(), []
        for name, q in mod.named_parameters(prefix=prefix, remove_duplicate=False):
            owner = next((u for u in units if u != prefix and name.startswith(u + ".")), None)
            if owner is None and id(q) not in seen and q.requires_grad:
                seen.add(id(q))
                mine.append((name, q))
        unit_bytes = 0
        for n, group in _flat_groups(mine, "dp_shard_cp", topo, t.weight_decay):
            reduce_total += max(1, math.ceil(sum(q.numel() for _, q in group) / n)) * n * (LOW.get(t.reduce_dtype) or el)
            total = sum(q.numel() for _, q in group)
            shard = max(1, math.ceil(total / n))
            largest_shard = max(largest_shard, shard)
            out["optim" if master else "params"] += shard * el
            out["grads"] += shard * el
            out["optim"] += 2 * shard * el
            unit_bytes += shard * n * (compute or el)
        gathered.append(unit_bytes)
    root, rest = gathered[0], sorted(gathered[1:], reverse=True)
    # the unit computing and the one prefetched; none is on the shared-memory transport, whose
    # all-gathers complete when issued (fsdp.FSDPEngine.background)
    in_flight = 2 if p.prefetch and not inline_transport(cfg) else 1
    out["buffers"] = root + sum(rest[:in_flight])
    if not p.reshard_after_forward:  # every unit stays gathered from its forward to its backward
        out["buffers"] = float(sum(gathered))
    # A unit's backward: its flat gradient (fsdp._Piece writes each parameter's into it as autograd
    # makes it: the unit's largest parameter gradient exists twice for a moment), its cast when
    # reduce_dtype differs, and on an asynchronous transport the previous unit's flat gradient,
    # still being reduce-scattered (the shared-memory transport's runs inline and is freed at once).
    big = max(gathered[1:] or gathered)
    cast = big / (compute or el) * (LOW.get(t.reduce_dtype) or el) if (LOW.get(t.reduce_dtype) or el) != (compute or el) else 0
    largest_param = max((q.numel() for _, q in train), default=0) * (compute or el)
    out["bwd_transient"] = 2 * big + cast
    out["bwd_transient_inline"] = big + cast + largest_param
    out["largest_unit"] = float(big)
    out["opt_transient"] = step_transient(out["grads"], largest_shard * el)
    out["gathered_total"], out["reduce_total"] = float(sum(gathered)), float(reduce_total)
    out["units"] = float(len(gathered))
    return out


def _flat_groups(named, dense: str, topo, weight_decay: float):
    """(shard group size, parameters) of every flat buffer group the engines build: expert
    weights over ``edp``, the rest over ``dense`` (zero.shard_groups), each split by weight decay."""
    from ..parallel.zero import decay_groups, shard_groups
    for gname, by_group in shard_groups(named, dense):
        for group, _ in decay_groups(by_group, weight_decay):
            yield topo.size(gname), group


def _stage_sharded(cfg, train, frozen: float, el: int, out: dict) -> dict:
    """ZeRO-1/2/3 inside pipeline stages (pipeline/sharded.py): one flat buffer per weight-decay
    group of the rank's stages, padded to a multiple of the shard group S (dp_cp; ZeRO-3:
    dp_shard x cp). After the step: ZeRO-1/2 keep the full buffer (the slice aliases it), ZeRO-3
    only its slice; gradient = one slice, m and v = slices. During the step every flat gradient
    is whole (``grad_full``) and ZeRO-3's parameters gathered: both counted as buffers."""
    from ..parallel.zero import decay_groups
    p, t = cfg.parallel, cfg.train
    n = p.dp_shard * p.cp if p.zero_stage == 3 else p.dp * p.cp
    out["params"] = frozen
    padded_total = largest_shard = 0
    for group, _ in decay_groups(train, t.weight_decay):
        shard = max(1, math.ceil(sum(q.numel() for _, q in group) / n))
        largest_shard = max(largest_shard, shard)
        padded_total += shard * n
        out["params"] += (shard if p.zero_stage == 3 else shard * n) * el
        out["grads"] += shard * el
        out["optim"] += 2 * shard * el
    b = t.global_batch // p.dp // p.microbatches
    recv = 3 * b * (t.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)) * cfg.model.d_model \
        * act_dtype(cfg).itemsize
    out["buffers"] = padded_total * el * (2 if p.zero_stage == 3 else 1) + recv
    # After the last backward (pipeline/sharded.sync_grads) the flat gradients (and under ZeRO-3
    # the gathered stage) are still there when their reduce-scatter outputs arrive; activations
    # are gone. So the peak after backward is the larger of that and the optimizer's temporary.
    sync = out["buffers"] - recv + out["grads"]
    out["opt_transient"] = max(sync, step_transient(out["grads"], largest_shard * el))
    out["gathered_total"] = out["reduce_total"] = float(padded_total * el)
    return out


def step_transient(stepped: float, largest: float) -> float:
    """The optimizer's temporary at the step on CPU: foreach AdamW makes one tensor the size of
    what it steps at once; train/optim.ChunkedAdamW steps runs of at most STEP_CHUNK bytes (a
    larger tensor alone), so at most max(STEP_CHUNK, the largest tensor), and never more than
    all ``stepped`` bytes."""
    from ..train.optim import STEP_CHUNK
    return float(min(stepped, max(STEP_CHUNK, largest)))


def _copied_grad_extra(train, el: int) -> float:
    """Bytes beyond the parameters of gradients that are views into larger buffers: a weight whose
    rows several tp ranks copy (parallel/tensor.py ``_SumOverCopies``) gets as gradient one slot of
    an (n_slots, *shape) buffer, and the whole buffer stays alive."""
    from ..distributed.placement import get_placement
    extra = 0.0
    for name, q in train:
        pl = get_placement(q, name)
        copies = getattr(pl, "copies", 1) or 1
        if copies > 1 and "tp" in pl.sharded_over:
            tp_slots = pl.global_shape[pl.dim] // max(1, pl.length or q.shape[pl.dim])
            extra += (tp_slots - 1) * q.numel() * el
    return extra


def inline_transport(cfg) -> bool:
    """Whether CPU ranks' collectives run through the shared-memory transport, whose "asynchronous"
    collectives complete when issued (the default for CPU ranks on one x86-64 host)."""
    from ..distributed.shm_host import X86
    p = cfg.parallel
    return p.comm_transport == "shared" or (p.comm_transport == "auto" and X86 and p.comm_algorithm == "backend")


def transport_bytes(cfg, pp_rank: int = 0) -> float:
    """CPU ranks on the shared-memory transport (``comm_transport`` shared, or auto on x86-64 with
    the backend algorithm): the shared pages a rank touches. A group's messages go in chunks of at
    most c = min(distributed/shm_host.chunk_bytes(n), the longest message) per member, two regions each:
    an all-gather reads every member's regions (2 n c); an all-reduce writes its own region, a
    part of its other one, and reads a 1/n part of everyone's two ((3 - 1/n) c). Pipeline and
    ring-attention neighbours add two point-to-point rings each (``SharedComm.p2p_cap``)."""
    from ..distributed.shm_host import chunk_bytes
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if not inline_transport(cfg):
        return 0.0

    def all_reduce(n, longest):
        return (3 - 1 / n) * min(chunk_bytes(n), longest) if n > 1 else 0.0

    state = model_state(cfg, pp_rank)
    b = max(1, t.global_batch // p.dp // p.microbatches)
    act = b * (t.seq_len // p.cp) * m.d_model * act_dtype(cfg).itemsize
    bucket = min(p.bucket_cap_mb * 2**20, state["grads"] or 0.0)
    if p.zero_stage == 3:  # FSDP gathers units over dp_shard x cp, all-reduces shards over replicas
        n = p.dp_shard * p.cp
        total = 2 * n * min(chunk_bytes(n), state.get("largest_unit", 0.0)) if n > 1 else 0.0
        total += all_reduce(p.dp_replicate, state["grads"])
    elif p.zero_stage in (1, 2) and p.pp == 1:
        n = p.dp * p.cp
        total = 2 * n * min(chunk_bytes(n), bucket) if n > 1 else 0.0
    else:
        total = all_reduce(p.dp * p.cp, bucket)
    total += all_reduce(p.tp, act)
    neighbours = (2 if p.pp > 2 else 1) * (p.pp > 1) + (2 if p.cp > 2 else 1) * (p.cp > 1 and p.cp_impl != "ulysses")
    return total + 2 * neighbours * (16 << 20)  # SharedComm's default p2p_cap
