"""Per-rank activation memory of a layout, before launch: the traced saved bytes of one
micro-batch per region, under the recomputation policy and autocast's rules, walked over the
pipeline's action list (docs/planner.md, Memory model; Recomputation policies)."""
from __future__ import annotations

import functools
import json

import torch

from .plan_memory import _canonical, _fast_key


def trace_mode(cfg, device: str = "cpu") -> str:
    """How the trace runs: the parameters' dtype, and under bf16/fp16 autocast's rules for the
    device ("autocast-cuda-float32": fp32 weights cast per product, as DDP, TP, PP and ZeRO-1/2
    keep them, and ZeRO-3 inside pipeline stages, which gathers fp32; "autocast-cuda-bfloat16":
    FSDP gathering in the autocast dtype, or param_dtype)."""
    t, p = cfg.train, cfg.parallel
    if t.precision not in ("bf16", "fp16"):
        return "float64" if t.precision == "fp64" else "float32"
    low = t.param_dtype in ("bf16", "fp16") or (p.zero_stage == 3 and p.pp == 1 and not t.param_dtype)
    return f"autocast-{'cpu' if device == 'cpu' else 'cuda'}-{'bfloat16' if low else 'float32'}"


def mode_parts(mode: str) -> tuple[str | None, torch.dtype]:
    """A :func:`trace_mode` as (autocast's device or None, the parameters' dtype)."""
    autocast, dtype = mode.split("-")[1:] if mode.startswith("autocast-") else (None, mode)
    return autocast, getattr(torch, dtype)


@functools.lru_cache(maxsize=4096)  # one per distinct stage shape of a search (a few hundred bytes each)
def _trace(key: str, cfg_json: str, micro_batch: int, seq: int, mode: str, pp_rank: int):
    from ..config import from_dict
    from ..distributed.topology import Topology
    from .shadow import trace_saved
    cfg = from_dict(json.loads(cfg_json))
    rank = Topology.from_config(cfg.parallel).rank(pp=pp_rank)
    autocast, dtype = mode_parts(mode)
    return trace_saved(cfg, micro_batch, seq, dtype, rank, autocast)


def micro_batch(cfg) -> int:
    p = cfg.parallel
    return max(1, cfg.train.global_batch // p.dp // p.microbatches)


_ACTS: dict = {}


def chunk_activations(cfg, pp_rank: int = 0, device: str = "cpu") -> dict:
    """Cached :func:`compute_chunk_activations`."""
    key = _fast_key(cfg, pp_rank, device, cfg.parallel.activation_checkpointing, cfg.parallel.pp_schedule)
    if key not in _ACTS:
        _ACTS[key] = compute_chunk_activations(cfg, pp_rank, device)
    return _ACTS[key]


def compute_chunk_activations(cfg, pp_rank: int = 0, device: str = "cpu") -> dict:
    """{stage: bytes saved for one micro-batch by that stage (chunk) of this pipeline rank},
    plus "recompute" (the largest block's full activations, re-created in backward under full
    recomputation) and "logits" (the loss's transient, :func:`loss_transient`)."""
    p = cfg.parallel
    seq = cfg.train.seq_len // p.cp
    small = _small_cfg(cfg)
    cfg_json = _canonical(small)
    tr = _trace(cfg_json, cfg_json, micro_batch(cfg), seq, trace_mode(cfg, device), 0)
    blocks = [r for r in tr.regions if r not in ("first", "last")]
    mode = p.activation_checkpointing

    def block_bytes(name):
        full = tr.regions[name]
        if mode == "full":
            return tr.block_input.get(name, 0)
        if mode == "selective":
            return full - tr.core_only.get(name, 0) + tr.core_inputs.get(name, 0) + tr.core_outputs.get(name, 0)
        return tr.block_input.get(name, 0) + tr.op_kept.get(name, 0) if mode == "op" else full

    per_block = sum(block_bytes(b) for b in blocks) / max(1, len(blocks))
    stash_block = sum(tr.wgrad.get(b, 0) for b in blocks) / max(1, len(blocks))
    ops_block = sum(tr.ops.get(b, 0) for b in blocks) / max(1, len(blocks))
    ew_block = sum(tr.ew_bytes.get(b, 0) for b in blocks) / max(1, len(blocks))
    full_block = max((tr.regions[b] for b in blocks), default=0)
    from ..parallel.pipeline.stage import holds_ends
    from .shadow import stage_ranges
    ranges = stage_ranges(cfg)
    if p.pp > 1:
        from .plan_pipeline import layout
        owner = layout(cfg).rank_of
    else:
        owner = lambda s: 0  # noqa: E731
    out, stash, ops, ew, ends = {}, {}, {}, {}, {}
    for s, rng in enumerate(ranges):
        if owner(s) != pp_rank:
            continue
        n = len(rng)
        b, w, o, e = n * per_block, n * stash_block, n * ops_block, n * ew_block
        ends[s] = 0
        for region, here in zip(("first", "last"), holds_ends(ranges, s)):
            if here:
                ends[s] += tr.regions.get(region, 0)
                w += tr.wgrad.get(region, 0)
                o += tr.ops.get(region, 0)
                e += tr.ew_bytes.get(region, 0)
        out[s], stash[s], ops[s], ew[s] = b + ends[s], w, o, e
    out["stash"], out["graph_kept"], out["ops"], out["ew"], out["ends"] = stash, tr.graph_kept, ops, ew, ends
    owns_loss = any(owner(s) == pp_rank and holds_ends(ranges, s)[1] for s in range(len(ranges)))
    out["recompute"] = full_block if mode in ("full", "op") else 0
    out["logits"] = loss_transient(cfg, tr) if owns_loss else 0  # the stage with the head and loss only
    return {**out, **tr.op_shares(cfg.model.n_layers)}  # the op policy's recomputation (plan_time.py)


def loss_transient(cfg, tr) -> int:
    """Bytes the loss holds beyond its saved tensors, from the trace's logits (L: the head's output)
    and the largest tensor the loss creates (F: the fp32 copy under bf16, else L's size). The
    cross-entropy of models/decoder.py saves the fp32 log-softmax; its backward holds the gradient
    into log_softmax and the one out of it beside it: 2 F. The vocabulary-parallel one of
    parallel/tensor.py saves the exponentials; its forward holds the logits and their fp32 copy,
    its backward the fp32 gradient and its cast to the logits' dtype: L + F (measured on CPU:
    tests/distributed/test_memory_peaks.py)."""
    f = max(tr.loss_copy, tr.logits)
    return tr.logits + f if cfg.parallel.tp > 1 else 2 * f


def _small_cfg(cfg):
    """The config with as few layers as the trace needs (two blocks): per-block
    bytes do not depend on the layer count; the pipeline degree is dropped (a stage's split is
    applied to the per-block figure) but first/last regions are kept."""
    import copy
    small = copy.deepcopy(cfg)
    m = small.model
    m.n_layers = min(m.n_layers, 2)
    small.parallel.pp, small.parallel.pp_virtual, small.parallel.pp_schedule = 1, 1, "1f1b"
    small.parallel.activation_checkpointing = "none"
    return small


SIMULATE_LIMIT = 4096
"""Schedules with more compute actions than this (pp x microbatches x 3, the planner's large
searches) take the closed-form bubble of schedule.theoretical_bubble instead of the simulator."""


@functools.lru_cache(maxsize=512)
def schedule_peaks(name: str, pp: int, m: int, v: int) -> tuple:
    """(peak micro-batches in flight per rank, peak held graphs per rank, bubble): simulated
    (simulate.py, F = B = W), or for large schedules the closed form (peaks then empty)."""
    from ..parallel.pipeline.schedule import build, theoretical_bubble
    from ..parallel.pipeline.simulate import simulate
    if 3 * pp * m * v > SIMULATE_LIMIT:
        return (), (), theoretical_bubble(name, pp, m, v)
    res = simulate(build(name, pp, m, v))
    return tuple(res.peak_inflight), tuple(res.peak_held), res.bubble


def activations(cfg, pp_rank: int = 0, device: str = "cpu") -> tuple[float, float, float]:
    """(bytes of saved activations at the peak of a step, the largest transient, the peak W stash
    of a split backward) for a rank."""
    p = cfg.parallel
    ch = chunk_activations(cfg, pp_rank, device)
    stages = {k: v for k, v in ch.items() if isinstance(k, int)}
    stash = 0.0
    if p.pp == 1:
        held = sum(stages.values())
    else:  # the rank's action list walked in order (plan_pipeline.py)
        from .plan_pipeline import walk_peak
        graph_kept = ch["graph_kept"] or p.activation_checkpointing != "none"
        held, stash = walk_peak(cfg, pp_rank, stages, ch["stash"], graph_kept)
    transient = max(ch["recompute"], ch["logits"])
    return float(held), float(transient), float(stash)
