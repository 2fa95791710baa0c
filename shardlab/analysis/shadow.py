"""A rank's model without running a rank: the meta model cut by the engines' own code
(``tensor.apply``, ``expert.apply``, ``pipeline.stage.split_model``) against a *shadow* mesh
(sizes and coordinates from ``Topology``, no process group; collectives return the right
shapes), and :func:`trace_saved`, the bytes its forward saves for backward per region, the
attention core traced as a fused kernel (docs/planner.md, Memory model)."""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.topology import Topology
from .shadow_ops import OpCount, meta_routing


class ShadowComm:
    """Collectives on meta tensors: shapes only, no communication."""

    def __init__(self, name: str, size: int, rank: int):
        self.name, self.size, self.rank = name, size, rank

    def all_reduce(self, x, op="sum"):
        return x

    def all_gather(self, x, dim=0):
        return torch.cat([x] * self.size, dim=dim)

    def reduce_scatter(self, x, dim=0):
        # a fresh storage, as the real collective's output: a chunk of a contiguous tensor can
        # itself be contiguous (micro-batch 1, sequence dim), and .contiguous() would then return
        # a view of the whole input, so the next block's input counted the whole embedding output
        return x.chunk(self.size, dim=dim)[self.rank].clone(memory_format=torch.contiguous_format)

    def all_to_all(self, x, in_splits=None, out_splits=None):
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        return x.new_empty((rows,) + tuple(x.shape[1:]))

    def broadcast(self, x, src=0):
        return x


class ShadowMesh:
    """What the parallel modules ask a Mesh at construction and in forward: sizes, coordinates,
    communicators. Built from the config's Topology for one global rank."""

    def __init__(self, topo: Topology, rank: int = 0):
        self.topo, self.rank = topo, rank
        self.device = torch.device("meta")
        self.world_size = topo.world_size
        self._coords = topo.coords(rank)

    def size(self, name: str) -> int:
        return self.topo.size(name)

    def local_rank(self, name: str) -> int:
        if name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "edp"):
            return self._coords[name] if name != "edp" else 0
        group = self.topo.group_of(name, self.rank)
        return group.index(self.rank)

    def comm(self, name: str) -> ShadowComm:
        return ShadowComm(name, self.size(name), self.local_rank(name))


def local_model(cfg, rank: int = 0, dtype=torch.float32) -> nn.Module:
    """The meta model global rank ``rank`` holds before its data-parallel engine wraps it: LoRA
    adapters, then TP -> EP -> the pipeline split, exactly as ``parallelize`` applies them."""
    from ..models.spec import add_adapters, get_spec, meta_model
    p = cfg.parallel
    topo = Topology.from_config(p)
    mesh = ShadowMesh(topo, rank)
    spec = get_spec(cfg.model)
    model = meta_model(cfg.model, dtype=dtype)
    if cfg.train.lora_rank:
        add_adapters(model, cfg.train)
    if p.tp > 1:
        from ..parallel import tensor
        tensor.apply(model, mesh, cfg, spec.tp_plan)
    if cfg.model.n_experts > 0:
        from ..parallel import expert
        hier = p.ep_dispatch == "hierarchical"  # traced as the exact dispatch: its hops are priced by plan_moe.py
        model = expert.apply(model, mesh, replace(cfg, parallel=replace(p, ep_dispatch="exact")) if hier else cfg)
    if p.pp > 1:  # the cut the engine makes (pipeline/executor.py apply): the schedule's layout
        from ..parallel.pipeline.stage import split_model
        from .plan_pipeline import layout
        sched = layout(cfg)
        model, _, _ = split_model(model, spec, mesh.local_rank("pp"), p.pp, sched.v, owner=sched.rank_of,
                                  dual=sched.layout == "dual", split=p.pp_split)
    return model


def stage_ranges(cfg) -> list[range]:
    """Layer ranges of every stage id, from the pipeline's own partition (stage.split_model:
    DualPipe's ids p..2p-1 run the p parts again)."""
    p = cfg.parallel
    if p.pp == 1:
        return [range(cfg.model.n_layers)]
    from .plan_pipeline import layout, n_parts
    ranges = list(_ranges(tuple(sorted(vars(cfg.model).items())), n_parts(cfg), p.pp_split))
    return ranges + ranges if layout(cfg).layout == "dual" else ranges


@functools.lru_cache(maxsize=64)
def _ranges(model_items: tuple, n_stages: int, split: str = "balanced") -> tuple:
    from ..config import ModelConfig
    from ..models.spec import get_spec, meta_model
    from ..parallel.pipeline.stage import model_partition
    mc = ModelConfig(**dict(model_items))
    return tuple(model_partition(meta_model(mc), get_spec(mc), n_stages, split))


# -- what autograd saves -------------------------------------------------------------------------

class _Fused(torch.autograd.Function):
    """Stand-in for a fused attention kernel: saves q, k, v, out and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, s, d = q.shape
        out = q.new_empty((b, s, h, d)).transpose(1, 2)  # the kernels' (B, S, H, D) layout
        lse_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        lse = q.new_empty((b, h, s), dtype=lse_dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - traces never run backward
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def fused_attention(on_call=None):
    """Within the block, ``F.scaled_dot_product_attention`` behaves (for memory) like flash attention.
    ``on_call(nbytes)``: told the bytes of each call's output and log-sum-exp."""
    old = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if on_call is not None:
            lse = 4 if q.dtype in (torch.float16, torch.bfloat16) else q.element_size()
            on_call(q.numel() * q.element_size() + q.numel() // q.shape[-1] * lse)
        return _Fused.apply(q, k, v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = old


@dataclass
class SavedTrace:
    """Bytes autograd saves for backward in one forward of one micro-batch, by region."""

    regions: dict = field(default_factory=dict)
    """{region name: bytes} in forward order: ``first`` (pp_first modules), ``layers.<i>``, ``last``."""
    block_input: dict = field(default_factory=dict)
    """{block name: bytes of its input activation} (what full recomputation keeps)."""
    core_only: dict = field(default_factory=dict)
    """{block name: bytes saved only by the attention core} (what selective recomputation frees)."""
    core_inputs: dict = field(default_factory=dict)
    """{block name: bytes of the core's inputs not saved otherwise} (what selective recomputation
    keeps: the checkpoint holds them itself, outside autograd's saved tensors)."""
    core_outputs: dict = field(default_factory=dict)
    """{block name: bytes of the core's outputs}: under selective recomputation the checkpoint's
    output is a fresh storage, saved by the next projection (without it, a view of one already counted)."""
    logits: int = 0
    """Bytes of the largest output of the last region's modules (the logits)."""
    loss_copy: int = 0
    """Bytes of the largest tensor an operator of the last region creates: under bf16 the loss's
    fp32 copy of the logits (both cross-entropies cast before their softmax), else the logits'
    size (plan_activations.loss_transient)."""
    wgrad: dict = field(default_factory=dict)
    """{region: bytes a split backward (ZB-H1, DualPipe) holds for the deferred W after B}: the
    distinct inputs of the modules whose W is direct (pipeline/wgrad.py ``direct_input``) and
    the gradients of every parameter-owning module's output."""
    ops: dict = field(default_factory=dict)
    """{region: aten operators the forward dispatches} (each also runs a backward)."""
    ew_bytes: dict = field(default_factory=dict)
    """{region: bytes written by the forward's operators other than matrix products (new
    storages only; views and in-place ops write none)}: the elementwise traffic."""
    mm_flops: dict = field(default_factory=dict)
    """{region: forward FLOPs of its 2-D matrix products (``mm``/``addmm``: the Linears)}."""
    op_recompute_flops: dict = field(default_factory=dict)
    """{region: forward FLOPs of the products the ``op`` recomputation policy recomputes}."""
    op_kept: dict = field(default_factory=dict)
    """{region: bytes of the outputs the ``op`` policy keeps (its kept products, the attention
    kernel's output and log-sum-exp)}."""
    graph_kept: bool = False
    """Some parameter-owning module's W needs autograd (not ``direct_input``): B retains the
    graph, so a micro-batch's saved tensors stay until its W."""

    @property
    def total(self) -> int:
        return sum(self.regions.values())

    def op_shares(self, n_layers: int) -> dict:
        """What the ``op`` policy recomputes in a model of ``n_layers`` blocks, as shares of the
        whole forward: ``op_mm`` of the matrix-product FLOPs, ``op_ops`` / ``op_ew`` / ``op_saved``
        of the operators / elementwise bytes written / bytes saved (the blocks' part: all of a
        block's non-product work is recomputed). Per-block figures are the traced blocks' mean."""
        blocks = [r for r in self.regions if r not in ("first", "last")]

        def mean(d):
            return sum(d.get(b, 0) for b in blocks) / max(1, len(blocks))

        def share(d):
            whole = n_layers * mean(d) + sum(d.get(r, 0) for r in ("first", "last"))
            return n_layers * mean(d) / whole if whole else 0.0
        mm = mean(self.mm_flops)
        return {"op_mm": share(self.mm_flops) * (mean(self.op_recompute_flops) / mm if mm else 0.0),
                "op_ops": share(self.ops), "op_ew": share(self.ew_bytes), "op_saved": share(self.regions)}


def trace_saved(cfg, micro_batch: int, seq_len: int, dtype=torch.float32, rank: int = 0,
                autocast: str | None = None) -> SavedTrace:
    """Run one forward of ``micro_batch`` sequences of ``seq_len`` tokens (the rank's local
    sequence) through the model rank ``rank`` holds, on meta, and account what is saved.
    ``dtype``: the parameters'; ``autocast`` ("cpu", "cuda"): under bf16 autocast's rules."""
    from ..models.spec import get_spec
    spec = get_spec(cfg.model)
    model = local_model(cfg, rank, dtype)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    blocks = spec.blocks(model)
    first = [getattr(model, n) for n in (spec.pp_first or ()) if getattr(model, n, None) is not None]
    last = [getattr(model, n) for n in spec.pp_last if getattr(model, n, None) is not None]
    cores: dict[str, list] = {}
    for owner, attr in (spec.attention(model) if spec.attention else []):
        name = next((n for n, blk in blocks.items() if any(m is owner for m in blk.modules())), None)
        cores.setdefault(name, []).append(getattr(owner, attr))
    out = SavedTrace()
    state = {"region": "first", "in_core": None}
    seen: dict[int, tuple[str, int]] = {}
    core_saved: dict[str, set] = {}
    other_saved: set = set()
    core_in: dict[str, set] = {}
    alive = []  # every packed tensor stays referenced: a freed storage's id is never reused

    def pack(t):
        st = t.untyped_storage()
        key = st._cdata
        alive.append(t)
        if key not in params:
            if key not in seen:
                seen[key] = (state["region"], st.nbytes())
            (core_saved.setdefault(state["in_core"], set()) if state["in_core"] else other_saved).add(key)
        return t

    def enter(region):
        return lambda m, a, kw=None: state.__setitem__("region", region)

    hooks = []
    from ..models.moe import MoE
    from ..parallel.pipeline.wgrad import direct_input
    routing: dict = {}
    wg_seen: set = set()

    def moe_pre(m, args):
        routing["rows"] = args[0].numel() // args[0].shape[-1] * m.top_k

    def owner_pre(m, args):
        x = direct_input(m, args)
        if x is None:
            out.graph_kept = True
        else:
            st = x.untyped_storage()
            alive.append(x)
            if st._cdata not in wg_seen:
                wg_seen.add(st._cdata)
                out.wgrad[state["region"]] = out.wgrad.get(state["region"], 0) + st.nbytes()

    def owner_post(m, a, o):
        if torch.is_tensor(o) and o.requires_grad:  # its gradient g, a fresh storage of o's size
            out.wgrad[state["region"]] = out.wgrad.get(state["region"], 0) + o.numel() * o.element_size()

    for m in first:
        hooks.append(m.register_forward_pre_hook(enter("first")))
    for name, blk in blocks.items():
        def pre(m, args, name=name):
            state["region"] = name
            x = args[0]
            out.block_input[name] = x.untyped_storage().nbytes() if torch.is_tensor(x) else 0
        hooks.append(blk.register_forward_pre_hook(pre))
        for core in cores.get(name, []):
            def core_pre(m, args, name=name):
                state["in_core"] = name
                core_in[name] = {a.untyped_storage()._cdata: a.untyped_storage().nbytes() for a in args[:3]}
                alive.extend(args[:3])  # their ids must not be reused by tensors saved later
            hooks.append(core.register_forward_pre_hook(core_pre))
            def core_post(m, a, o, name=name):
                state["in_core"] = None
                out.core_outputs[name] = out.core_outputs.get(name, 0) + (o.untyped_storage().nbytes() if torch.is_tensor(o) else 0)
            hooks.append(core.register_forward_hook(core_post))
    for m in last:
        hooks.append(m.register_forward_pre_hook(enter("last")))
        hooks.append(m.register_forward_hook(
            lambda m, a, o: setattr(out, "logits", max(out.logits, o.untyped_storage().nbytes()))
            if torch.is_tensor(o) and o.dim() > 1 else None))
    for mod in model.modules():
        if isinstance(mod, MoE):
            hooks.append(mod.register_forward_pre_hook(moe_pre))
        if any(q.requires_grad for q in mod.parameters(recurse=False)):
            hooks.append(mod.register_forward_pre_hook(owner_pre))
            hooks.append(mod.register_forward_hook(owner_post))
    try:
        batch = _meta_batch(cfg, spec, model, micro_batch, seq_len, dtype)
        def attn(nbytes):
            out.op_kept[state["region"]] = out.op_kept.get(state["region"], 0) + nbytes
        low = torch.bfloat16 if autocast else None    # the trace's autocast dtype
        cast = AutocastTrace(low, autocast) if autocast else contextlib.nullcontext()
        with fused_attention(attn), meta_routing(routing, low), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                OpCount(out, state), cast:
            model(*batch)
    finally:
        for h in hooks:
            h.remove()
    for key, (region, nbytes) in seen.items():
        out.regions[region] = out.regions.get(region, 0) + nbytes
    for name in blocks:
        only = core_saved.get(name, set()) - other_saved
        out.core_only[name] = sum(seen[k][1] for k in only)
        out.core_inputs[name] = sum(n for k, n in core_in.get(name, {}).items() if k not in other_saved)
    return out


def _meta_batch(cfg, spec, model, micro_batch: int, seq_len: int, dtype) -> tuple:
    """Meta inputs: token ids (or the previous stage's hidden states) and, on the last stage, targets."""
    if spec.task != "lm":
        small = copy.deepcopy(cfg)
        g = torch.Generator().manual_seed(0)
        x, y = spec.sample_batch(small, micro_batch, g) if spec.sample_batch else (None, None)
        return (x.to("meta").to(dtype) if x.is_floating_point() else x.to("meta"), y.to("meta"))
    firsts = [n for n in (spec.pp_first or ()) if getattr(model, n, None) is not None]
    tokens = torch.empty((micro_batch, seq_len + 1), dtype=torch.int64, device="meta")  # inputs and
    if firsts or not spec.pp_first:  # targets are views of one (B, S + 1) tensor, as in train/data.py
        x = tokens[:, :-1]
    else:
        x = torch.empty((micro_batch, seq_len, cfg.model.d_model), dtype=dtype, device="meta", requires_grad=True)
    owns_last = all(getattr(model, n, None) is not None for n in spec.pp_last)
    if owns_last:
        return (x, tokens[:, 1:])
    return (x,)


class AutocastTrace(torch.overrides.TorchFunctionMode):
    """``torch.autocast`` for the meta trace (autocast has no meta backend): autocast's dtype rules of
    ``device`` applied to the calls the models make, a weight cast once per forward, float64 never
    cast (docs/planner.md, "Activations under autocast")."""

    LOW = (F.linear, torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
           F.conv1d, F.conv2d, F.conv3d)
    """(attention: the trace's fused_attention stands in for SDPA; its inputs are products' outputs)"""
    FP32 = {"cpu": (F.cross_entropy, F.nll_loss),
            "cuda": (F.cross_entropy, F.nll_loss, F.layer_norm, F.softmax, torch.softmax, torch.Tensor.softmax,
                     F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)}

    def __init__(self, dtype: torch.dtype, device: str):
        super().__init__()
        self.dtype, self.fp32, self.cache = dtype, self.FP32["cpu" if device == "cpu" else "cuda"], {}

    def _cast(self, t, dtype):
        if not torch.is_tensor(t) or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
            return t
        if not (t.is_leaf and t.requires_grad):
            return t.to(dtype)
        if (id(t), dtype) not in self.cache:
            self.cache[(id(t), dtype)] = (t, t.to(dtype))  # t kept: its id stays unique
        return self.cache[(id(t), dtype)][1]

    def __exit__(self, *exc):
        self.cache.clear()  # as autocast's own cache of weight casts, emptied when its region ends
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        low = func in self.LOW
        if low or func in self.fp32:
            dtype = self.dtype if low else torch.float32
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)
