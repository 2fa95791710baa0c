"""Tensor parallel (Megatron-LM) and sequence parallel over the ``tp`` group: column/row-parallel
pairs, the vocabulary-parallel embedding and cross-entropy; ``apply(model, mesh, cfg, plan)``
follows the architecture's ``ModelSpec.tp_plan`` (docs/tensor-parallel.md)."""
from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

from ..config import register_check
from ..errors import ConfigError
from ..distributed import autograd as dc
from ..distributed.placement import Placement, set_placement
from ..models.moe import MoE
from .sequence import SequenceParallelNorm, SequenceParallelPositionEmbedding, _param

SEQ_DIM = 1  # activations are (batch, sequence, hidden)


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------

def enter_region(x: torch.Tensor, comm, sequence_parallel: bool) -> torch.Tensor:
    """Make a replicated (or, with SP, sequence-sharded) activation the full input of a
    tensor-parallel region: f = copy_to_region, or the sequence all-gather."""
    return dc.all_gather(x, comm, SEQ_DIM) if sequence_parallel else dc.copy_to_region(x, comm)


def leave_region(x: torch.Tensor, comm, sequence_parallel: bool) -> torch.Tensor:
    """Sum the partial outputs of the ranks: g = reduce_from_region, or the sequence
    reduce-scatter (each rank keeps S/tp tokens of the sum)."""
    return dc.reduce_scatter(x, comm, SEQ_DIM) if sequence_parallel else dc.reduce_from_region(x, comm)


class _SumOverCopies(torch.autograd.Function):
    """Forward identity; backward: sum the weight gradient over the tp ranks that hold the same
    slice (key/value heads replicated when tp > n_kv_heads). Every rank places its gradient in
    slot ``slot`` of a buffer of ``n_slots`` slices, one all-reduce over tp adds them, and each
    rank keeps its slot: the sum over exactly the ranks that share the slice."""

    @staticmethod
    def forward(ctx, w, comm, slot, n_slots):
        ctx.comm, ctx.slot, ctx.n_slots = comm, slot, n_slots
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        buf = g.new_zeros((ctx.n_slots,) + tuple(g.shape))
        buf[ctx.slot] = g
        ctx.comm.all_reduce(buf)
        return buf[ctx.slot], None, None, None


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output features (rows of ``weight``) and b with them:
    rank r computes Y_r = X A_r^T + b_r, a slice of Y's last dim.

    ``input_op``: None when the caller already applied f / the all-gather once for several
    column layers (see ``gather_input``), else "copy" (f) or "gather" (SP all-gather).
    ``copies``: (comm, slot, n_slots) when several tp ranks hold the same rows."""

    def __init__(self, weight: torch.Tensor, comm, input_op: str | None = None, copies=None, bias=None):
        super().__init__()
        self.weight = _param(weight)
        self.bias = None if bias is None else _param(bias)
        self.comm, self.input_op, self.copies = comm, input_op, copies
        self.lora_A = self.lora_B = None  # LoRA adapters (models/lora.py), set by attach_lora

    def forward(self, x):
        if self.input_op is not None:
            x = enter_region(x, self.comm, self.input_op == "gather")
        w, b = self.weight, self.bias
        if self.copies is not None:
            w = _SumOverCopies.apply(w, *self.copies)
            b = None if b is None else _SumOverCopies.apply(b, *self.copies)
        y = F.linear(x, w, b)
        if self.lora_B is not None:  # LoRA: A replicated (its gradient summed over tp by f), B split like w
            lb = self.lora_B if self.copies is None else _SumOverCopies.apply(self.lora_B, *self.copies)
            y = y + F.linear(F.linear(x, dc.copy_to_region(self.lora_A, self.comm)), lb) * self.lora_scale
        return y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input features (columns of ``weight``): rank r holds the
    matching slice X_r of the input (the output of a column-parallel layer) and computes the
    partial sum X_r A_r^T; g (all-reduce) or, with SP, a reduce-scatter along the sequence
    adds the partial sums. The bias is replicated and added once, after the reduction; with SP
    each rank adds it to its S/tp tokens only, so its gradient is a partial sum over the
    sequence: f on the bias sums it over tp in backward (as for the norm weights)."""

    def __init__(self, weight: torch.Tensor, comm, sequence_parallel: bool = False, bias=None):
        super().__init__()
        self.weight = _param(weight)
        self.bias = None if bias is None else _param(bias)
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.lora_A = self.lora_B = None  # LoRA adapters (models/lora.py), set by attach_lora

    def forward(self, x):
        z = F.linear(x, self.weight)
        if self.lora_A is not None:  # LoRA: A split like w; the rank's partial x_r A_r^T B^T joins the sum
            z = z + F.linear(F.linear(x, self.lora_A), dc.copy_to_region(self.lora_B, self.comm)) * self.lora_scale
        out = leave_region(z, self.comm, self.sequence_parallel)
        if self.bias is None:
            return out
        return out + (dc.copy_to_region(self.bias, self.comm) if self.sequence_parallel else self.bias)


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [start, start + rows) of the (padded) table; a token outside its range
    looks up zeros, and the sum over ranks (g, or the SP reduce-scatter) is the embedding.
    Only the first ``valid`` local rows are real; the padding rows are never selected."""

    def __init__(self, weight: torch.Tensor, start: int, valid: int, comm, sequence_parallel: bool = False):
        super().__init__()
        self.weight = _param(weight)
        self.start, self.valid, self.comm, self.sequence_parallel = start, valid, comm, sequence_parallel

    def forward(self, tokens):
        local = tokens - self.start
        outside = (local < 0) | (local >= self.valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(out, self.comm, self.sequence_parallel)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy of logits split along the vocab. logits: (N, V_local); local columns
    [valid:] are padding. Three all-reduces of N numbers; gradient (softmax - onehot) / N is
    computed locally from the saved exponentials (no communication in backward)."""

    @staticmethod
    def forward(ctx, logits, targets, start, valid, comm):
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
        if valid < z.shape[-1]:
            z[:, valid:] = float("-inf")                       # padding columns: exp() = 0
        zmax = z.max(dim=-1).values
        comm.all_reduce(zmax, op="max")                        # 1: global max, for stability
        z -= zmax.unsqueeze(-1)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp)                               # 2: softmax denominator
        local = targets - start
        mine = (local >= 0) & (local < valid)
        idx = local.clamp(0, z.shape[-1] - 1)
        target_z = torch.where(mine, z.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
        comm.all_reduce(target_z)                              # 3: logit of the target token
        loss = (sum_exp.log() - target_z).mean()
        ctx.save_for_backward(exp, sum_exp, idx, mine)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        exp, sum_exp, idx, mine = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)                     # softmax (local columns)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, idx] -= mine.to(grad.dtype)
        grad.mul_(g / grad.shape[0])
        return grad.to(ctx.in_dtype), None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for ``model.criterion``: (B, S, V_local) logits and (B, S) targets -> mean loss."""

    def __init__(self, start: int, valid: int, comm):
        super().__init__()
        self.start, self.valid, self.comm = start, valid, comm

    def forward(self, logits, targets):
        return _VocabParallelCE.apply(logits.flatten(0, -2), targets.flatten(), self.start,
                                      self.valid, self.comm)


# ---------------------------------------------------------------------------------------------
# Applying the plan
# ---------------------------------------------------------------------------------------------

def check(model_cfg, tp: int, sequence_parallel: bool = False) -> None:
    """The splits tensor parallelism needs; ConfigError naming the field otherwise."""
    m = model_cfg
    if m.n_heads % tp:
        raise ConfigError("parallel.tp", f"tp={tp} does not divide model.n_heads={m.n_heads}; "
                                          "choose tp among the divisors of n_heads")
    if m.kv_heads % tp and tp % m.kv_heads:
        raise ConfigError("model.n_kv_heads", f"{m.kv_heads} kv heads cannot be split over tp={tp} "
                                               "nor replicated evenly; one of them must divide the other")
    from ..models.spec import get_spec
    ffn = get_spec(m).ffn_dim
    if ffn is not None and ffn(m) % tp:
        raise ConfigError("model.ffn_hidden", f"ffn size {ffn(m)} is not divisible by tp={tp}")
    if m.n_experts and sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", "MoE blocks stay whole under tensor parallel "
                                                        "(replicated over tp) and need the full sequence; "
                                                        "set sequence_parallel=false or tp=1")


@register_check
def check_config(cfg) -> None:
    """Config-time constraints of tensor / sequence parallel (called by ``validate``)."""
    p, t = cfg.parallel, cfg.train
    if p.tp > 1:
        check(cfg.model, p.tp, p.sequence_parallel)
    if p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", f"{t.seq_len} is not divisible by tp={p.tp}: sequence parallel splits "
                                           f"the sequence over tp; use a multiple of {p.tp} or "
                                           "parallel.sequence_parallel=false")


class _Ctx:
    def __init__(self, model, mesh, cfg):
        self.model, self.mesh, self.cfg = model, mesh, cfg
        self.comm = mesh.comm("tp")
        self.tp, self.rank = mesh.size("tp"), mesh.local_rank("tp")
        self.sp = bool(cfg.parallel.sequence_parallel)
        self.seed = cfg.train.seed
        self.embedding = self.embedding_source = None  # the VocabParallelEmbedding, once split

    def full(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The global tensor of ``param``: its data, or the meta tensor itself (the shard is then
        a meta tensor too, materialised later from its Placement: parallel/materialize.py)."""
        return param if param.is_meta else param.detach()

    def shard(self, full: torch.Tensor, name: str, dim: int, start: int, rows: int,
              copies: int = 1) -> nn.Parameter:
        """Keep ``rows`` entries of ``dim`` from ``start`` (zero padding beyond the global size)."""
        valid = max(0, min(rows, full.shape[dim] - start))
        local = full.narrow(dim, start, valid) if valid else full.narrow(dim, 0, 0)
        if valid < rows:
            pad = list(full.shape)
            pad[dim] = rows - valid
            local = torch.cat([local, full.new_zeros(pad)], dim=dim)
        p = nn.Parameter(local.clone().contiguous())
        set_placement(p, Placement(name, tuple(full.shape), dim, start, valid, ("tp",), copies))
        return p


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def _vocab_rows(ctx: _Ctx) -> int:
    return -(-ctx.cfg.model.vocab_size // ctx.tp)  # ceil(V / tp)


def _bias_shard(ctx, name, mod, start, rows, copies=1):
    """A column layer's bias, split like its weight's rows (None without bias)."""
    if getattr(mod, "bias", None) is None:
        return None
    return ctx.shard(ctx.full(mod.bias, f"{name}.bias"), f"{name}.bias", 0, start, rows, copies)


def attach_lora(ctx, name, mod, new, dim: int, start: int, n: int, copies: int = 1):
    """Give the TP layer ``new`` the LoRA adapters of ``mod`` (a models/lora.py LoRALinear), split
    consistently with its weight: column layers (``dim`` 0) split B's rows and keep A whole, row
    layers (``dim`` 1) split A's columns and keep B whole."""
    if getattr(mod, "lora_A", None) is None:
        return new
    a, b = ctx.full(mod.lora_A, f"{name}.lora_A"), ctx.full(mod.lora_B, f"{name}.lora_B")
    if dim == 0:
        new.lora_A, new.lora_B = _param(a.clone()), ctx.shard(b, f"{name}.lora_B", 0, start, n, copies)
    else:
        new.lora_A, new.lora_B = ctx.shard(a, f"{name}.lora_A", 1, start, n), _param(b.clone())
    new.lora_scale = mod.scale
    return new


def _colwise(ctx, name, mod):
    full = ctx.full(mod.weight, f"{name}.weight")
    n = full.shape[0] // ctx.tp
    new = ColumnParallelLinear(ctx.shard(full, f"{name}.weight", 0, ctx.rank * n, n), ctx.comm,
                               bias=_bias_shard(ctx, name, mod, ctx.rank * n, n))
    return attach_lora(ctx, name, mod, new, 0, ctx.rank * n, n)


def _colwise_kv(ctx, name, mod):
    kv, hd = ctx.cfg.model.kv_heads, ctx.cfg.model.head_dim
    if kv % ctx.tp == 0:
        return _colwise(ctx, name, mod)
    copies = ctx.tp // kv                        # tp > kv: rank r holds kv head r // copies
    slot = ctx.rank // copies
    full = ctx.full(mod.weight, f"{name}.weight")
    w = ctx.shard(full, f"{name}.weight", 0, slot * hd, hd, copies)
    new = ColumnParallelLinear(w, ctx.comm, copies=(ctx.comm, slot, kv),
                               bias=_bias_shard(ctx, name, mod, slot * hd, hd, copies))
    return attach_lora(ctx, name, mod, new, 0, slot * hd, hd, copies)


def _rowwise(ctx, name, mod):
    full = ctx.full(mod.weight, f"{name}.weight")
    n = full.shape[1] // ctx.tp
    new = RowParallelLinear(ctx.shard(full, f"{name}.weight", 1, ctx.rank * n, n), ctx.comm, ctx.sp,
                            bias=getattr(mod, "bias", None))  # replicated
    return attach_lora(ctx, name, mod, new, 1, ctx.rank * n, n)


def _vocab_embedding(ctx, name, mod):
    rows = _vocab_rows(ctx)
    w = ctx.shard(ctx.full(mod.weight, f"{name}.weight"), f"{name}.weight", 0, ctx.rank * rows, rows)
    valid = max(0, min(rows, ctx.cfg.model.vocab_size - ctx.rank * rows))
    ctx.embedding = VocabParallelEmbedding(w, ctx.rank * rows, valid, ctx.comm, ctx.sp)
    ctx.embedding_source = mod.weight  # the global weight it replaced: a head tied to it shares the slice
    return ctx.embedding


def _vocab_output(ctx, name, mod):
    emb = ctx.embedding  # the vocab embedding split earlier in the plan
    if ctx.cfg.model.tie_embeddings and emb is not None and mod.weight is ctx.embedding_source:
        w = emb.weight                           # tied: the same vocab slice, one parameter
    else:
        rows = _vocab_rows(ctx)
        w = ctx.shard(ctx.full(mod.weight, f"{name}.weight"), f"{name}.weight", 0, ctx.rank * rows, rows)
    return ColumnParallelLinear(w, ctx.comm, input_op="gather" if ctx.sp else "copy")


def _vocab_parallel_loss(ctx, name, mod):
    rows = _vocab_rows(ctx)
    valid = max(0, min(rows, ctx.cfg.model.vocab_size - ctx.rank * rows))
    return VocabParallelCrossEntropy(ctx.rank * rows, valid, ctx.comm)


def _sequence_parallel_norm(ctx, name, mod):
    return SequenceParallelNorm(mod, ctx.comm) if ctx.sp else None


def _position_embedding(ctx, name, mod):
    """Without SP the lookup is replicated like the hidden state: nothing to do."""
    return SequenceParallelPositionEmbedding(mod.weight, ctx.comm) if ctx.sp else None


def _gather_input(ctx, name, mod):
    comm, sp = ctx.comm, ctx.sp

    def hook(module, args):
        return (enter_region(args[0], comm, sp),) + tuple(args[1:])

    mod.register_forward_pre_hook(hook)
    return None


STYLES = {"colwise": _colwise, "colwise_kv": _colwise_kv, "rowwise": _rowwise,
          "vocab_embedding": _vocab_embedding, "vocab_output": _vocab_output,
          "vocab_parallel_loss": _vocab_parallel_loss, "sequence_parallel_norm": _sequence_parallel_norm,
          "position_embedding": _position_embedding, "gather_input": _gather_input}


def apply(model: nn.Module, mesh, cfg, plan: dict[str, str]) -> nn.Module:
    """Shard ``model`` in place over ``mesh``'s tp group following ``plan`` (the architecture's
    ``ModelSpec.tp_plan``). On a meta model the shards stay meta (with their Placements) and
    ``parallelize`` materialises each rank's boxes at the end. Returns the model."""
    tp = mesh.size("tp")
    if tp == 1:
        return model
    check(cfg.model, tp, cfg.parallel.sequence_parallel)
    ctx = _Ctx(model, mesh, cfg)
    # MoE feed-forwards stay whole: replicated over tp, their experts placed by expert parallel.
    moe = {name for name, mod in model.named_modules() if isinstance(mod, MoE)}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan: unknown style {style!r} for {pattern!r}; styles are {sorted(STYLES)}")
        for name, mod in list(model.named_modules()):
            if name and fnmatchcase(name, pattern) and not any(name == m or name.startswith(m + ".") for m in moe):
                new = STYLES[style](ctx, name, mod)
                if new is not None:
                    for key, q in new.named_parameters(recurse=False):  # frozen stays frozen (a LoRA base)
                        old = getattr(mod, key, None)
                        if isinstance(old, torch.Tensor):
                            q.requires_grad_(old.requires_grad)
                    _replace(model, name, new)
    return model
