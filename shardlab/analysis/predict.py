"""``predict(cfg, device, probe)``: per-rank memory and step time of a validated config's layout,
before launch; the planner's public API (docs/planner.md, API). ``device``: a kind of
analysis/devices.py or ``cpu`` (constants from ``probe``, ``devices.probe_cpu()`` when not given)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RankPrediction:
    """Bytes one rank holds at the peak of a step."""

    rank: int
    stage: int
    """The rank's pipeline coordinate (its first stage; 0 without pipeline parallel)."""
    params: float
    grads: float
    optim: float
    activations: float
    buffers: float
    transient: float
    wgrad: float = 0.0
    """Split backward (ZB-H1, DualPipe/V): peak bytes held for deferred weight gradients after B
    (inputs and output gradients, outside autograd: not in ``activations``)."""
    bwd_transient: float = 0.0
    """ZeRO-3/FSDP: a unit's flat (unsharded) gradient during its backward, the reduce-scatter's
    input, plus its largest parameter's gradient on the way in, or on an asynchronous transport
    the previous unit's flat gradient still being reduce-scattered."""
    opt_transient: float = 0.0
    """The optimizer step's temporaries: foreach AdamW makes one tensor the size of every
    parameter it steps (m / sqrt(v)), all at once; activations are freed by then."""
    fixed: float = 0.0
    """The empty rank: torch, its libraries and the process groups, before the model is built
    (CPU: resident bytes, measured; CUDA: 0, allocated bytes exclude the CUDA context)."""
    data: float = 0.0
    """CPU: the dataset a rank holds in memory (an image dataset's two splits, train/images.py; a
    token corpus is memory-mapped, only the pages a step reads). 0 on CUDA (host memory)."""
    evaluation: float = 0.0
    """Image models: the most bytes alive at once in the evaluation pass (a batch of test images
    and its forward, no gradients; analysis/plan_images.py), which runs every ``train.eval_every``
    steps and after the last, between steps: not part of :attr:`total`, see :attr:`run_peak`."""

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optim

    @property
    def total(self) -> float:
        """The peak a rank reaches: the empty rank, the model state, and the larger of the
        backward's live set (activations, gathered units, buffers, unsharded gradients) and the
        optimizer step's temporaries."""
        during_backward = self.activations + self.buffers + self.transient + self.wgrad + self.bwd_transient
        return (self.fixed + self.data + self.params + self.grads + self.optim
                + max(during_backward, self.opt_transient))

    @property
    def run_peak(self) -> float:
        """The peak over a whole run: a step's, or the evaluation pass's beside the model state and
        the persistent buffers, whichever is larger."""
        evaluating = self.fixed + self.data + self.model_state + self.buffers + self.evaluation
        return max(self.total, evaluating) if self.evaluation else self.total


@dataclass
class Prediction:
    ranks: list[RankPrediction]
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step: compute, exposed_comm, bubble, optimizer (and their parts)."""
    device: str = ""
    flops_per_token: float = 0.0

    @property
    def peak(self) -> RankPrediction:
        return max(self.ranks, key=lambda r: r.total)


H100_RESERVED_ROWS = (("ddp", 2110, 1970), ("zero1", 1594, 1365), ("zero2", 1222, 1111), ("zero3", 1044, 917),
                      ("zero3-noprefetch", 1354, 869), ("tp2-sp-dp2", 1294, 1091), ("pp2-1f1b-dp2", 1082, 982),
                      ("ddp-bf16", 2244, 2111), ("zero3-bf16", 854, 782))
"""(layout, max reserved MiB, max allocated MiB) of the worst rank, measured on one H100 on
2026-11-27 (docs/gpu.md, "Memory peaks on CUDA": ``benchmarks/memory_peaks.py --device cuda --n
4``, a ~100M Llama, 4 ranks sharing the GPU): the caching allocator's reserved bytes over its
allocated bytes, 1.06-1.56x."""

RESERVED_PER_ALLOCATED = statistics.median(r / a for _, r, a in H100_RESERVED_ROWS)
"""The allocator's headroom the planner states for a CUDA rank: the median of
:data:`H100_RESERVED_ROWS` (1.10). Not a model of the allocator's segments (their rounding, the
blocks each stream keeps, fragmentation between differently sized requests): a measured ratio on
small ranks (about 1-2 GiB), stated as such; it is checked against published reserved figures in
docs/planner_validation.md and is never fitted to them."""


def reserved(total: float, device: str) -> float:
    """Bytes the CUDA caching allocator is predicted to reserve for a rank peaking at ``total``
    allocated bytes (:data:`RESERVED_PER_ALLOCATED`); on CPU the peak is resident bytes: itself."""
    return total if device == "cpu" else total * RESERVED_PER_ALLOCATED


EMPTY_RANK_CPU = 265 * 2**20
"""Resident bytes of an empty CPU rank (torch 2.13 imported, gloo process groups up, 1 thread, one
step of a 0.1M-parameter model run), measured on this project's 2-core machines with
``shardlab memory configs/tiny.toml --nproc 2 --parallel.zero_stage=3``: 264.9-265.0 MiB for a
rank forked from the launcher's forkserver (2026-11-28; the shared libraries' pages count once
touched); a spawned rank measured 312.6 MiB on the same host, 384.6-384.7 on earlier ones. That
command measures it again on every run and prints the prediction with the measured value."""


def _rank(rank: int, pp_rank: int, s: dict) -> RankPrediction:
    """A rank's prediction from its pipeline coordinate's :func:`stage_memory` terms."""
    return RankPrediction(rank, pp_rank, float(s["params"]), float(s["grads"]), float(s["optim"]), s["activations"],
                          float(s["buffers"]), s["transient"], s["wgrad"], s["bwd_transient"], s["opt_transient"],
                          s["fixed"], s["data"], s.get("evaluation", 0.0))


def stage_memory(cfg, pp_rank: int, device: str = "cpu") -> dict:
    """The memory terms of every rank at pipeline coordinate ``pp_rank`` (all such ranks are
    alike: TP shards are equal, vocabulary padding included, and data-parallel shards are padded)."""
    from ..models.spec import get_spec
    from .plan_activations import activations
    from .plan_memory import model_state
    ms = model_state(cfg, pp_rank)
    task = get_spec(cfg.model).task
    act = transient = stash = 0.0
    if task == "lm":  # the block-wise trace (models/spec.py conventions)
        act, transient, stash = activations(cfg, pp_rank, device)
    else:  # a whole micro-batch's forward and backward, and the evaluation pass, on meta
        from .plan_images import eval_activations, step_activations
        act, transient = step_activations(cfg, device)
        ms["evaluation"] = eval_activations(cfg, device)
    ms.setdefault("bwd_transient", 0.0)
    ms.setdefault("opt_transient", 0.0)
    if device != "cpu":  # fused AdamW on CUDA (train/optim.build_adamw) makes no temporaries
        ms["opt_transient"] = 0.0
    ms["fixed"] = float(EMPTY_RANK_CPU) if device == "cpu" else 0.0
    ms["data"] = 0.0
    if device == "cpu":  # the dataset in host memory; the shared-memory transport's arenas and rings
        if task == "classify":
            from ..train.images import resident_bytes
            ms["data"] = float(resident_bytes(cfg.data))
        from .plan_memory import inline_transport, transport_bytes
        inline = inline_transport(cfg)  # its all-gathers complete when issued: nothing prefetched
        base = ms["buffers_inline"] if inline and "buffers_inline" in ms else ms["buffers"]
        shared = transport_bytes(cfg, pp_rank)  # resident from the first long message on, so
        ms["buffers"] = base + shared  # beside the backward's peak and the step's alike
        ms["opt_transient"] = ms["opt_transient"] + shared if ms["opt_transient"] else 0.0
        if inline and "bwd_transient_inline" in ms:  # its reduce-scatters finish at once
            ms["bwd_transient"] = ms["bwd_transient_inline"]
        if not inline and cfg.parallel.zero_stage == 1 and cfg.parallel.pp == 1:
            # gloo copies a bucket it reduce-scatters at the call and holds the copy until the work
            # is collected; ZeRO-1 keeps RS_IN_FLIGHT in flight (zero.ZeroEngine._launch) beside its
            # persistent gradient buffers (ZeRO-2's and ZeRO-3's copies replace the buffer they drop)
            from ..parallel.zero import RS_IN_FLIGHT
            ms["buffers"] += RS_IN_FLIGHT * ms.get("largest_bucket", 0.0)
        if not inline and cfg.parallel.zero_stage and cfg.parallel.pp > 1:
            # inside pipeline stages the flat gradients are dropped as their reduce-scatters start
            # (pipeline/sharded.sync_grads, two in flight): at a call gloo's copy of that bucket
            # stands beside every flat gradient still there
            ms["opt_transient"] = max(ms["opt_transient"], ms["sync_peak"] + ms["largest_bucket"])
    return {**ms, "activations": act, "transient": transient, "wgrad": stash}


def with_half_params(cfg):
    """``cfg`` with its weights stored in the compute dtype (plan_features "half_params",
    Megatron-LM's Float16Module): ``train.param_dtype`` set to the precision's 16-bit dtype where it
    is empty. The trace then runs 16-bit weights (autograd saves no cast copies of them,
    plan_activations.trace_mode); without ZeRO the model state is Megatron's: 16-bit weights, fp32
    main gradients, and fp32 main weights and moments in the optimizer (plan_memory)."""
    import copy
    if cfg.train.param_dtype:
        return cfg
    out = copy.deepcopy(cfg)
    out.train.param_dtype = out.train.precision
    return out


def scaled_step(breakdown: dict, efficiency: float) -> float:
    """Step seconds with its compute-bound part (all but exposed communication, the optimizer and
    ZeRO-3's copies: compute and the bubble it stretches) divided by ``efficiency`` (docs/planner.md,
    ``shardlab plan --efficiency fitted``)."""
    fixed = breakdown["exposed_comm"] + breakdown["optimizer"] + breakdown.get("copies", 0.0)
    return (breakdown["step_s"] - fixed) / efficiency + fixed


def predict(cfg, device: str = "cpu", probe=None, gpus_per_node: int | None = None,
            per_rank: bool = True, efficiency: float = 1.0, features=()) -> Prediction:
    """Predicted memory per rank and step time for ``cfg`` (validated) on ``device``.
    ``efficiency`` < 1 divides the compute-bound time by it (:func:`scaled_step`; 1: the stated
    device constants only). ``features``: names of plan_features.MODELLED a run uses beyond
    shardlab's engine (float8, async_tp, selective_layer_ac; compile is ``parallel.compile``)."""
    from ..distributed.topology import Topology
    from ..models.spec import get_spec
    from .devices import get_device, with_nodes
    from .plan_activations import chunk_activations, micro_batch
    from .plan_features import check_features
    from .plan_time import step_time
    p, t = cfg.parallel, cfg.train
    dev = with_nodes(get_device(device, probe), gpus_per_node)
    features = tuple(sorted(set(features) - {"compile"}))
    check_features(cfg, dev, features)
    if "half_params" in features:
        cfg = with_half_params(cfg)
    if "selective_layer_ac" in features:
        return _layer_ac(cfg, device, probe, gpus_per_node, per_rank, efficiency, features)
    topo = Topology.from_config(p)
    stages = _stages(cfg, device, None if per_rank else sorted({0, p.pp - 1}))
    ranks = []
    if per_rank:
        for rank in range(topo.world_size):
            pp_rank = rank // (topo.world_size // p.pp)  # pp is the slowest axis
            ranks.append(_rank(rank, pp_rank, stages[pp_rank]))
    else:
        for pp_rank, s in stages.items():
            ranks.append(_rank(pp_rank, pp_rank, s))
    spec = get_spec(cfg.model)
    flops = spec.flops_per_token(cfg.model, t.seq_len) if spec.task == "lm" else 0.0
    slowest = max(stages, key=lambda r: stages[r]["params"] + stages[r]["optim"])
    traced = chunk_activations(_no_ac(cfg), 0, device) if spec.task == "lm" else {}
    parts = step_time(cfg, dev, stages[slowest], flops, traced, features)
    if efficiency != 1.0:
        step = scaled_step(parts, efficiency)
        parts = {**parts, "step_s": step, "compute": parts["compute"] / efficiency,
                 "bubble": parts["bubble"] / efficiency, "efficiency": efficiency}
    tokens = micro_batch(cfg) * p.microbatches * p.dp * t.seq_len
    tps = tokens / parts["step_s"] if parts["step_s"] > 0 else 0.0
    mfu = None
    if flops and device != "cpu":
        mfu = tps * flops / (topo.world_size * dev.peak_flops)
    elif flops:
        mfu = tps * flops / (topo.world_size * dev.peak_flops)  # of the probed matmul rate
    return Prediction(ranks, parts["step_s"], tps, mfu, parts, device, flops)


def _layer_ac(cfg, device, probe, gpus_per_node, per_rank, efficiency, features) -> Prediction:
    """torchtitan's per-layer selective recomputation: the layout predicted with none and with full
    recomputation, every per-block term mixed (1 - f) : f (f: plan_features.layer_ac_share), the
    transient the larger (the overlap terms' max() mixed too: an approximation)."""
    import copy
    from .plan_features import layer_ac_share
    if cfg.parallel.activation_checkpointing != "full":
        from ..errors import ConfigError
        raise ConfigError("features", "selective_layer_ac recomputes every 2nd block fully: give the layout ac-full")
    rest = tuple(f for f in features if f != "selective_layer_ac")
    f = layer_ac_share(cfg.model.n_layers)
    none = _no_ac(cfg)
    a = predict(none, device, probe, gpus_per_node, per_rank, efficiency, rest)
    b = predict(cfg, device, probe, gpus_per_node, per_rank, efficiency, rest)
    ranks = []
    for ra, rb in zip(a.ranks, b.ranks):
        r = copy.copy(rb)
        r.activations = (1 - f) * ra.activations + f * rb.activations
        r.wgrad = (1 - f) * ra.wgrad + f * rb.wgrad
        r.transient = max(ra.transient, rb.transient)
        ranks.append(r)
    parts = {k: (1 - f) * a.breakdown[k] + f * b.breakdown[k] if isinstance(v, (int, float)) else v
             for k, v in b.breakdown.items() if k in a.breakdown}
    tps = b.tokens_per_s * b.step_time_s / parts["step_s"]
    mfu = None if b.mfu is None else b.mfu * b.step_time_s / parts["step_s"]
    return Prediction(ranks, parts["step_s"], tps, mfu, {**parts, "layer_ac_share": f}, device, b.flops_per_token)


def memory_per_rank(cfg, device: str = "cpu") -> list[RankPrediction]:
    """The memory half of :func:`predict` (no device constants, no probe): one entry per rank."""
    from ..distributed.topology import Topology
    stages = _stages(cfg, device)
    world = Topology.from_config(cfg.parallel).world_size
    out = []
    for rank in range(world):
        pp_rank = rank // (world // cfg.parallel.pp)
        out.append(_rank(rank, pp_rank, stages[pp_rank]))
    return out


def _stages(cfg, device: str, which=None) -> dict:
    """stage_memory of the pipeline coordinates ``which`` (default all). Model state is computed
    once per distinct kind of rank (same layer counts, ends and MoE pattern); activations per
    rank, from its own action list (plan_pipeline.walk_peak)."""
    from .shadow import stage_ranges
    p = cfg.parallel
    if p.pp == 1:
        return {0: stage_memory(cfg, 0, device)}
    from ..models.spec import get_spec
    from ..parallel.pipeline.stage import holds_ends
    from .plan_activations import activations
    from .plan_pipeline import layout
    ranges = stage_ranges(cfg)
    owner = layout(cfg).rank_of
    every = cfg.model.moe_every if cfg.model.n_experts else 1
    lm = get_spec(cfg.model).task == "lm"
    done, out = {}, {}
    for r in (range(p.pp) if which is None else which):
        sig = tuple((len(ranges[s]), *holds_ends(ranges, s),
                     tuple(i % every for i in ranges[s])) for s in range(len(ranges)) if owner(s) == r)
        if sig not in done:
            done[sig] = stage_memory(cfg, r, device)
        out[r] = dict(done[sig])
        if lm:
            act, transient, stash = activations(cfg, r, device)
            out[r].update(activations=act, transient=transient, wgrad=stash)
    return out


def _no_ac(cfg):
    import copy
    if cfg.parallel.activation_checkpointing == "none":
        return cfg
    c = copy.deepcopy(cfg)
    c.parallel.activation_checkpointing = "none"
    return c
