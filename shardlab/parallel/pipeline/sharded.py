"""ZeRO-1/2/3 inside pipeline stages: each pipeline rank packs its own stages' parameters into flat
buffers (one per weight-decay group and ``parallel.bucket_cap_mb`` bucket, as ZeRO-1/2's engine
does) sharded over its data-parallel group (:func:`shard_group`); ZeRO-3 gathers them once per
step, the gradients are reduce-scattered once, after the last micro-batch, two buckets in flight.
The step, and why the parameters stay gathered for it: docs/pipeline.md, "Sharding inside
stages".

Mixed precision (``train.param_dtype`` / ``train.reduce_dtype``, FSDP2's MixedPrecisionPolicy as
torch.distributed.pipelining drives it): the gathered stage, hence its compute and the activations
between stages, in param_dtype; fp32 master slices for the optimizer; the gradients of all
micro-batches accumulated in one flat buffer of the reduce dtype (default: the masters' fp32),
each micro-batch's gradient made in param_dtype and added into it as autograd finishes it (FSDP2
with gradient sync off: ``FSDPParam.to_accumulated_grad_if_needed`` /
``accumulate_unsharded_grad_if_needed``), reduce-scattered in that dtype after the last one."""
from __future__ import annotations

import torch
from torch import nn

from ...config import register_check
from ...distributed.placement import get_placement, set_placement
from ..fsdp import mixed_precision_dtypes
from ..materialize import init_flat_range
from ..zero import RS_IN_FLIGHT, FlatParam, ShardedEngine, flat_groups
from .executor import PipelineEngine, _param_dtype


@register_check
def check_config(cfg) -> None:
    """What stage-local sharding does not implement (called by ``validate`` with pp > 1)."""
    from ...errors import require
    p = cfg.parallel
    if p.pp == 1 or p.zero_stage == 0:
        return
    require(p.ep == 1, "parallel.ep",
            "ZeRO/FSDP inside pipeline stages does not shard expert-parallel weights yet; use "
            "--parallel.zero_stage=0 with pp > 1 and ep > 1, or --parallel.ep=1")
    require(not p.offload, "parallel.offload",
            "CPU offload is not implemented inside pipeline stages; set --parallel.offload=false")


def shard_group(zero_stage: int) -> str:
    """The group a pipeline rank's flat buffers shard over (the engine's and the planner's rule)."""
    return "dp_shard_cp" if zero_stage == 3 else "dp_cp"


class ShardedPipelineEngine(PipelineEngine, ShardedEngine):
    """A :class:`PipelineEngine` whose stage parameters, gradients and optimizer states are
    sharded over the data-parallel group (``parallel.zero_stage`` 1, 2 or 3)."""

    def __init__(self, model: nn.Module, mesh, cfg, chunks: dict, ranges: list[range], spec=None,
                 init_fn=None):
        super().__init__(model, mesh, cfg, chunks, ranges, spec)
        self.stage = cfg.parallel.zero_stage
        self.name = f"pipeline-zero{self.stage}"
        self.shard_group = shard_group(self.stage)
        self.replicate_group = "dp_replicate" if self.stage == 3 and mesh.size("dp_replicate") > 1 else None
        self.comm = mesh.comm(self.shard_group)
        self.gathered = True
        # gathered (compute) dtype and the gradients' accumulation / reduce-scatter dtype; None: the
        # masters' (an empty param_dtype gathers the masters' dtype, also under autocast)
        self.compute_dtype, self.reduce_dtype = mixed_precision_dtypes(cfg.train, autocast_default=False)
        self.peak_buffer_bytes = 0  # the last step's gathered stage + flat gradients (docs, tests)
        self.in_flight = self.peak_in_flight = 0  # reduce-scatters in flight now / at most (tests)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        cap = cfg.parallel.bucket_cap_mb * 2**20  # buckets bound what gloo copies at each reduce-scatter
        self.flats = [self._make_flat(g, wd, init_fn)
                      for _, g, wd in flat_groups(named, self.shard_group, cfg.train.weight_decay, cap)]
        self.link.dtype = _param_dtype(model)  # what crosses the stage boundaries: the compute dtype
        if self.stage == 3:
            self._free()
        self.ensure_grads()

    # -- building -------------------------------------------------------------------------------
    @torch.no_grad()
    def _make_flat(self, group, wd: float, init_fn) -> FlatParam:
        """Pack ``group`` (name, parameter) into a flat buffer; the modules' parameters become
        views of it. A meta group draws only this rank's slice (``init_fn``; None leaves it for a
        checkpoint); a materialised one starts everywhere from dp rank 0's values."""
        f = FlatParam([n for n, _ in group], [p for _, p in group], self.comm.size, self.comm.rank, wd)
        dtype, device = group[0][1].dtype, self.mesh.device
        f.full = torch.zeros(f.padded, dtype=self.compute_dtype or dtype, device=device)
        if any(p.is_meta for _, p in group):
            shard = torch.zeros(f.shard_size, dtype=dtype, device=device)
            for (name, p), (lo, hi), off in zip(group, f.own_ranges(), f.offsets):
                if hi > lo:
                    a = f.start + lo - off
                    shard[lo:hi] = init_flat_range(init_fn, name, p, a, a + hi - lo, device, init=init_fn is not None)
            self.comm.all_gather_async(shard.to(f.full.dtype), out=f.full).wait()
            master = shard
        else:
            full = self.mesh.comm("dp_cp").broadcast(f.flatten([p for _, p in group]), 0)
            f.full.copy_(full)
            master = f.own(full)
        # The optimizer's slice: ZeRO-1/2 in the masters' dtype alias the full buffer they keep;
        # ZeRO-3 (which frees it between steps) and a low-precision buffer keep a separate master.
        separate = self.stage == 3 or f.full.dtype != dtype
        f.shard = nn.Parameter(master.clone() if separate else f.own(f.full))
        # Gradients accumulate over the micro-batches in the reduce dtype (default: the masters');
        # where it is not the compute dtype, each micro-batch's gradient is folded into the flat
        # buffer when autograd has made it (_fold), as FSDP2 does with gradient sync off.
        f.acc_dtype = self.reduce_dtype or dtype
        f.fold = f.acc_dtype != f.full.dtype
        f.params = []
        for i, ((name, old), view) in enumerate(zip(group, f.views(f.full))):
            new = nn.Parameter(view)
            if f.fold:
                new.register_post_accumulate_grad_hook(lambda p, f=f, i=i: self._fold(f, i, p))
            set_placement(new, get_placement(old, name))
            for mod in self.model.modules():
                for attr, q in list(mod._parameters.items()):
                    if q is old:
                        mod._parameters[attr] = new
            f.params.append(new)
        f.grad_full = f.grad_views = None
        return f

    @torch.no_grad()
    def _fold(self, f: FlatParam, i: int, p: nn.Parameter):
        """A parameter's gradient of one micro-batch (compute dtype, all its uses summed by autograd)
        added into its view of the flat gradient (reduce dtype), then dropped."""
        f.grad_views[i].add_(p.grad)
        p.grad = None

    # -- gather / free ----------------------------------------------------------------------------
    @torch.no_grad()
    def _gather(self):
        """ZeRO-3: give the flat buffers storage again and all-gather the slices into them (the
        parameters are views of the buffers, so they see the values)."""
        if self.gathered:
            return
        works = []
        for f in self.flats:
            f.full.untyped_storage().resize_(f.padded * f.full.element_size())
            works.append(self.comm.all_gather_async(f.shard.detach().to(f.full.dtype, copy=True), out=f.full))
        for w in works:
            w.wait()
        self.gathered = True

    def _free(self):
        for f in self.flats:
            f.full.untyped_storage().resize_(0)
        self.gathered = False

    # -- the step ---------------------------------------------------------------------------------
    def forward_backward(self, micro_batches, loss_scale: float = 1.0, autocast=None,
                         mark=None) -> torch.Tensor:
        self.ensure_grads()
        self._gather()
        for f in self.flats:  # gradients of all micro-batches accumulate into one flat buffer
            f.grad_full = torch.zeros(f.padded, dtype=f.acc_dtype, device=f.full.device)
            f.grad_views = f.views(f.grad_full)
            for p, g in zip(f.params, f.grad_views):
                p.grad = None if f.fold else g  # folded: autograd makes a fresh one per micro-batch
        return super().forward_backward(micro_batches, loss_scale, autocast, mark)  # ends in sync_grads

    @torch.no_grad()
    def sync_grads(self):
        """After the last micro-batch: one reduce-scatter per flat buffer in its dtype (sum over the
        shard group), sum over replicas (hybrid), cast to the masters' dtype, average, add into the
        gradient shards; free. Two buckets in flight: gloo copies what it reduce-scatters at the
        call and keeps the copy until the work is collected (one flat for the whole stage held its
        gradient twice at the call: docs/data-parallel.md, Where the memory goes, item 11)."""
        works = {}  # flat index -> its reduce-scatter in flight
        self.peak_buffer_bytes = self.buffer_bytes()
        for k, f in enumerate(self.flats):
            for p, g in zip(f.params, f.grad_views):
                if p.grad is not None and p.grad.data_ptr() != g.data_ptr():  # autograd replaced it
                    if f.fold:
                        g.add_(p.grad)
                    else:
                        g.copy_(p.grad)
                p.grad = None
            if k >= RS_IN_FLIGHT:
                self._collect(k - RS_IN_FLIGHT, works.pop(k - RS_IN_FLIGHT))
            works[k] = self.comm.reduce_scatter_async(f.grad_full)
            f.grad_full = f.grad_views = None  # the collective holds what it reads (gloo: a copy)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        for k in sorted(works):
            self._collect(k, works.pop(k))
        if self.stage == 3:
            self._free()

    def _collect(self, k: int, work) -> None:
        """Flat ``k``'s reduce-scattered part: summed over replicas (hybrid), cast, averaged, added
        into its gradient shard; the work (and gloo's copy with it) dropped."""
        part = work.wait()
        if self.replicate_group:
            self.mesh.comm(self.replicate_group).all_reduce_async(part).wait()
        self.flats[k].shard.grad.add_(part.to(self.flats[k].shard.dtype).div_(self.dp_size()))
        self.in_flight -= 1

    def buffer_bytes(self) -> int:
        """Bytes the rank's flat buffers hold now: the gathered stage and the flat gradients."""
        return sum(t.untyped_storage().nbytes() for f in self.flats for t in (f.full, f.grad_full) if t is not None)

    @torch.no_grad()
    def evaluate(self, micro_batches, autocast=None) -> torch.Tensor:
        was = self.gathered
        self._gather()
        try:
            return super().evaluate(micro_batches, autocast)
        finally:
            if not was:
                self._free()

    # -- optimizer ----------------------------------------------------------------------------------
    def after_step(self):
        """ZeRO-1/2: all-gather the updated slices into the full parameters now; ZeRO-3 does it at
        the next step's begin. Zero the gradient shards."""
        if self.stage != 3:
            with torch.no_grad():
                works = [self.comm.all_gather_async(f.shard.detach().to(f.full.dtype, copy=True), out=f.full)
                         for f in self.flats]
                for w in works:
                    w.wait()
        self.zero_grad()

    def parameters(self) -> list[nn.Parameter]:
        return [f.shard for f in self.flats]

    def named_parameters(self, all_params: bool = False):
        return [(f"flat{i}", f.shard) for i, f in enumerate(self.flats)]

    def _param_targets(self, f: FlatParam) -> list[tuple[torch.Tensor, int, int]]:
        if self.stage == 3:  # the next step's gather spreads the loaded slice
            return [(f.shard.data, f.start, f.start + f.shard_size)]
        out = [(f.full, 0, f.padded)]  # the slice aliases the full buffer, unless that is low precision:
        if f.shard.dtype != f.full.dtype:  # then the fp32 master, read at full precision
            out.append((f.shard.data, f.start, f.start + f.shard_size))
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """{global name: this rank's part of the averaged gradient, flattened} with the flat
        coordinates it covers: ``{name: (lo, hi, values)}`` in the parameter's own flat elements
        (tests compare them with a reference)."""
        out = {}
        for f in self.flats:
            for pl, (lo, hi), off in zip(f.placements, f.own_ranges(), f.offsets):
                if hi > lo:
                    a = f.start + lo - off
                    out[pl.name] = (a, a + hi - lo, f.shard.grad[lo:hi].detach().clone())
        return out
