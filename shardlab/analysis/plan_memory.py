"""Per-rank model state of a layout, before launch, in the categories of ``analysis.measured_memory.measure``
(a measured run compares to the byte): the rank's parameters from :func:`shadow.local_model`, then
the engines' own flat-buffer rules (``zero.flat_groups`` / ``zero.shard_size``, ``units.unit_params``,
``pipeline.sharded.shard_group``), communication buffers and transients. docs/planner.md, Memory
model (the per-engine table); activations: plan_activations.py."""
from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import torch

from ..distributed.topology import Topology
from ..parallel.fsdp import FSDPEngine
from ..parallel.units import unit_params, wrap_policy
from ..parallel.pipeline.sharded import shard_group
from ..parallel.pipeline.stage import holds_ends
from ..parallel.zero import ZeroEngine, flat_groups, shard_size

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
    par.update(dp_replicate=1, dp_shard=par["ep"], cp=1, cp_ulysses=1, cp_impl="ring", zero_stage=0,
               microbatches=max(par["pp"], 1))  # cp 1: ring, Ulysses and unified build the same local model
    if par["pp_schedule"] == "interleaved":
        par["microbatches"] = par["pp"]
    if par["pp_schedule"] in ("dualpipe", "dualpipev"):
        par["microbatches"] = 2 * par["pp"]
    d["train"] = {k: d["train"][k] for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "precision")}
    return json.dumps(d, sort_keys=True)


def local_model_for(cfg, pp_rank: int):
    """(the rank's local model, spec). With pp > 1 the unsplit model (one build per TP/EP/LoRA shape)
    filtered to what the rank's stages keep (``shadow.stage_ranges``, the schedule's ``rank_of``)."""
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
    mine = [s for s in range(len(ranges)) if owner(s) == pp_rank]
    layers = {f"layers.{i}." for s in mine for i in ranges[s]}
    ends = (tuple(spec.pp_first or ()) if any(holds_ends(ranges, s)[0] for s in mine) else ()) \
        + (tuple(spec.pp_last) if any(holds_ends(ranges, s)[1] for s in mine) else ())
    ends = tuple(f"{n}." for n in ends)
    kept = [(n, q) for n, q in model.named_parameters()
            if (n.startswith("layers.") and n[:n.index(".", 7) + 1] in layers) or n.startswith(ends)]
    return SimpleNamespace(named_parameters=lambda: iter(kept)), spec  # (global name, meta parameter)


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
    engine's communication buffers (FSDP: the gathered units in flight; ZeRO-2: one staging bucket);
    ``opt_elems``: the elements its optimizer steps (its shard of the trained parameters)."""
    model, spec = local_model_for(cfg, pp_rank)
    p, t = cfg.parallel, cfg.train
    el = param_elem(cfg)
    named = [(n, q) for n, q in model.named_parameters()]
    train = [(n, q) for n, q in named if q.requires_grad]
    frozen = sum(q.numel() for _, q in named if not q.requires_grad) * el
    psi_t = sum(q.numel() for _, q in train)
    out = {"params": 0.0, "grads": 0.0, "optim": 0.0, "buffers": 0.0, "opt_elems": 0.0}
    if p.pp > 1 and p.zero_stage:
        return _stage_sharded(cfg, train, frozen, el, out)
    if p.pp > 1 or p.zero_stage == 0:
        gel = LOW.get(t.reduce_dtype, el) if (p.pp == 1 and p.dp * p.cp > 1 and p.tp == 1) else el
        # predict.with_half_params without ZeRO (Megatron-LM's Float16Module): 16-bit weights, fp32
        # main gradients, and an fp32 main copy of the weights beside the moments in the optimizer
        half = LOW[t.param_dtype] if p.zero_stage == 0 and t.param_dtype in ("bf16", "fp16") else None
        out.update(params=frozen + psi_t * (half or el), grads=psi_t * gel,
                   optim=(3 if half else 2) * psi_t * el, opt_elems=float(psi_t),
                   opt_transient=step_transient(psi_t * el, max((q.numel() for _, q in train), default=0) * el))
        if p.dp * p.cp == 1 or p.pp > 1:  # p.grad kept as autograd made it: kv heads copied over tp
            out["grads"] += _copied_grad_extra(train, el)  # (tp > n_kv_heads) are views of n_slots x
        if p.pp > 1:
            out["buffers"] = _recv_bytes(cfg)
            if p.microbatches > 1 and not half:  # from the second micro-batch on, autograd's
                # AccumulateGrad adds each new gradient into p.grad: one parameter's gradient exists
                # twice for a moment (Megatron-LM's fused accumulation into main_grad makes none)
                out["bwd_transient"] = float(max((q.numel() for _, q in train), default=0) * el)
        return out
    topo = Topology.from_config(p)
    if p.zero_stage in (1, 2):  # the engine's buffers (zero.flat_groups) and slices (zero.shard_size)
        low = LOW.get(t.param_dtype) if t.param_dtype in ("bf16", "fp16") else None
        fel = low or el
        out["params"] = frozen
        biggest = largest_shard = 0
        for n, shard in _flats(train, ZeroEngine.shard_group, topo, t.weight_decay, p.bucket_cap_mb * 2**20):
            padded = shard * n
            biggest, largest_shard = max(biggest, padded), max(largest_shard, shard)
            out["params"] += padded * fel
            out["grads"] += (padded if p.zero_stage == 1 else shard) * fel
            out["optim"] += 2 * shard * el + (shard * el if low else 0)
            out["opt_elems"] += shard
        if p.zero_stage == 2:
            out["buffers"] = 2 * biggest * fel  # the bucket being filled and the one reduce-scattering
        out["largest_bucket"] = float(biggest * fel)
        out["opt_transient"] = step_transient(out["optim"] / (3 if low else 2), largest_shard * el)
        return out
    units = wrap_policy(model, p.wrap_policy, spec)
    compute = LOW.get(t.param_dtype) or (2 if t.precision in ("bf16", "fp16") else None)
    master = compute is not None and compute != el
    out["params"] = frozen
    gathered, reduce_total, largest_shard = [], 0, 0
    for prefix in [""] + units:
        mine = unit_params(model.get_submodule(prefix) if prefix else model, prefix, units)
        unit_bytes = 0
        for n, shard in _flats(mine, FSDPEngine.shard_group, topo, t.weight_decay):
            reduce_total += shard * n * (LOW.get(t.reduce_dtype) or el)
            largest_shard = max(largest_shard, shard)
            out["optim" if master else "params"] += shard * el
            out["grads"] += shard * el
            out["optim"] += 2 * shard * el
            out["opt_elems"] += shard
            unit_bytes += shard * n * (compute or el)
        gathered.append(unit_bytes)
    root, rest = gathered[0], sorted(gathered[1:], reverse=True)
    # the unit computing and the one prefetched; none is prefetched on the CPU's shared-memory
    # transport, whose all-gathers complete when issued (fsdp.FSDPEngine.background):
    # "buffers_inline", which predict uses for CPU ranks only (on a GPU every transport is
    # asynchronous: NCCL, and the same-GPU transport on its comm stream)
    out["buffers"] = root + sum(rest[:2 if p.prefetch else 1])
    out["buffers_inline"] = root + sum(rest[:1])
    if not p.reshard_after_forward:  # every unit stays gathered from its forward to its backward
        out["buffers"] = out["buffers_inline"] = float(sum(gathered))
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
    out["units"], out["root_gathered"] = float(len(gathered)), float(root)
    return out


def _flats(named, dense: str, topo, weight_decay: float, cap_bytes=None):
    """(shard group size, the rank's slice in elements) of every flat buffer the engine builds from
    ``named``: the engines' own grouping (zero.flat_groups) and ownership rule (zero.shard_size)."""
    for gname, group, _ in flat_groups(named, dense, weight_decay, cap_bytes):
        n = topo.size(gname)
        yield n, shard_size(sum(q.numel() for _, q in group), n)


def _stage_sharded(cfg, train, frozen: float, el: int, out: dict) -> dict:
    """ZeRO-1/2/3 inside pipeline stages (pipeline/sharded.py; docs/planner.md, Memory model): the
    stage gathered in ``train.param_dtype`` (c bytes; none: the masters' el) with separate el-byte
    master slices then, its gradient accumulated over the micro-batches in ``train.reduce_dtype``
    (a bytes; none: el), as the engine's ``compute_dtype`` / ``acc_dtype``."""
    p, t = cfg.parallel, cfg.train
    c, a = LOW.get(t.param_dtype) or el, LOW.get(t.reduce_dtype) or el
    out["params"] = frozen
    padded_total = largest_shard = biggest = 0
    for n, shard in _flats(train, shard_group(p.zero_stage), Topology.from_config(p), t.weight_decay,
                           p.bucket_cap_mb * 2**20):  # the engine's buckets (pipeline/sharded.py)
        largest_shard, biggest = max(largest_shard, shard), max(biggest, shard * n)
        padded_total += shard * n
        if c != el:  # a low-precision stage: the master slice is the optimizer's (measured as optim)
            out["params"] += 0 if p.zero_stage == 3 else shard * n * c
            out["optim"] += shard * el
        else:
            out["params"] += (shard if p.zero_stage == 3 else shard * n) * el
        out["grads"] += shard * el
        out["optim"] += 2 * shard * el
        out["opt_elems"] += shard
    recv = _recv_bytes(cfg)
    out["buffers"] = padded_total * ((c if p.zero_stage == 3 else 0) + a) + recv
    if a != c:  # each parameter's gradient of a micro-batch exists in c bytes until it is folded in
        out["bwd_transient"] = float(max((q.numel() for _, q in train), default=0) * c)
    # After the last backward (pipeline/sharded.sync_grads) the flat gradients (and under ZeRO-3
    # the gathered stage) are still there when their reduce-scatter outputs arrive; activations
    # are gone. So the peak after backward is the larger of that and the optimizer's temporary.
    sync = out["buffers"] - recv + out["grads"]
    out["opt_transient"] = max(sync, step_transient(out["grads"], largest_shard * el))
    out["sync_peak"], out["largest_bucket"] = float(sync), float(biggest * a)  # (predict: gloo's copy)
    out["gathered_total"], out["reduce_total"] = float(padded_total * c), float(padded_total * a)
    return out


def _recv_bytes(cfg) -> float:
    """A pipeline rank's receive buffers posted ahead (engine.lookahead + 1 activations, in the
    stages' compute dtype)."""
    p, t = cfg.parallel, cfg.train
    b = t.global_batch // p.dp // p.microbatches
    low = p.zero_stage and t.param_dtype in ("bf16", "fp16")  # the stages compute in param_dtype
    return 3 * b * (t.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)) * cfg.model.d_model \
        * (LOW[t.param_dtype] if low else act_dtype(cfg).itemsize)


def step_transient(stepped: float, largest: float) -> float:
    """The optimizer's temporary at the step on CPU: train/optim.ChunkedAdamW's, at most
    max(STEP_CHUNK, the largest tensor) and all ``stepped`` bytes (docs/data-parallel.md)."""
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
    """The shared pages a CPU rank on the shared-memory transport touches: per group two regions of
    c = min(shm_host.chunk_bytes(n), the longest message) per member, an all-gather reading all
    (2 n c), an all-reduce (3 - 1/n) c; two point-to-point rings per pipeline / ring neighbour."""
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
    if p.zero_stage == 3:  # FSDP gathers units over its shard group, all-reduces shards over replicas
        n = Topology.from_config(p).size(FSDPEngine.shard_group)
        total = 2 * n * min(chunk_bytes(n), state.get("largest_unit", 0.0)) if n > 1 else 0.0
        total += all_reduce(p.dp_replicate, state["grads"])
    elif p.zero_stage in (1, 2) and p.pp == 1:
        n = Topology.from_config(p).size(ZeroEngine.shard_group)
        total = 2 * n * min(chunk_bytes(n), bucket) if n > 1 else 0.0
    else:
        total = all_reduce(p.dp * p.cp, bucket)
    total += all_reduce(p.tp, act)
    neighbours = (2 if p.pp > 2 else 1) * (p.pp > 1) + (2 if p.cp > 2 else 1) * (p.cp > 1 and p.cp_impl != "ulysses")
    return total + 2 * neighbours * (16 << 20)  # SharedComm's default p2p_cap
