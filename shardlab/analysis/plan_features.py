"""Features of published runs the planner models beyond shardlab's own engine (float8, async_tp,
selective_layer_ac, compile, compile_blocks, dualpipe_overlap, torch_cp, fsdp2, foreach_adamw,
megatron_tp_overlap, half_params), each priced from its mechanism, none fitted to a
published run; any other name is refused (plan_layout.refused). docs/planner.md, "Features"."""
from __future__ import annotations

import copy
import functools

MODELLED = {
    "compile": "torch.compile of each block: elementwise work fused (plan_time.ELEMENTWISE_PASSES)",
    "float8": "Float8 linear layers: the blocks' GEMMs at the fp8 peak, the amax / cast passes over their operands; "
              "under sequence-parallel TP the blocks' forward all-gathers in fp8 (torchao's PrepareFloat8ModuleInput)",
    "async_tp": "asynchronous TP: each TP collective in tp chunks behind the blocks' matmuls, the first chunk exposed",
    "selective_layer_ac": "per-layer selective recomputation: every 2nd block fully recomputed (torchtitan's rule)",
    "dualpipe_overlap": "DualPipe's F&B pairs: one chunk's expert all-to-alls behind the other's compute (plan_moe.py)",
    "torch_cp": "PyTorch's context_parallel ring: K/V at the query heads, gathered once per call and waited "
                "after the first chunk, fp32 merges and fp32 dK/dV around the ring (torch_cp_costs)",
    "fsdp2": "PyTorch's FSDP2 (fully_shard): each all-gather's copy-out and the reduce-scatter's copy-in "
             "(chunk_cat, cast to the reduce dtype) on the compute stream (fsdp2_copy_bytes)",
    "compile_blocks": "torch.compile of each transformer block only (torchtitan's apply_compile): the embedding, "
                      "final norm, output head and loss run eager (plan_time: their traced bytes at the eager passes)",
    "megatron_tp_overlap": "Megatron-LM's backward TP collectives of the column-parallel linears behind their "
                           "GEMMs: the input gradient's all-reduce behind the weight gradient; with sequence "
                           "parallel the input's re-gather behind the input gradient and its reduce-scatter behind "
                           "the weight gradient (megatron_tp_backward); its activations are sequence-first "
                           "([s, b, h]), so its sequence-parallel collectives copy nothing (sp_copy_bytes)",
    "foreach_adamw": "torch.optim.AdamW(foreach=True) and clip_grad_norm_ (torchtitan's optimizer): one pass per "
                     "foreach op over the fp32 state instead of fused AdamW's one (adamw_bytes)",
    "half_params": "the model's weights stored in the compute dtype (Megatron-LM's Float16Module: module.bfloat16() "
                   "or .half(); fp32 main parameters, main gradients and Adam moments in its optimizer): no "
                   "per-micro-batch weight copies made, saved or moved (predict.with_half_params)",
}
"""Features the planner prices, by the name a published run's ``features`` uses."""

ADAMW_BYTES = {"foreach": 80, "clip": 12}
"""HBM bytes per stepped element of AdamW with fp32 parameters (the masters), gradients and
moments (a fused step, shardlab's on CUDA, reads p, g, m, v and writes p, m, v: 28; plan_time
prices the engine's as every state byte read and written, 32). foreach
(torch.optim.AdamW(foreach=True), torchtitan's default): one kernel per foreach op, each reading
and writing whole tensors: the decoupled weight decay p *= 1 - lr wd (8), m.lerp_(g)
(12), v *= beta2 (8), v.addcmul_(g, g) (12), t = sqrt(v) (8), t /= sqrt(bias correction) (8),
t += eps (8), p.addcdiv_(m, t) (16). clip: the global norm's foreach_norm over the gradients (4)
and their scaling in place (8), torch.nn.utils.clip_grad_norm_ and shardlab's engines alike.
tests/unit/test_planner_optimizer.py counts the bytes torch's own AdamW and clip move."""


def adamw_bytes(elems: float, clip: bool) -> float:
    """HBM bytes of one foreach AdamW step over ``elems`` elements, with the gradient clip before it
    when ``clip`` (:data:`ADAMW_BYTES`)."""
    return elems * (ADAMW_BYTES["foreach"] + (ADAMW_BYTES["clip"] if clip else 0))

CAST_BYTES = {"x": 2 * (2 + 2 + 1), "w": 2 * (2 + 2 + 1), "dy": 2 + 2 * (2 + 1)}
"""HBM bytes per element of a Float8Linear's operands per micro-batch (bf16 sources, fp8 casts):
x and W: amax (read 2) + cast (read 2, write 1), forward and again in backward; dY: one amax,
two casts (the two backward GEMMs take it in different layouts)."""
RECOMPUTE_CAST_BYTES = {"x": 2 + 2 + 1, "w": 2 + 2 + 1}
"""A recomputed forward's casts of x and W (full recomputation)."""

DUAL = ("dualpipe", "dualpipev")
"""The schedules whose order has DeepSeek's overlapped F&B pairs (dualpipe_overlap)."""

LAYER_AC_FREQ = 2
"""torchtitan's ``selective_ac_option`` for its "selective layer" runs: every 2nd block."""


def layer_ac_blocks(n_layers: int, freq: int = LAYER_AC_FREQ) -> list[bool]:
    """Which blocks torchtitan's layer policy checkpoints: its counter runs over the blocks in
    order, from 1, and wraps block k when ``k % freq == 0`` (freq 0: all)."""
    return [freq == 0 or k % freq == 0 for k in range(1, n_layers + 1)]


def layer_ac_share(n_layers: int, freq: int = LAYER_AC_FREQ) -> float:
    """Fraction of the blocks recomputed under the layer policy."""
    return sum(layer_ac_blocks(n_layers, freq)) / max(1, n_layers)


def async_tp_exposed(comm: float, overlap: float, tp: int) -> float:
    """Seconds of ``comm`` (the blocks' TP collectives) left exposed when each is split into ``tp``
    chunks behind ``overlap`` seconds of matmuls: the first chunk (comm / tp) cannot hide, the
    remaining (tp - 1) / tp hide up to the matmuls' length."""
    if tp <= 1 or comm <= 0:
        return comm
    first = comm / tp
    return first + max(0.0, comm - first - overlap)


def fp8_matmul_seconds(t_mm: float, share: float, peak: float, peak_fp8: float) -> float:
    """Matmul seconds with ``share`` of the FLOPs at the fp8 peak instead of ``peak`` (same
    efficiency)."""
    return t_mm * (1.0 - share) + t_mm * share * peak / peak_fp8


def block_matmul_share(cfg) -> float:
    """Share of the matmul FLOPs in the blocks: all matmul parameters a token passes through
    minus the output head (d_model x vocab), over all (models' own ``matmul_params_per_token``,
    through the spec's FLOPs at sequence length 0: 6 x matmul parameters)."""
    from ..models.spec import get_spec
    m = cfg.model
    total = get_spec(m).flops_per_token(m, 0) / 6.0
    return max(0.0, total - m.d_model * m.vocab_size) / total if total else 0.0


@functools.lru_cache(maxsize=64)
def _block_weights(key: str, cfg_json: str) -> tuple:
    from ..config import from_dict
    from ..models.spec import get_spec
    from .shadow import local_model
    import json
    cfg = from_dict(json.loads(cfg_json))
    spec = get_spec(cfg.model)
    ends = tuple(spec.pp_first or ()) + tuple(spec.pp_last or ())
    model = local_model(cfg, 0)
    return tuple(tuple(p.shape) for n, p in model.named_parameters()
                 if p.dim() == 2 and not n.startswith(tuple(e + "." for e in ends)))


def block_weights(cfg) -> tuple:
    """(out, in) shapes of one block's 2-D weights on a TP rank (its linears, as tensor.apply
    shards them): traced on a one-layer meta model."""
    from .plan_memory import _canonical
    small = copy.deepcopy(cfg)
    small.model.n_layers = 1
    small.parallel.pp, small.parallel.pp_virtual, small.parallel.pp_schedule = 1, 1, "1f1b"
    key = _canonical(small)
    return _block_weights(key, key)


def fp8_cast_bytes(weights, tokens: float, recompute: bool = False) -> float:
    """HBM bytes one block's scaling casts move per micro-batch of ``tokens`` (rank-local rows
    of each linear's input): :data:`CAST_BYTES` per element of x (tokens x in), W (out x in) and
    dY (tokens x out), plus :data:`RECOMPUTE_CAST_BYTES` for a recomputed forward."""
    x = sum(tokens * i for _, i in weights)
    w = sum(o * i for o, i in weights)
    dy = sum(tokens * o for o, _ in weights)
    out = CAST_BYTES["x"] * x + CAST_BYTES["w"] * w + CAST_BYTES["dy"] * dy
    if recompute:
        out += RECOMPUTE_CAST_BYTES["x"] * x + RECOMPUTE_CAST_BYTES["w"] * w
    return out


TORCH_CP_BYTES = {"cast": 6, "merge": 32, "kv_cat": 8, "bwd_zeros": 12, "bwd_first": 30, "bwd_step": 36,
                  "dkv_cat": 16, "bwd_end": 18}
"""HBM bytes per element of a rank's query block (b x s/cp x heads/tp x head_dim; its K and V
have as many, repeated to the query heads) that PyTorch's ring attention
(torch.distributed.tensor.experimental context_parallel, ``_templated_ring_attention`` and its
backward, load-balanced, ``convert_to_f32``) moves outside the attention kernels on the ring's
last rank (whose every step is a full merge), counted from its eager operations: each step's
output cast to fp32 and the final cast back (read 2 write 4, read 4 write 2: 6 each, r + 1 of
them), a merge (``out - block_out`` and the update: read 8 write 4 each; the sigmoid-weighted
product: read 4 write 4), the K/V concatenation sent on each step but the last (read 4 write 4);
in the backward the three fp32 accumulators zeroed (12), the first step's dK, dV and dQ added
into them (3 x 10), each later step's dK and dV added into their first halves and concatenated
back (2 x 13) and dQ added (10), the K/V concatenation on each step but the last (8), the fp32
dK/dV concatenated for the next rank on every step (16), and at the end dQ and dK/dV cast back
(6 + 12). Checked against the bytes torch's own functions move on CPU
(tests/distributed/test_torch_cp_bytes.py)."""


def torch_cp_fwd_bytes(r: int) -> int:
    """Bytes per query element of one forward of PyTorch's ring over ``r`` ranks (last rank)."""
    c = TORCH_CP_BYTES
    return (r + 1) * c["cast"] + (r - 1) * (c["merge"] + c["kv_cat"])


def torch_cp_bwd_bytes(r: int) -> int:
    """Bytes per query element of its backward (last rank)."""
    c = TORCH_CP_BYTES
    return (c["bwd_zeros"] + c["bwd_first"] + (r - 1) * (c["bwd_step"] + c["kv_cat"]) + r * c["dkv_cat"]
            + c["bwd_end"])


def torch_cp_elements(cfg) -> float:
    """Elements of a rank's query block under PyTorch's ring (b x s/cp x heads/tp x head_dim); its K
    and V have as many each, repeated to the query heads before the attention call."""
    from .plan_activations import micro_batch
    m, p = cfg.model, cfg.parallel
    return micro_batch(cfg) * (cfg.train.seq_len // p.cp) * (m.n_heads / p.tp) * m.head_dim


def torch_cp_costs(r: int, elements: float, t_attn_block: float, ag_s: float, dkv_s: float, hbm: float) -> dict:
    """Per block and micro-batch of PyTorch's ring over ``r`` ranks: the seconds its all-gather of
    K/V (``ag_s``, issued with the first chunk's kernel and waited before the second) and its
    per-step fp32 dK/dV exchange (``dkv_s``: the r - 1 sent before a later step's kernel are behind
    it; the last, sent after the last kernel to bring each rank's dK/dV home, is waited after the
    loop with no kernel behind it, so exposed whole) leave exposed in one forward and in the
    backward, and the seconds of its eager traffic (:data:`TORCH_CP_BYTES` per
    query element, :func:`torch_cp_elements`) at ``hbm`` bytes/s. ``t_attn_block``: the block's
    attention forward + backward seconds (the backward 2.5 x the forward); each of the ``r`` steps
    computes 1/r of it (load-balanced)."""
    fwd_step, bwd_step = t_attn_block / 3.5 / r, t_attn_block * 2.5 / 3.5 / r
    return {"fwd_exposed": max(0.0, ag_s - fwd_step),
            "bwd_exposed": max(0.0, ag_s - bwd_step) + (r - 1) * max(0.0, dkv_s - bwd_step) + dkv_s,
            "fwd_traffic": torch_cp_fwd_bytes(r) * elements / hbm, "bwd_traffic": torch_cp_bwd_bytes(r) * elements / hbm}


def sp_copy_bytes(full: float, el: int, layers: float, recomputed: bool, ag_el: int) -> tuple:
    """HBM bytes (forward, recomputed forward, backward; one micro-batch) of the copies beside
    sequence-parallel TP collectives on the sequence dim of (batch, sequence, hidden) activations:
    NCCL gathers and scatters along dim 0, so an all-gather on dim 1 is followed by a chunk + cat
    of its output and a reduce-scatter on dim 1 is preceded by one of its input (PyTorch's
    functional collectives under DTensor's Shard(1), torchtitan's sequence parallel; shardlab's
    collectives.all_gather / reduce_scatter on its SEQ_DIM = 1), each reading and writing the
    gathered tensor (``full`` elements). Per block two sites (attention, MLP), each one all-gather
    and one reduce-scatter, in the forward, again in a recomputed forward, and their mirror images
    in the backward; the embedding's reduce-scatter and the final norm's all-gather once each way.
    ``ag_el``: bytes per gathered element in the forward (1 when Float8 gathers in fp8).
    Megatron-LM's activations are sequence-first ([s, b, h]) and asynchronous TP consumes the
    shards where they land: neither copies (plan_time prices none for them)."""
    site_fwd, site = 2 * full * (ag_el + el), 4 * full * el
    fwd = 2 * layers * site_fwd + site
    return fwd, (2 * layers * site_fwd if recomputed else 0.0), 2 * layers * site + site


def column_share(weights, d_model: int) -> float:
    """Share of a block's linear weights (``block_weights`` on a TP rank) that are column-parallel:
    those whose input is the whole hidden size (q, k, v, gate, up / fc1); the row-parallel ones
    (output projection, down / fc2) take a TP shard of theirs."""
    col = sum(o * i for o, i in weights if i == d_model)
    total = sum(o * i for o, i in weights)
    return col / total if total else 0.0


def megatron_tp_backward(ag: float, rs: float, ar: float, sp: bool, gemm: float) -> tuple[float, float]:
    """(exposed, moved) seconds of one block's backward TP collectives as Megatron-LM runs them
    (megatron/mpu/layers.py, 2022: ColumnParallelLinearWithAsyncAllreduce and its sequence-parallel
    twin), for collectives of ``ag`` / ``rs`` / ``ar`` seconds and ``gemm`` seconds of one GEMM pass
    (input or weight gradient) of the block's column-parallel linears. Without sequence parallel
    the two column-parallel linears' input-gradient all-reduces run behind their weight-gradient
    GEMMs. With it, each column-parallel linear re-gathers its sequence-sharded input behind its
    input-gradient GEMM and reduce-scatters its input gradient behind its weight-gradient GEMM;
    the row-parallel linears' gradient all-gathers stay exposed."""
    if not sp:
        return max(0.0, 2 * ar - gemm), 2 * ar
    return 2 * ag + max(0.0, 2 * ag - gemm) + max(0.0, 2 * rs - gemm), 4 * ag + 2 * rs


def fsdp2_copy_bytes(gathered: float, reduced: float, gathers: int, root: float = 0.0) -> float:
    """Bytes FSDP2 moves on the compute stream per micro-batch beside its collectives, for a rank
    whose units unshard to ``gathered`` bytes (parameter dtype; ``root`` of them the root unit's:
    embedding, final norm, head) and reduce-scatter ``reduced`` bytes (reduce dtype), each unit
    gathered ``gathers`` times (2 with reshard after forward: forward and backward; the root once,
    FSDP2 keeping it unsharded for the backward that follows). Each gather's copy-out
    (``split_with_sizes_copy`` of the all-gather output into the unsharded parameters) reads and
    writes the unit's bytes; the reduce-scatter's copy-in (``chunk_cat`` of the unsharded gradients
    into its input, in the reduce dtype) reads the gradients (parameter dtype) and writes
    ``reduced`` bytes. Both run on the current stream in torch.distributed.fsdp._fully_shard
    (wait_for_unshard, foreach_reduce), so compute waits for them;
    tests/distributed/test_fsdp2_copy_bytes.py counts them on gloo ranks."""
    return 2 * (gathers * (gathered - root) + root) + gathered + reduced


def applicable(cfg, features) -> tuple:
    """``features`` for one layout of a search: asynchronous TP only where it has something to
    overlap (tp > 1 with sequence parallel), DualPipe's overlap only on DualPipe with experts,
    PyTorch's CP ring only on ring CP layouts, FSDP2's copies only on ZeRO-3 layouts, Megatron's TP
    overlap only with TP."""
    p = cfg.parallel
    dual = p.pp > 1 and p.pp_schedule in DUAL and p.ep > 1 and cfg.model.n_experts
    return tuple(f for f in features if (f != "async_tp" or (p.tp > 1 and p.sequence_parallel))
                 and (f != "dualpipe_overlap" or dual) and (f != "torch_cp" or (p.cp > 1 and p.cp_impl == "ring"))
                 and (f != "fsdp2" or p.zero_stage == 3) and (f != "megatron_tp_overlap" or p.tp > 1))


# Features priced only on a GPU kind: option -> the refusal. Refused for ``--gpu cpu`` before the
# CPU probe runs (refuse_on_cpu), and for any layout that lacks their part (check_features).
GPU_ONLY = {
    "torch_cp": ("--torch-cp", "PyTorch's context_parallel is priced for a ring CP layout on a GPU kind: use a "
                               "cpN part (ring, N >= 2) and a GPU, or leave --torch-cp out"),
    "megatron_tp_overlap": ("--megatron-tp-overlap", "Megatron-LM's TP overlap is priced for a tpN part (N >= 2) "
                                                     "on a GPU kind; add one or leave --megatron-tp-overlap out"),
    "foreach_adamw": ("--foreach-adamw", "torch's foreach AdamW is priced on a GPU kind (shardlab's CPU engine "
                                         "already steps foreach); pick a GPU or leave --foreach-adamw out"),
    "fsdp2": ("--fsdp2", "FSDP2's copies are priced for a ZeRO-3 layout on a GPU kind: use an fsdpN part and a "
                         "GPU, or leave --fsdp2 out"),
    "half_params": ("--half-params", "16-bit weight storage is priced for bf16/fp16 training on a GPU kind "
                                     "(shardlab's CPU engine keeps fp32 weights); pick a GPU or leave "
                                     "--half-params out"),
    "async_tp": ("--async-tp", "asynchronous TP is priced on GPUs (the CPU model overlaps nothing); pick a GPU "
                               "kind or leave --async-tp out"),
    "float8": ("--float8", "the CPU has no fp8 tensor cores (no fp8 peak in the device table); leave --float8 "
                           "out or pick an H100/H200"),
}


def _refuse(feature: str):
    from ..errors import ConfigError
    return ConfigError(*GPU_ONLY[feature])


def refuse_on_cpu(features) -> None:
    """Refuse the GPU-only ``features`` for the CPU, naming the first: callers run it before the
    CPU device is built, so a refusal never waits for the probe (devices.probe_cpu)."""
    for f in features:
        if f in GPU_ONLY:
            raise _refuse(f)


def check_features(cfg, dev, features) -> None:
    """Refuse, naming the feature, what cannot be priced for this layout and device."""
    from ..errors import ConfigError
    for f in features:
        if f not in MODELLED:
            raise ConfigError("features", f"{f!r} is not modelled by the planner; modelled: {', '.join(MODELLED)}")
    if dev.op_s > 0:  # a CPU device (the probe's per-op cost)
        refuse_on_cpu(features)
    p = cfg.parallel
    if "float8" in features:
        if not dev.peak_fp8:
            raise ConfigError("--float8", f"{dev.name} has no fp8 tensor cores (no fp8 peak in the device table); "
                                          "leave --float8 out or pick an H100/H200")
        if cfg.model.n_experts:
            raise ConfigError("--float8", "Float8 linears are modelled for dense models only (MoE experts are not "
                                          "nn.Linear); leave --float8 out")
    if "dualpipe_overlap" in features and not (p.pp > 1 and p.pp_schedule in DUAL and cfg.model.n_experts and p.ep > 1):
        raise ConfigError("--dualpipe-overlap", "DualPipe's overlap hides expert all-to-alls in its F&B pairs: "
                                                "use an epN part and ppN dualpipe (or dualpipev)")
    for f, bad in (("torch_cp", p.cp < 2 or p.cp_impl != "ring"), ("megatron_tp_overlap", p.tp < 2),
                   ("fsdp2", p.zero_stage != 3), ("half_params", cfg.train.precision not in ("bf16", "fp16"))):
        if f in features and bad:
            raise _refuse(f)
    if "async_tp" in features and not (p.tp > 1 and p.sequence_parallel):
        raise ConfigError("--async-tp", "asynchronous TP overlaps the sequence-parallel collectives: use a tpNsp part")
