"""ZeRO-1 and ZeRO-2 on flat buffers (Rajbhandari et al., 2020), and what ZeRO-3 shares with them:
rank r owns slice r of every flat buffer and the optimizer steps on it; expert weights sharded over
``edp``; low-precision storage with fp32 masters (docs/data-parallel.md)."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import register_check
from ..distributed.placement import get_placement, replicas
from ..distributed.regions import Piece, writes_piece
from ..checkpoint import pieces as state
from .engine import Engine
from .ddp import make_buckets

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Reduce-scatters of gradient buckets in flight at most (ZeRO-1 here, ZeRO inside pipeline stages):
# gloo copies a bucket at the call and holds the copy until the work is collected, so this many
# copies stand beside the gradients (the planner prices them: analysis/predict.stage_memory).
RS_IN_FLIGHT = 2


@register_check
def check_config(cfg) -> None:
    """Data-parallel sharding and precision options (called by ``validate``)."""
    from ..errors import require
    p, t = cfg.parallel, cfg.train
    require(not p.offload or p.zero_stage == 3, "parallel.offload",
            "CPU offload is implemented with zero_stage = 3; set --parallel.zero_stage=3 or --parallel.offload=false")
    kind, _, arg = p.wrap_policy.partition(":")
    require((kind == "blocks" and not arg) or (kind == "size" and arg.isdigit()) or (kind == "class" and arg),
            "parallel.wrap_policy", f"{p.wrap_policy!r}: use blocks, size:<min params> (e.g. size:100000) "
                                    "or class:<Name>[,<Name>] (e.g. class:Block)")
    require(not t.param_dtype or p.zero_stage >= 1, "train.param_dtype",
            "low-precision parameter storage is implemented by ZeRO/FSDP; set --parallel.zero_stage=1, 2 or 3 "
            "or leave train.param_dtype empty")
    require(not t.reduce_dtype or p.zero_stage in (0, 3) or p.pp > 1, "train.reduce_dtype",
            "the reduce dtype is a DDP/FSDP option (ZeRO-1/2 reduce in train.param_dtype); use zero_stage 0 or 3")


def shard_size(total: int, n: int) -> int:
    """Elements each of ``n`` ranks owns of a flat buffer of ``total``, padded to ``n`` x that."""
    return max(1, math.ceil(total / n))


def flat_groups(named: list[tuple[str, nn.Parameter]], dense_group: str, weight_decay: float, cap_bytes=None):
    """(shard group, pairs, weight decay) of each flat buffer the engines and the planner pack: per
    shard group (expert weights over ``edp``, the ranks holding the same experts; the rest over
    ``dense_group``), weight-decay group and, with ``cap_bytes``, bucket (ZeRO-1/2)."""
    expert = [("ep" in get_placement(p, n).sharded_over) for n, p in named]
    for g, is_e in ((dense_group, False), ("edp", True)):
        for group, wd in decay_groups([x for x, e in zip(named, expert) if e == is_e], weight_decay):
            names, params = {id(p): n for n, p in group}, [p for _, p in group]
            for bucket in [params] if cap_bytes is None else make_buckets(params, cap_bytes):
                yield g, [(names[id(p)], p) for p in bucket], wd


class FlatParam:
    """Parameters ``names`` packed end to end, padded to ``n * shard_size``; rank ``r`` owns
    elements ``[r * shard_size, (r + 1) * shard_size)``. ``shard`` is the optimizer's parameter."""

    def __init__(self, names: list[str], params: list[torch.Tensor], n: int, rank: int, weight_decay: float):
        self.names, self.shapes = list(names), [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.total = sum(self.numels)
        self.n, self.rank, self.weight_decay = n, rank, weight_decay
        self.shard_size = shard_size(self.total, n)
        self.padded = self.shard_size * n
        self.start = rank * self.shard_size
        self.placements = [get_placement(p, n) for n, p in zip(names, params)]  # TP/EP slices: global names
        self.shard: nn.Parameter | None = None
        self.group, self.comm = None, None  # the shard group's name and communicator (set by the engine)

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        flat = torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.padded - self.total))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter. ``split`` (not slicing) so that autograd's backward of the
        views is a single concatenation instead of one full-size zero tensor per parameter."""
        parts = flat.split(self.numels + [self.padded - self.total])
        return [t.view(s) for t, s in zip(parts, self.shapes)]

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.start + self.shard_size]

    def own_ranges(self) -> list[tuple[int, int]]:
        """Per parameter, the range of its elements inside this rank's shard (shard coordinates;
        empty when lo >= hi)."""
        end = self.start + self.shard_size
        return [(max(o, self.start) - self.start, min(o + k, end) - self.start)
                for o, k in zip(self.offsets, self.numels)]


def decay_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float, tag: str = "_shardlab_user_group"):
    """Split (name, param) pairs like Engine.param_groups: no decay for norms and vectors; one part
    per user param group instead where ``shardlab.initialize`` tagged the parameters with ``tag``."""
    if keys := sorted({getattr(p, tag) for _, p in named if hasattr(p, tag)}):  # (group index, its decay)
        return [([(n, p) for n, p in named if getattr(p, tag, None) == k], k[1]) for k in keys]
    decay = [(n, p) for n, p in named if not (p.ndim < 2 or "norm" in n)]
    no_decay = [(n, p) for n, p in named if p.ndim < 2 or "norm" in n]
    return [(g, wd) for g, wd in ((decay, weight_decay), (no_decay, 0.0)) if g]


class ShardedEngine(Engine):
    """What ZeRO-1/2/3 share: flat parameters sharded over ``shard_group`` (and replicated over
    ``replicate_group``), the optimizer on the shards, the norm and checkpoints from the shards."""

    shard_group, replicate_group = "dp_cp", None
    flats: list[FlatParam]

    def grad_shard(self, f: FlatParam) -> torch.Tensor | None:
        """The gradient shard of ``f`` this engine owns (``f.shard.grad`` unless stored apart)."""
        return f.shard.grad

    def grads(self) -> list[torch.Tensor]:
        return [g for g in map(self.grad_shard, self.flats) if g is not None]

    def dp_size(self) -> int:
        n = self.mesh.size(self.shard_group)
        return n * (self.mesh.size(self.replicate_group) if self.replicate_group else 1)

    def make_optimizer(self, build):
        """``build(groups)`` on this rank's shards. The result is the plain torch optimizer (LR
        schedulers and grad scalers accept it); a post-step hook lets the engine finish the
        step (all-gather the new slices for ZeRO-1/2) and zero the gradient shards."""
        groups = [{"params": [f.shard for f in self.flats if f.weight_decay == wd], "weight_decay": wd}
                  for wd in sorted({f.weight_decay for f in self.flats}, reverse=True)]
        opt = build(groups)
        opt.register_step_post_hook(lambda *_: self.after_step())
        return opt

    def after_step(self):
        self.zero_grad()

    def zero_grad(self):
        for f in self.flats:
            if f.shard.grad is not None:
                f.shard.grad.zero_()

    def ensure_grads(self):
        """Gradient shards exist and are zero-initialised (``optimizer.zero_grad()`` may have set
        them to None)."""
        for f in self.flats:
            if f.shard.grad is None:
                f.shard.grad = torch.zeros_like(f.shard)

    def grad_norm(self) -> torch.Tensor:
        """Each global element counted once: the squares of every parameter's part inside this
        rank's gradient shard, divided by how many ranks hold that same part (the parameter's
        replicas, placement.py, split S ways by the shard group), summed over the world."""
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for f in self.flats:
            if self.grad_shard(f) is None:
                continue
            s_size = self.mesh.size(f.group or self.shard_group)
            g = self.grad_shard(f).detach()
            for (lo, hi), pl in zip(f.own_ranges(), f.placements):
                if hi > lo:
                    part = torch.linalg.vector_norm(g[lo:hi]).double().square().to(sq.device)
                    sq += part * s_size / replicas(pl, self.mesh)
        if self.mesh.world_size > 1:
            self.mesh.comm("world").all_reduce(sq)
        return sq.sqrt()


    # -- state in global coordinates (checkpoint/pieces.py) ----------------------------------------
    def _replicate_groups(self, f: FlatParam | None = None) -> tuple[str, ...]:
        """Groups over which flat buffer ``f`` is replicated (expert buffers: none, ``edp`` shards them)."""
        return (self.replicate_group,) if self.replicate_group and (f is None or f.group != "edp") else ()

    def state_pieces(self, optimizer) -> list:
        """Boxes of the parameters and Adam states inside this rank's slice of every flat
        buffer; scalar states (Adam's ``step``) once per parameter it overlaps. No communication."""
        out = []
        for f in self.flats:
            lo, hi = f.start, f.start + f.shard_size
            st = optimizer.state.get(f.shard, {}) if optimizer is not None else {}
            values = {"model": f.shard}
            values.update({f"optim.{k}": v for k, v in sorted(st.items())
                           if torch.is_tensor(v) and v.dim() == 1 and v.numel() == f.shard_size})
            out += state.flat_pieces(f, values, self.mesh, self._replicate_groups(f), lo, hi)
            scalars = {k: v for k, v in st.items() if torch.is_tensor(v) and v.dim() == 0}
            for pl, (a, b) in zip(f.placements, f.own_ranges()):
                if a < b and writes_piece(pl, self.mesh, self._replicate_groups(f)):
                    out += [Piece(f"optim.{pl.name}.{k}", (), (), v.detach()) for k, v in scalars.items()]
        return out + state.param_pieces(self.frozen(), None, self.mesh, self.replicate_groups)

    def frozen(self) -> list:
        """(global name, parameter) of the parameters that take no gradient (a LoRA base): kept
        whole on every rank outside the flat buffers, saved and loaded like replicated tensors."""
        return [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]

    def _param_targets(self, f: FlatParam) -> list[tuple[torch.Tensor, int, int]]:
        """Where loaded parameter values go: (buffer, lo, hi) of each flat range it holds."""
        return [(f.shard.data, f.start, f.start + f.shard_size)]

    @torch.no_grad()
    def load_pieces(self, reader, optimizer) -> None:
        """Read this rank's ranges of every flat buffer (parameters and Adam states) from
        ``reader``, saved under any layout. No communication."""
        state.load_param_pieces(self.frozen(), reader, None)
        for f in self.flats:
            for target, lo, hi in self._param_targets(f):
                state.load_flat_range(f, reader, "model", target, lo, hi)
            keys = state.optim_keys(reader, f.placements[0].name)
            if optimizer is None or not keys:
                continue
            st, old = {}, optimizer.state.get(f.shard, {})
            for key in keys:
                shape = tuple(reader.global_shape(f"optim.{f.placements[0].name}.{key}"))
                if shape == tuple(f.placements[0].global_shape) and shape:
                    buf = old.get(key)  # fill the optimizer's own buffer in place when it has one
                    if not (torch.is_tensor(buf) and buf.shape == f.shard.shape and buf.dtype == f.shard.dtype):
                        buf = torch.zeros(f.shard_size, dtype=f.shard.dtype, device=f.shard.device)
                    state.load_flat_range(f, reader, key, buf, f.start, f.start + f.shard_size)
                    st[key] = buf
                else:  # Adam's step
                    st[key] = reader.read(f"optim.{f.placements[0].name}.{key}").clone()
            optimizer.state[f.shard] = st


class ZeroEngine(ShardedEngine):
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``) over the ``dp_cp`` group."""

    def __init__(self, model: nn.Module, mesh, cfg, stage: int):
        super().__init__(model, mesh, cfg)
        self.stage, self.name = stage, f"zero{stage}"
        self.comm = mesh.comm(self.shard_group)  # the dense buffers' group (expert buffers: f.comm)
        cap = cfg.parallel.bucket_cap_mb * 2**20
        low = DTYPES.get(cfg.train.param_dtype)  # low-precision storage with fp32 master shards
        self.flats, self._where = [], {}
        for group, named, wd in flat_groups(Engine.named_parameters(self), self.shard_group, cfg.train.weight_decay, cap):
            comm, bucket = mesh.comm(group), [p for _, p in named]
            f = FlatParam([n for n, _ in named], bucket, comm.size, comm.rank, wd)
            f.group, f.comm = group, comm
            f.params, full = bucket, f.flatten(bucket)
            comm.broadcast(full, 0)  # every replica starts from rank 0's weights
            f.full = full if low is None or low == full.dtype else full.to(low)
            for i, (p, v) in enumerate(zip(bucket, f.views(f.full))):
                p.data = v
                p.grad = None
                self._where[id(p)] = (len(self.flats), i)
                p.register_post_accumulate_grad_hook(self._on_grad)
            # the optimizer's parameter aliases the flat buffer (no extra copy), or is the
            # rank's fp32 master slice when the buffer is low precision
            f.shard = nn.Parameter(f.own(f.full) if f.full is full else f.own(full).clone())
            f.grad_full = torch.zeros_like(f.full) if stage == 1 else None
            f.gshard = f.own(f.grad_full) if stage == 1 else torch.zeros_like(f.own(f.full))
            f.ready, f.pending = 0, None
            self.flats.append(f)
        self._sync, self._next = True, 0
        self.in_flight = self.peak_in_flight = 0  # reduce-scatters in flight now / at most (tests)
        self.ensure_grads()

    def grad_shard(self, f: FlatParam) -> torch.Tensor:
        return f.gshard

    def _separate(self, f: FlatParam) -> bool:
        return f.gshard.dtype != f.shard.dtype

    # -- backward ---------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p):
        fi, i = self._where[id(p)]
        f = self.flats[fi]
        if self.stage == 1:  # the gradient lives in the persistent full buffer (bucket view)
            view = f.views(f.grad_full)[i]
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        else:  # ZeRO-2: a staging buffer lives only until the bucket is reduce-scattered
            if f.ready == 0:
                f.grad_full = torch.zeros(f.padded, dtype=f.full.dtype, device=f.full.device)
            f.views(f.grad_full)[i].copy_(p.grad)
            p.grad = None
        if not self._sync:
            return
        f.ready += 1
        if self.cfg.parallel.overlap_comm:
            self._launch(force=False)

    def _launch(self, force: bool):
        while self._next < len(self.flats):  # in bucket order: the same sequence on every rank
            f = self.flats[self._next]
            if not force and f.ready < len(f.names):
                break
            if f.grad_full is None:  # ZeRO-2 bucket that received no gradient
                f.grad_full = torch.zeros(f.padded, dtype=f.full.dtype, device=f.full.device)
            # ZeRO-2: one staging bucket in flight (collect the previous one first). ZeRO-1: two
            # (gloo copies each bucket it reduce-scatters at the call and holds the copy until the
            # work is collected: with every bucket in flight that was the whole gradient again)
            self._collect(self._next - (1 if self.stage == 2 else RS_IN_FLIGHT))
            f.pending = f.comm.reduce_scatter_async(f.grad_full)
            if self.stage == 2:  # the collective holds what it still reads (gloo: its own copy)
                f.grad_full = None
            self._next += 1
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _collect(self, i: int):
        """Wait for bucket ``i``'s reduce-scatter (if pending) and take this rank's part. ZeRO-2's
        staging buffer was dropped at the launch, so only the bucket being filled and the one in
        flight live at a time (they all lived until the end of backward: the whole model's gradient)."""
        f = self.flats[i] if i >= 0 else None
        if f is None or f.pending is None:
            return
        part = f.pending.wait()
        if self.stage == 1:
            f.own(f.grad_full).copy_(part)
        else:
            f.gshard.add_(part)
        f.pending, f.ready = None, 0
        self.in_flight -= 1

    @torch.no_grad()
    def _finish(self):
        self._launch(force=True)
        for i in range(len(self.flats)):
            self._collect(i)
        self._next = 0

    def start_step(self):
        self.ensure_grads()

    def forward(self, *args, sync: bool = True, **kwargs):
        self._sync = self.stage == 2 or sync  # ZeRO-1 accumulates in the full buffer until the last
        return self.model(*args, **kwargs)

    def after_backward(self, sync: bool):
        if self._sync:
            self._finish()

    def sync_grads(self):
        """Turn the summed gradient shards into the average over the data-parallel ranks (expert
        shards too: their sum already covers the ep ranks)."""
        for f in self.flats:
            f.gshard.div_(self.mesh.size("dp_cp"))

    # -- optimizer step ---------------------------------------------------------------------
    def make_optimizer(self, build):
        opt = super().make_optimizer(build)
        opt.register_step_pre_hook(lambda *_: self.before_step())
        return opt

    def before_step(self):
        """Low-precision gradient shards: the optimizer gets an fp32 copy for this step only."""
        for f in self.flats:
            f.shard.grad = f.gshard.to(f.shard.dtype) if self._separate(f) else f.gshard

    def after_step(self):
        """All-gather the updated slices (cast to the buffers' dtype) into every rank's flat
        buffers; zero the gradients."""
        with torch.no_grad():
            pending = [f.comm.all_gather_async(f.shard.detach().to(f.full.dtype, copy=True), out=f.full)
                       for f in self.flats]
            for w in pending:
                w.wait()
        self.zero_grad()
        for f in self.flats:
            if self._separate(f):
                f.shard.grad = None  # the step's fp32 copy

    def zero_grad(self):
        for f in self.flats:
            (f.grad_full if self.stage == 1 else f.gshard).zero_()

    def ensure_grads(self):
        """Every step starts from zero gradients, whatever ``optimizer.zero_grad`` did (it only
        sees the optimizer's view) or a skipped step left behind; the optimizer's ``.grad`` is the
        engine's shard when the dtypes agree."""
        for f in self.flats:
            (f.grad_full if self.stage == 1 else f.gshard).zero_()
            f.shard.grad = None if self._separate(f) else f.gshard

    def _param_targets(self, f: FlatParam) -> list[tuple[torch.Tensor, int, int]]:
        out = [(f.full, 0, f.padded)]  # every rank keeps the whole (replicated) parameters
        if f.shard.dtype != f.full.dtype:  # a separate master (train.param_dtype), else an alias of f.full
            out.append((f.shard.data, f.start, f.start + f.shard_size))  # the fp32 master, read at full precision
        return out


def apply(model: nn.Module, mesh, cfg) -> ZeroEngine:
    return ZeroEngine(model, mesh, cfg, cfg.parallel.zero_stage)
