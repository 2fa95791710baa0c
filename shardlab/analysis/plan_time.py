"""Step time of a layout on a device kind: roofline compute, alpha-beta collectives placed on
their links, the pipeline schedule simulated, and what each engine overlaps (docs/planner.md,
Time model)."""
from __future__ import annotations

import math
from collections import Counter

FLASH_BWD_EXTRA = 3.5 / 3
"""Attention FLOPs executed per FLOP counted: the spec counts forward + 2 x forward, a flash backward
recomputes the scores (2.5 x forward: Dao, "FlashAttention-2", 2023, section 3)."""

ELEMENTWISE_PASSES = {"eager": 12.0, "fused": 4.0}
"""Bytes moved by elementwise work per byte autograd saves: one kernel per op (eager) or fused."""


def attention_eff(dev, length: int) -> float:
    """The flash kernels' forward + backward share of ``dev``'s datasheet peak at ``length`` tokens
    per call (query and key): its published curve (devices.FA2_*) interpolated in log2 of the
    length, flat beyond its ends; ``attn_eff`` where the device has no curve (CPU)."""
    pts = dev.attn_curve
    if not pts:
        return dev.attn_eff
    x = math.log2(max(length, 1))
    if x <= math.log2(pts[0][0]):
        return pts[0][1] / dev.peak_flops
    for (l0, r0), (l1, r1) in zip(pts, pts[1:]):
        if x <= math.log2(l1):
            f = (x - math.log2(l0)) / (math.log2(l1) - math.log2(l0))
            return (r0 + f * (r1 - r0)) / dev.peak_flops
    return pts[-1][1] / dev.peak_flops


def busiest_share(cfg) -> float:
    """The busiest pipeline rank's compute over the average rank's, which a synchronous schedule's
    steady state runs at: each rank's blocks (the model's FLOPs a token less the head's, shared
    evenly by the blocks) and, on the rank owning the last stage, the head's matrix product (6 x
    vocab x d_model FLOPs a token), over the stage split the engine builds (shadow.stage_ranges)
    and the schedule's rank_of. 1.0 for models without a token head (the CNN)."""
    from ..models.spec import get_spec
    from .plan_pipeline import layout
    from .shadow import stage_ranges
    m = cfg.model
    spec = get_spec(m)
    if spec.task != "lm":
        return 1.0
    head = 6.0 * m.vocab_size * m.d_model
    block = (spec.flops_per_token(m, cfg.train.seq_len) - head) / m.n_layers
    from ..parallel.pipeline.stage import holds_ends
    ranges, own = stage_ranges(cfg), layout(cfg).rank_of
    load: dict = {}
    for stage, r in enumerate(ranges):
        load[own(stage)] = load.get(own(stage), 0.0) + len(r) * block + (head if holds_ends(ranges, stage)[1] else 0.0)
    return max(load.values()) * cfg.parallel.pp / sum(load.values())


def collective(kind: str, nbytes: float, n: int, bw, alpha: float) -> float:
    """Seconds of one collective of ``nbytes`` (full message) over ``n`` ranks. ``bw`` is a bus
    bandwidth, or on the CPU a :class:`Curve` (then ``alpha`` is unused). ``p2p``: one send."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if isinstance(bw, Curve):
        return bw.seconds(kind, nbytes)
    if kind == "p2p":
        return alpha + nbytes / bw
    wire = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}[kind] * nbytes * (n - 1) / n
    return 2 * math.log2(n) * alpha + wire / bw


class Curve:
    """CPU collectives as probed (``comm_curve``): an all-reduce's seconds between compute, linear in
    bytes between the probed sizes; other kinds as the all-reduce of as many bytes on the wire."""

    def __init__(self, points):
        self.pts = sorted((float(b), float(t)) for b, t in points)

    def seconds(self, kind: str, nbytes: float) -> float:
        x = nbytes if kind == "all_reduce" else nbytes / 2
        pts = self.pts
        if x <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if x <= b1:
                return t0 + (t1 - t0) * (x - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (x - b1)


def link(topo, group: str, dev, size: int = 0) -> tuple:
    """(bus bandwidth, latency) of the ``group`` that contains rank 0: NVLink if its ranks share a
    node, else the network; CPU: the probed curve (:class:`Curve`, alpha 0) of the closest world
    size and the group's size (``size``: a part of ``group``, a ring or Ulysses group in cp)."""
    if dev.comm_curve:
        w = topo.world_size
        g = size or (2 if group == "pp" else len(_group_of_rank0(topo, group)) if group != "world" else w)
        pw = min({e[0] for e in dev.comm_curve}, key=lambda x: (x < w, abs(x - w)))
        _, _, pts = min((e for e in dev.comm_curve if e[0] == pw), key=lambda e: (abs(e[1] - g), -e[1]))
        return Curve(pts), 0.0
    if dev.comm_n:
        w = topo.world_size
        n, alpha, bw = min(dev.comm_n, key=lambda e: (e[0] < w, abs(e[0] - w)))
        return bw, alpha
    per_node = Counter(r // dev.gpus_per_node for r in _group_of_rank0(topo, group))
    if len(per_node) == 1:
        return dev.intra_bw, dev.intra_alpha
    # across nodes, each GPU with its own NIC: a group with g ranks on a node runs g rings side by side
    # (NCCL's channels), each crossing the network on its own NIC and carrying 1/g of the bytes
    return min(dev.intra_bw, max(per_node.values()) * dev.inter_bw), dev.inter_alpha


def _group_of_rank0(topo, group: str) -> list[int]:
    """Ranks of rank 0's group without listing the world: strides of the axes (tp fastest)."""
    from ..distributed.topology import AXES, GROUPS
    if group in ("ep", "edp"):
        return topo.group_of(group, 0) if topo.world_size <= 4096 else list(range(topo.size(group)))
    strides, s = {}, 1
    for a in reversed(AXES):
        strides[a] = s
        s *= getattr(topo, a)
    ranks = [0]
    for a in GROUPS[group]:
        ranks = [r + i * strides[a] for r in ranks for i in range(getattr(topo, a))]
    return ranks


def step_time(cfg, dev, mem, spec_flops: float, traced: dict, features=()) -> dict:
    """{step_s, compute, exposed_comm, bubble, optimizer} for the layout. ``mem``: the rank's
    model-state bytes (plan_memory.model_state); ``traced``: activation bytes of one micro-batch
    per stage without recomputation (plan_activations.chunk_activations); ``features``: float8
    and async_tp priced as plan_features states (GPUs)."""
    from ..distributed.topology import Topology
    from ..models.moe import expert_capacity
    from ..parallel.expert import padded_dispatch
    from .plan_activations import micro_batch, schedule_peaks
    from .plan_memory import act_dtype
    from .plan_moe import a2a_seconds, ep_nodes, paired_share
    from .devices import for_transport
    p, m, t = cfg.parallel, cfg.model, cfg.train
    dev = for_transport(dev, p.comm_transport)  # CPU: the probed curve of this layout's transport
    topo = Topology.from_config(p)
    el = act_dtype(cfg, "gpu" if dev.gpus_per_node < 1 << 20 else "cpu").itemsize
    b, s = micro_batch(cfg), t.seq_len
    tokens = b * s
    attn_term = 12.0 * m.n_layers * m.d_model * s
    mm = max(spec_flops - attn_term, 0.0) * tokens / (p.tp * p.cp * p.pp)
    peak = dev.peak_flops * dev.sustain  # a power-limited part's share of the datasheet peak (devices.tdp_share)
    hbm = dev.hbm_bw * dev.hbm_eff  # what an elementwise kernel moves (devices.HBM_EFF on GPUs; CPU: 1)
    over = max(1.0, topo.world_size / dev.cores) if dev.cores else 1.0  # CPU ranks sharing cores
    if dev.cores > 1 and topo.world_size > 1:  # and the caches / memory bandwidth (probed: busy)
        over *= 1.0 + (dev.busy - 1.0) * min(1.0, (topo.world_size - 1) / (dev.cores - 1))
    t_mm = over * mm / (peak * dev.mm_eff)
    share = t_cast = 0.0
    if features and dev.op_s == 0:  # Float8 linears / async TP (plan_features.py)
        from .plan_features import block_matmul_share, block_weights, fp8_cast_bytes, fp8_matmul_seconds
        share = block_matmul_share(cfg)
        if "float8" in features:
            t_mm = fp8_matmul_seconds(t_mm, share, peak, dev.peak_fp8 * dev.sustain)
            t_cast = fp8_cast_bytes(block_weights(cfg), b * (s // p.cp), p.activation_checkpointing == "full") \
                * m.n_layers / p.pp / hbm
    attn = attn_term * tokens / (p.tp * p.cp * p.pp)
    math_core = m.attention == "math"  # scores materialised: the whole S x S products as batched matmuls,
    # backward without recomputing them; their mask / softmax / dropout traffic is in the traced bytes
    u = p.cp if p.cp_impl == "ulysses" else (p.cp_ulysses if p.cp_impl == "unified" else 1)
    kernel = s // max(1, p.cp // u)  # one flash call's tokens: the ring's shard (Ulysses: the whole sequence)
    t_attn = over * (attn / (peak * dev.mm_eff) if math_core
                     else 0.5 * attn * FLASH_BWD_EXTRA / (peak * attention_eff(dev, kernel)))
    stages = [k for k in traced if isinstance(k, int)]
    per_stage = (p.pp_virtual if p.pp > 1 else 1) / max(1, len(stages))
    saved = sum(traced[k] for k in stages) * per_stage
    # torchtitan compiles the blocks only (compile_blocks): the embedding's, head's and loss's bytes stay eager
    ends = sum(traced.get("ends", {}).values()) * per_stage if "compile_blocks" in features and p.compile else 0.0
    cpu = dev.op_s > 0
    if cpu:  # every operator's dispatch + autograd cost and its written bytes, both probed
        half = 0.5 if p.pp > 1 and p.pp_schedule == "dualpipe" else 1.0  # a micro-batch runs one copy
        ops, ew = half * sum(traced.get("ops", {}).values()), half * sum(traced.get("ew", {}).values())
        t_elem = over * (ops * dev.op_s + ew / dev.ew_bw)
        elem_blocks = over * (ops * traced.get("op_ops", 0) * dev.op_s + ew * traced.get("op_ew", 0) / dev.ew_bw)
    else:
        passes = ELEMENTWISE_PASSES["fused" if p.compile else "eager"]
        t_elem = over * (passes * (saved - ends) + ELEMENTWISE_PASSES["eager"] * ends) / hbm
        elem_blocks = over * passes * saved * traced.get("op_saved", 0) / hbm
    fwd = (t_mm + t_attn + t_elem) / 3
    bwd = 2 * fwd
    ac = p.activation_checkpointing
    recompute = {"full": fwd, "selective": t_attn / (3.0 if math_core else 3.5),  # op: the blocks' elementwise work and
                 "op": (t_mm * traced.get("op_mm", 0) + elem_blocks) / 3}.get(ac, 0.0)  # the products it drops
    if cpu and ac in ("full", "op"):  # the checkpoint's own per-operator cost (probed, devices.ckpt_s)
        recompute += over * ops * traced.get("op_ops", 0) * dict(dev.ckpt_s).get(ac, 0.0)
    fwd, bwd = fwd + t_cast / 3, bwd + 2 * t_cast / 3  # Float8 casts (a recomputed forward's counted in t_cast)
    # tensor parallel: 2 all-reduces (or all-gather + reduce-scatter) per block forward, 2 backward
    layers = m.n_layers / p.pp
    act_bytes = b * (s // p.cp) * m.d_model * el
    tp_comm = tp_exposed = sp_copies = 0.0
    if p.tp > 1:
        bw, al = link(topo, "tp", dev)
        t_ag, t_rs, t_ar = (collective(kind, act_bytes, p.tp, bw, al) for kind in ("all_gather", "reduce_scatter",
                                                                                    "all_reduce"))
        one = t_ag + t_rs if p.sequence_parallel else t_ar  # SP: two per site
        fwd_sites = 2 * layers * (2 if ac in ("full", "op") else 1)  # forward (and recomputed forward) sites
        blocks = one * (2 * layers + fwd_sites)  # and the backward's 2 per block
        if "float8" in features and p.sequence_parallel and dev.op_s == 0:  # Float8 TP: all-gathers in fp8
            blocks -= fwd_sites * (t_ag - collective("all_gather", act_bytes / el, p.tp, bw, al))
        # the embedding's pair; vocabulary-parallel cross-entropy (last stage, the slowest): max, sum of exp,
        # target logit per token
        rest = 2 * one + 3 * collective("all_reduce", 4 * b * (s // p.cp), p.tp, bw, al)
        tp_comm = tp_exposed = blocks + rest
        if p.sequence_parallel and dev.op_s == 0 and not {"async_tp", "megatron_tp_overlap"} & set(features):
            from .plan_features import sp_copy_bytes  # the chunk + cat beside each collective on the sequence dim
            fp8_ag = "float8" in features
            f_b, r_b, b_b = sp_copy_bytes(act_bytes / el, el, layers, ac in ("full", "op"), 1 if fp8_ag else el)
            fwd, recompute, bwd = fwd + f_b / hbm, recompute + r_b / hbm, bwd + b_b / hbm
            sp_copies = (f_b + r_b + b_b) / hbm
        if "async_tp" in features and dev.op_s == 0:  # the blocks' collectives behind their linears' matmuls
            from .plan_features import async_tp_exposed
            tp_exposed = async_tp_exposed(blocks, t_mm * share * (4 / 3 if ac == "full" else 1), p.tp) + rest
        elif "megatron_tp_overlap" in features and dev.op_s == 0:  # the backward's behind the column GEMMs
            from .plan_features import block_weights, column_share, megatron_tp_backward
            gemm = t_mm * share * column_share(block_weights(cfg), m.d_model) / 3 / layers  # one pass, one block
            exposed, moved = megatron_tp_backward(t_ag, t_rs, t_ar, p.sequence_parallel, gemm)
            tp_comm += layers * moved - 2 * layers * one
            tp_exposed = blocks - 2 * layers * one + layers * exposed + rest
    cp_comm = ring = uly = cp_traffic = 0.0
    if p.cp // u > 1 and "torch_cp" in features:  # PyTorch's context_parallel (plan_features.torch_cp_costs)
        from .plan_features import torch_cp_costs, torch_cp_elements
        r, e = p.cp // u, torch_cp_elements(cfg)
        bw, al = link(topo, "cp", dev, r)  # K/V: 2 x 2 bytes per query element, dK/dV in fp32: 2 x 4
        c = torch_cp_costs(r, e, t_attn / layers, collective("all_gather", r * 4 * e, r, bw, al),
                           collective("p2p", 8 * e, 2, bw, al), hbm)
        passes = 2 if ac in ("full", "selective") else 1  # the recomputed forward gathers and merges again
        ring = layers * (c["fwd_exposed"] * passes + c["bwd_exposed"])
        cp_comm = ring
        fwd, bwd = fwd + layers * c["fwd_traffic"], bwd + layers * c["bwd_traffic"]
        recompute += layers * c["fwd_traffic"] if passes == 2 else 0.0
        cp_traffic = layers * (c["fwd_traffic"] * passes + c["bwd_traffic"])
    elif p.cp // u > 1:  # ring (parallel/context.py), per block and ring size r: forward r - 1 exchanges
        r = p.cp // u  # of k, v; backward r + 1: k, v first, k, v with the passed dK, dV, the last dK, dV, the final
        bw, al = link(topo, "cp", dev, r)
        kv = 2 * b * (s // p.cp) * m.kv_heads * m.head_dim / min(p.tp, m.kv_heads) / u * el
        one, two = collective("p2p", kv, 2, bw, al), collective("p2p", 2 * kv, 2, bw, al)
        ring = layers * ((r - 1) * one + 3 * one + (r - 2) * two)
        cp_comm = max(0.0, ring - (t_attn + (t_attn / 3.5 if ac in ("full", "selective") else 0)))
    if u > 1:  # Ulysses (parallel/ulysses.py): q, k, v, out all-to-all forward, their gradients backward
        bw, al = link(topo, "cp", dev, u)
        x = b * (s // p.cp) * m.d_model / p.tp * el
        kvh = max(m.kv_heads / p.tp, u) if m.kv_heads / p.tp < u else m.kv_heads / p.tp
        heads = m.d_model / m.head_dim / p.tp
        uly = layers * (2 * collective("all_to_all", x, u, bw, al) + 2 * collective("all_to_all", x * kvh / heads, u, bw, al))
        uly *= 2 + (1 if ac != "none" else 0)  # backward: one all-to-all per forward one; recompute repeats them
        cp_comm += uly  # between dependent kernels: exposed
    ep_comm, ep_tiers = 0.0, {}
    if m.n_experts:  # per MoE layer: dispatch + combine, forward and backward; counts; batch-wide stats
        moe_layers = m.n_layers / max(1, m.moe_every) / p.pp
        rows = b * (s // p.cp) * m.moe_top_k * m.d_model * el
        if padded_dispatch(p.ep_dispatch, m.moe_capacity_factor):  # E blocks of C rows (parallel/expert.py)
            rows = m.n_experts * expert_capacity(m.moe_capacity_factor, b * (s // p.cp), m.moe_top_k,
                                                 m.n_experts) * m.d_model * el
        if p.ep > 1:
            bw, al = link(topo, "ep", dev)
            tiers = not (dev.comm_curve or dev.comm_n) and ep_nodes(topo, dev)[0] > 1
            if tiers:  # the group spans nodes: each tier's bytes on its own link (plan_moe.py)
                one, ep_tiers = a2a_seconds(cfg, topo, dev, b * (s // p.cp), el, rows / (m.d_model * el))
            else:
                one = collective("all_to_all", rows, p.ep, bw, al)
            ep_comm += moe_layers * (4 * one + collective("all_to_all", 8 * m.n_experts, p.ep, bw, al))
        if p.dp * p.cp > 1:
            bw, al = link(topo, "dp_cp", dev)
            ep_comm += moe_layers * 2 * collective("all_reduce", 4 * (2 * m.n_experts + 3), p.dp * p.cp, bw, al)
    if cpu:  # gloo runs on the cores that compute: nothing hides behind compute
        cp_comm = ring + uly
    ep_total = ep_comm
    if "dualpipe_overlap" in features and not cpu:  # F&B pairs: one chunk's all-to-alls behind the other's compute
        paired = paired_share(p.pp_schedule, p.pp, p.microbatches)
        ep_comm = (1 - paired) * ep_comm + paired * max(0.0, ep_comm - (fwd + bwd + recompute))
    f_mb = fwd + (tp_exposed + cp_comm + ep_comm) / 3
    b_mb = bwd + recompute + 2 * (tp_exposed + cp_comm + ep_comm) / 3
    mbs = p.microbatches
    # data-parallel collectives of the engine
    dp_exposed, dp_total, copies = 0.0, 0.0, 0.0
    if "fsdp2" in features and p.zero_stage == 3 and not cpu:  # FSDP2's copy-out / copy-in on the compute stream
        from .plan_features import fsdp2_copy_bytes
        gathers = 1 if p.pp > 1 or not p.reshard_after_forward else 2  # in pipeline stages: once per step
        copies = fsdp2_copy_bytes(mem["gathered_total"], mem["reduce_total"], gathers, mem.get("root_gathered", 0.0)) \
            / hbm * (1 if p.pp > 1 else mbs)
    elif p.zero_stage == 3 and p.pp == 1 and not cpu and mem["reduce_total"] != mem["gathered_total"]:
        copies = mbs * (mem["gathered_total"] + mem["reduce_total"]) / hbm  # shardlab's cast to the reduce dtype
    if p.pp > 1 and p.zero_stage:  # stage-local sharding (pipeline/sharded.py): once per step, exposed
        n = p.dp_shard * p.cp if p.zero_stage == 3 else p.dp * p.cp
        bw, al = link(topo, "dp_shard_cp" if p.zero_stage == 3 else "dp_cp", dev)
        ag = collective("all_gather", mem["gathered_total"], n, bw, al)
        rs = collective("reduce_scatter", mem["reduce_total"], n, bw, al)
        dp_total = dp_exposed = ag + rs
        if "fsdp2" in features and p.zero_stage == 3 and not cpu:  # FSDP2 in torch's pipelining: each unit
            # gathered in the first micro-batch's forward, behind it but the stage's first two units; all
            # reduce-scatters issued together after the last backward, then waited (exposed)
            edge = 2 * collective("all_gather", mem["gathered_total"] / (layers + 1), n, bw, al)
            dp_exposed = edge + max(0.0, ag - edge - f_mb) + rs
        if p.zero_stage == 3 and p.dp_replicate > 1:
            bw, al = link(topo, "dp_replicate", dev)
            dp_exposed += collective("all_reduce", mem["grads"], p.dp_replicate, bw, al)
    elif p.zero_stage == 3:
        n = p.dp_shard * p.cp
        bw, al = link(topo, "dp_shard_cp", dev)
        gathered = mem["gathered_total"]
        k = max(1, mem.get("units", 1))  # per unit: gather (forward, again backward), reduce-scatter
        per_mb = k * (collective("all_gather", gathered / k, n, bw, al) * (2 if p.reshard_after_forward else 1)
                      + collective("reduce_scatter", mem["reduce_total"] / k, n, bw, al))
        dp_total = per_mb * mbs
        # a micro-batch's edges have no compute beside them: the root unit's gather (embedding, final
        # norm, head) and the first block's open its forward, the first block's reduce-scatter and the
        # root's (made when the whole backward is done) close its backward; the rest hides behind compute
        root = min(mem.get("root_gathered", 0.0), gathered)
        block = (gathered - root) / max(1.0, k - 1)
        ratio = mem["reduce_total"] / gathered if gathered else 0.0
        edges = sum(collective("all_gather", x, n, bw, al) + collective("reduce_scatter", x * ratio, n, bw, al)
                    for x in (root, block))
        dp_exposed = dp_total if cpu else max(0.0, dp_total - mbs * (edges + f_mb + b_mb)) + mbs * edges
        if p.dp_replicate > 1:
            bw, al = link(topo, "dp_replicate", dev)
            dp_exposed += collective("all_reduce", mem["grads"], p.dp_replicate, bw, al)
    elif p.dp * p.cp > 1:
        n = p.dp * p.cp
        bw, al = link(topo, "dp_cp", dev)
        if p.zero_stage == 0:
            dp_total = collective("all_reduce", mem["grads"], n, bw, al)
            last_bucket = collective("all_reduce", min(mem["grads"], p.bucket_cap_mb * 2**20), n, bw, al)
            hide = b_mb if (p.overlap_comm and p.pp == 1 and not cpu) else 0.0
            dp_exposed = max(last_bucket, dp_total - hide)
        else:
            full = mem["params"]
            rs = collective("reduce_scatter", full, n, bw, al) * (mbs if p.zero_stage == 2 else 1)
            ag = collective("all_gather", full, n, bw, al)
            dp_total = rs + ag
            dp_exposed = ag + max(0.0, rs - (b_mb * mbs if p.overlap_comm and not cpu else 0.0))
    # the schedule
    if p.pp > 1:  # the schedule simulated once per (schedule, pp, m, v) with equal F, B, W
        bw, al = link(topo, "pp", dev)
        boundary = act_bytes / (p.tp if p.sequence_parallel else 1)  # sequence-parallel: each TP rank's shard
        p2p = 2 * collective("p2p", boundary, 2, bw, al)  # the activation forward, its gradient backward
        pp_p2p = mbs * p.pp_virtual * p2p
        f_st, b_st = f_mb + p.pp_virtual * p2p / 2, b_mb + p.pp_virtual * p2p / 2
        _, _, frac = schedule_peaks(p.pp_schedule, p.pp, mbs, p.pp_virtual)
        # the steady state at the busiest rank's pace (busiest_share), fill and drain at the average's
        span = mbs * (f_st + b_st) * (busiest_share(cfg) + frac / max(1e-9, 1 - frac))
        bubble = span - mbs * (f_st + b_st)
    else:
        span, bubble, pp_p2p = mbs * (f_mb + b_mb), 0.0, 0.0
    if "foreach_adamw" in features and not cpu:  # torch's foreach AdamW and clip (plan_features.adamw_bytes)
        from .plan_features import adamw_bytes
        optimizer = adamw_bytes(mem["opt_elems"], t.grad_clip > 0) / hbm
    else:  # the engine's: every state byte read and written once
        optimizer = 2 * (mem["params"] + mem["grads"] + mem["optim"]) / hbm
    if t.grad_clip > 0 and topo.world_size > 1:  # the global gradient norm: one small all-reduce
        bw, al = link(topo, "world", dev) if (dev.comm_n or dev.comm_curve) else (dev.inter_bw, dev.inter_alpha)
        optimizer += collective("all_reduce", 8, topo.world_size, bw, al)
    step = span + dp_exposed + optimizer + copies
    compute = mbs * (fwd + bwd + recompute)
    exposed = step - compute - max(bubble, 0.0) - optimizer - copies
    return {"step_s": step, "compute": compute, "exposed_comm": max(exposed, 0.0), "bubble": max(bubble, 0.0),
            "optimizer": optimizer, "tp_comm": tp_comm * mbs, "dp_comm": dp_total, "cp_comm": cp_comm * mbs, "ep_comm": ep_total * mbs,
            "ep_exposed": ep_comm * mbs, "ep_tiers": ep_tiers,
            "matmul": mbs * t_mm, "attention": mbs * t_attn, "elementwise": mbs * t_elem, "recompute": mbs * recompute,
            "fp8_casts": mbs * t_cast, "tp_exposed": tp_exposed * mbs, "cp_traffic": mbs * cp_traffic,
            "copies": copies, "pp_p2p": pp_p2p, "sp_copies": mbs * sp_copies}
