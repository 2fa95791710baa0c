"""ZeRO-3 / FSDP: parameters, gradients and optimizer states all sharded 1/N.

The model is cut into *units* (``parallel.wrap_policy``: the architecture's blocks by default,
or by size or module class; the rest of the model is the root unit). A unit's parameters are
packed into flat buffers (one per weight-decay group) padded to a multiple of N; a rank keeps
only its slice, the optimizer's parameter (fp32 master). Around each unit:

  pre-forward    all-gather the unit's flat buffer (into a storage that is otherwise empty)
                 and point the modules' weights at views of it; launch the next unit's
                 all-gather now (forward prefetch) so it runs during this unit's compute
  post-forward   free the gathered storage (``reshard_after_forward``), else keep it for backward
  pre-backward   (a hook on the unit's output gradient) re-gather if freed; launch the previous
                 unit's all-gather (backward prefetch)
  post-backward  (hook when the gathered buffer's gradient is complete) reduce-scatter it
                 (in fp32) into the rank's gradient shard and free the gathered storage

Outside its forward a unit's modules hold the model's own parameter objects with empty data
(``_placeholder``), registered, so ``model.parameters()`` lists them (DeepSpeed's ZeRO-3 does the
same); the hooks run eagerly inside a compiled block (distributed/eager.py).

Mixed precision (``train.precision = bf16``): shards stay fp32 masters, the all-gather sends
bf16 compute copies, gradients are cast to fp32 before the reduce-scatter. ``train.param_dtype``
chooses the all-gather/compute dtype (default: the autocast dtype), ``train.reduce_dtype`` the
reduce-scatter's (default: the shards' dtype; bf16 halves its bytes, the sum is then rounded to
bf16 before it is added to the fp32 gradient shard). CPU offload keeps
shards, gradients and optimizer states on the CPU (a no-op copy when the device is the CPU).
Hybrid sharding: shard over ``dp_shard`` (x ``cp``), all-reduce gradient shards over ``dp_replicate``.
Expert parallel: a unit's expert weights get flat buffers of their own, sharded over ``edp``
(the ranks holding the same experts, dp_replicate included) and never all-reduced over
dp_replicate; gradients are divided by dp_cp like the others (zero.py, docs/expert-parallel.md).

Communication per micro-batch: all-gather Psi (forward) + all-gather Psi (backward, only if
resharded) + reduce-scatter Psi: 3 Psi (N-1)/N elements per rank, 1.5x DDP.
Memory per rank: 16 Psi / N (mixed-precision Adam) plus the gathered units in flight.
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.eager import eager
from .engine import Engine
from .materialize import init_flat_range
from .units import unit_params
from .zero import DTYPES, FlatParam, ShardedEngine, flat_groups

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_dtypes(train, autocast_default: bool = True) -> tuple:
    """(gathered / compute dtype, reduction dtype) from ``train.param_dtype`` / ``train.reduce_dtype``
    (FSDP2's MixedPrecisionPolicy param_dtype / reduce_dtype); None: the fp32 shards' dtype. An
    empty param_dtype gathers in the autocast dtype when ``autocast_default`` (FSDPEngine's
    default), else in the shards' dtype (pipeline/sharded.py)."""
    compute = DTYPES[train.param_dtype] if train.param_dtype else (
        _DTYPES.get(train.precision) if autocast_default else None)
    return compute, DTYPES.get(train.reduce_dtype)


class Unit:
    """A module whose parameters are gathered and freed together."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParam]):
        self.name, self.module, self.flats = name, module, flats
        self.gathered, self.pending, self.reduced = False, [], 0


class FSDPEngine(ShardedEngine):
    name, shard_group = "fsdp", "dp_shard_cp"

    def __init__(self, model: nn.Module, mesh, cfg, unit_names: list[str] | None = None, init_fn=None):
        super().__init__(model, mesh, cfg)
        self.init_fn = init_fn  # draws boxes of meta parameters (parallel/materialize.py)
        p = cfg.parallel
        self.replicate_group = "dp_replicate" if mesh.size("dp_replicate") > 1 else None
        self.comm = mesh.comm(self.shard_group)
        self.reshard, self.prefetch = p.reshard_after_forward, p.prefetch
        # Whether all-gathers run in the background (learnt at the first one). On the shared-memory
        # transport they complete when issued, so a prefetch would overlap nothing and only hold
        # the next unit sooner: there it is skipped (docs/data-parallel.md, Where the memory goes).
        self.background = False
        self.home = torch.device("cpu") if p.offload else mesh.device  # where shards live
        # offload to a GPU run: shards in pinned host memory, copied to the device without blocking
        # (the copy is queued on the current stream, which the collective that reads it follows)
        self.pin = self.home.type == "cpu" and mesh.device.type == "cuda"
        # gathered (compute) and reduce-scatter dtypes; None: the shards' dtype
        self.compute_dtype, self.reduce_dtype = mixed_precision_dtypes(cfg.train)
        names = unit_names if unit_names is not None else []
        modules = dict(model.named_modules())
        self.gathered_bytes = self.peak_gathered_bytes = 0  # parameters in flight (benchmarks)
        self._in_backward = False
        self._reducing: list[FlatParam] = []  # reduce-scatters in flight (at most one unit's)
        self.units = [self._make_unit(n, modules[n], names) for n in names]
        self.units.insert(0, self._make_unit("", model, names))  # root: everything else
        self.flats = [f for u in self.units for f in u.flats]
        self._order = self.units[1:]  # forward order of the non-root units
        for i, u in enumerate(self._order):
            u.module.register_forward_pre_hook(eager(lambda m, a, i=i: self._pre_forward(i)))
            u.module.register_forward_hook(eager(lambda m, a, out, i=i: self._post_forward(i, out)))
        model.register_forward_pre_hook(eager(lambda m, a: self._gather(self.units[0], wait=True, prefetch_next=0)))
        model.register_forward_hook(eager(lambda m, a, out: None if torch.is_grad_enabled() else self._free_all()))
        for k, f in enumerate(self.flats):
            _attach(f, None)
            f.seq, f.copies = k, mesh.comm("dp_cp" if f.group == self.shard_group else f.group)
            for ph in f.placeholders:  # shardlab.zero.GatheredParameters finds the values here
                ph._shardlab_flat = f
        for mod in {id(m): m for f in self.flats for sites in f.sites for m, _ in sites}.values():
            mod.register_state_dict_post_hook(_refuse_placeholders)

    # -- building ---------------------------------------------------------------------------
    def _make_unit(self, prefix: str, module: nn.Module, all_units: list[str]) -> Unit:
        """Pack the parameters of ``module`` not owned by a nested unit into flat shards."""
        flats = []
        named = unit_params(module, prefix, all_units)
        for gname, group, wd in list(flat_groups(named, self.shard_group, self.cfg.train.weight_decay)):
            comm = self.mesh.comm(gname)
            f = FlatParam([n for n, _ in group], [p for _, p in group], comm.size, comm.rank, wd)
            f.group, f.comm = gname, comm
            if any(p.is_meta for _, p in group):  # meta model: draw only this rank's range
                f.shard = nn.Parameter(self._init_shard(f, group))
            else:  # a materialised model: every rank holding a copy starts from the first one's values
                full = self.mesh.comm("dp_cp" if gname == self.shard_group else gname).broadcast(
                    f.flatten([p for _, p in group]), 0)
                f.shard = nn.Parameter(f.own(full).clone().to(self.home))
            if self.pin:
                f.shard.data = f.shard.data.pin_memory()
            f.shard.grad = torch.zeros_like(f.shard)
            dtype = self.compute_dtype or f.shard.dtype
            f.full = torch.empty(f.padded, dtype=dtype, device=self.mesh.device)
            f.full.untyped_storage().resize_(0)
            # the unit's gradients are written into one flat buffer as autograd makes them (_Piece);
            # the token's gradient is complete when all of them are: then it is reduce-scattered
            f.grad_flat, f.token = None, torch.empty(0, dtype=dtype, device=self.mesh.device, requires_grad=True)
            f.token.register_post_accumulate_grad_hook(lambda t, f=f: self._post_backward(f))
            f.sites = [_sites(self.model, p) for _, p in group]
            f.placeholders = [_placeholder(p, self.mesh.device) for _, p in group]
            f.forward_views = f.placeholders  # the last forward's views (set by each gather)
            f.unit_index = len(flats)
            for sites in f.sites:  # out until every unit is built (a later unit must not pack them)
                for mod, attr in sites:
                    del mod._parameters[attr]
            flats.append(f)
        u = Unit(prefix, module, flats)
        for f in flats:
            f.unit = u
        return u

    def _init_shard(self, f: FlatParam, group) -> torch.Tensor:
        """This rank's slice of a flat buffer of meta parameters, each element drawn from its
        parameter's global initial value (or left empty for a checkpoint to fill): the rank
        never holds more of the unit than its shard."""
        shard = torch.zeros(f.shard_size, dtype=group[0][1].dtype, device=self.home)
        for (name, p), (lo, hi), off in zip(group, f.own_ranges(), f.offsets):
            if hi > lo:
                a = f.start + lo - off  # the range inside the parameter's own flat elements
                shard[lo:hi] = init_flat_range(self.init_fn, name, p, a, a + hi - lo, self.home,
                                               init=self.init_fn is not None)
        return shard

    # -- gather / free --------------------------------------------------------------------------
    def _launch(self, u: Unit):
        if u.gathered or u.pending:
            return
        for f in u.flats:
            f.full.untyped_storage().resize_(f.padded * f.full.element_size())
            self.gathered_bytes += f.padded * f.full.element_size()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
            src = f.shard.detach().to(self.mesh.device, f.full.dtype, non_blocking=self.pin)
            # ``.data``: writing the gathered values must not bump the version counter that
            # autograd checks on the views it saved in forward.
            u.pending.append(f.comm.all_gather_async(src, out=f.full.data))
            self.background = u.pending[-1].work is not None

    def _gather(self, u: Unit, wait: bool, prefetch_next: int | None = None):
        self._launch(u)
        if prefetch_next is not None and self.prefetch and self.background and prefetch_next < len(self._order):
            self._launch(self._order[prefetch_next])
        if wait and u.pending:
            for w in u.pending:
                w.wait()
            u.pending, u.gathered = [], True
        if wait:
            for f in u.flats:  # fresh views each forward: part of this step's autograd graph
                f.forward_views = [_Piece.apply(f.full, f.token, f, i) for i in range(len(f.shapes))] \
                    if torch.is_grad_enabled() else f.views(f.full)
                _attach(f, f.forward_views)

    def _free(self, u: Unit):
        if u.pending:  # a prefetch nobody used (eval that stopped early): finish it first
            for w in u.pending:
                w.wait()
            u.pending = []
        for f in u.flats:
            self.gathered_bytes -= f.full.untyped_storage().nbytes()
            f.full.untyped_storage().resize_(0)
            _attach(f, None)
        u.gathered = False

    def _free_all(self):
        for u in self.units:
            self._free(u)

    # -- hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, i: int):
        # A forward run inside backward is activation recomputation: the unit is gathered for
        # its backward already; prefetching the next unit (already done with) would waste it.
        self._gather(self._order[i], wait=True, prefetch_next=None if self._in_backward else i + 1)

    def _post_forward(self, i: int, out):
        u = self._order[i]
        if self._in_backward:  # recomputation: keep the unit for the backward that follows
            return
        if not torch.is_grad_enabled():
            self._free(u)
            return
        if self.reshard:
            self._free(u)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g, i=i: self._pre_backward(i))
                break

    def _pre_backward(self, i: int):
        self._in_backward = True
        u = self._order[i]
        self._launch(u)
        if self.prefetch and self.background and i > 0:
            self._launch(self._order[i - 1])
        for w in u.pending:
            w.wait()
        u.pending, u.gathered = [], True
        for f in u.flats:  # a checkpointed block recomputes its forward without the hooks: the
            _attach(f, f.forward_views)  # forward's views, of the storage just gathered again

    @torch.no_grad()
    def _post_backward(self, f: FlatParam):
        # At most one unit's reduce-scatter stays in flight: the previous unit's is drained (its
        # whole-unit gradient freed) before this one is launched, so unsharded gradients never
        # pile up over the backward (they did: one whole model of them at the end of backward).
        u = f.unit
        self._drain(keep=u)
        grad, f.grad_flat, f.token.grad = f.grad_flat, None, None
        # default: an fp32 reduction. No reference to the input is kept: the collective holds what
        # it still reads (gloo copies it at the call, NCCL's work and the comm stream keep it), so
        # on gloo the unit's gradient is not held twice while its reduce-scatter runs
        f.reduce = f.comm.reduce_scatter_async(grad.to(self.reduce_dtype or f.shard.dtype))
        del grad
        self._reducing.append(f)
        if f.reduce.work is None:  # done already (the shared-memory transport runs it inline): free now
            self._drain()
        u.reduced += 1
        if u.reduced == len(u.flats):
            u.reduced = 0
            self._free(u)

    @torch.no_grad()
    def _drain(self, keep: Unit | None = None):
        """Wait for the reduce-scatters in flight (but those of ``keep``), add each rank's part
        into its gradient shard and drop the unsharded gradient they read."""
        rest = []
        for f in self._reducing:
            if f.unit is keep:
                rest.append(f)
                continue
            f.shard.grad.add_(f.reduce.wait().to(self.home))
            f.reduce = None
        self._reducing = rest

    @torch.no_grad()
    def _finish(self):
        """After one micro-batch's backward: add the reduce-scattered parts into the shards."""
        self._drain()
        self._free_all()
        self._in_backward = False

    # -- the step -------------------------------------------------------------------------------
    def start_step(self):
        self.ensure_grads()

    def after_backward(self, sync: bool):
        self._finish()

    @torch.no_grad()
    def sync_grads(self):
        """Sum the gradient shards over replicas (hybrid sharding), then average."""
        if self.replicate_group:
            rep = self.mesh.comm(self.replicate_group)
            for w in [rep.all_reduce_async(f.shard.grad) for f in self.flats if self._replicate_groups(f)]:
                w.wait()
        for f in self.flats:
            f.shard.grad.div_(self.dp_size())

    def parameters(self) -> list[nn.Parameter]:
        return [f.shard for f in self.flats]

    def named_parameters(self, all_params: bool = False):
        return [(f"flat{i}", f.shard) for i, f in enumerate(self.flats)]


class _Piece(torch.autograd.Function):
    """Parameter ``i`` of a gathered flat buffer ``f.full``: forward, a view of it; backward, its
    gradient added into the unit's flat gradient ``f.grad_flat`` (made at the first one) and an
    empty gradient for ``token``. Autograd's own split of the flat buffer would keep all the
    unit's gradients until the last one, then concatenate them: the unit's gradient twice. The
    token's gradient is complete when every piece's is (the graph decides, the same on every
    rank), and its hook starts the unit's reduce-scatter."""

    @staticmethod
    def forward(ctx, full, token, f, i):
        ctx.f, ctx.i = f, i
        return full.narrow(0, f.offsets[i], f.numels[i]).view(f.shapes[i])

    @staticmethod
    def backward(ctx, grad):
        f, i = ctx.f, ctx.i
        if f.grad_flat is None:
            f.grad_flat = torch.zeros(f.padded, dtype=grad.dtype, device=grad.device)
        f.grad_flat.narrow(0, f.offsets[i], f.numels[i]).view(f.shapes[i]).add_(grad)
        return None, grad.new_empty(0), None, None


def _placeholder(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """What a module holds for ``p`` outside its unit's forward, as DeepSpeed's ZeRO-3 does: ``p``
    itself (a meta one: a new one with its attributes) with empty data on the compute device, so
    ``model.parameters()``, transformers' ``model.device`` and ``generate`` work."""
    empty = torch.empty(0, dtype=p.dtype, device=device)
    if not p.is_meta:
        p.data = empty  # the values live in the flat shards now
        return p
    ph = nn.Parameter(empty, requires_grad=p.requires_grad)
    ph.__dict__.update(p.__dict__)  # placements (TP / EP slices) and the like
    return ph


def _attach(f, views: list[torch.Tensor] | None) -> None:
    """Put ``views`` (plain tensors, part of the step's graph) at every site of ``f``'s
    parameters; None: the registered placeholders back."""
    for i, sites in enumerate(f.sites):
        for mod, attr in sites:
            if views is None:
                mod.__dict__.pop(attr, None)
                mod._parameters[attr] = f.placeholders[i]
            else:
                mod._parameters.pop(attr, None)
                setattr(mod, attr, views[i])


def _refuse_placeholders(mod: nn.Module, state_dict: dict, prefix: str, _meta) -> None:
    """A ``state_dict`` of a ZeRO-3 module holding placeholders would save tensors of size 0
    (transformers' ``save_pretrained`` wrote such a model without a word): refused in one line."""
    for attr, p in mod._parameters.items():
        if p is not None and p.numel() == 0 and getattr(p, "_shardlab_flat", None) is not None \
                and prefix + attr in state_dict:
            raise RuntimeError(
                f"{prefix + attr}: under ZeRO-3 the module holds an empty placeholder, its values are in the "
                "ranks' shards; on every rank use `with shardlab.zero.GatheredParameters(engine.module.parameters()):` "
                "(DeepSpeed's) around state_dict / save_pretrained, or pass `state_dict=engine.full_state_dict()` "
                "(docs/api.md, ZeRO-3 on your model)")


def _sites(model: nn.Module, p: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute) that holds ``p`` (two for tied embeddings)."""
    return [(m, a) for m in model.modules() for a, q in m._parameters.items() if q is p]


def apply(model: nn.Module, mesh, cfg, unit_names: list[str] | None = None, init_fn=None) -> FSDPEngine:
    """``init_fn``: the model's box initialiser (parallel/materialize.py), used when ``model`` is
    on the meta device; None there leaves the shards uninitialised (a checkpoint fills them)."""
    return FSDPEngine(model, mesh, cfg, unit_names, init_fn)


__all__ = ["FSDPEngine", "apply", "mixed_precision_dtypes", "Engine"]
