"""The experts' SwiGLU as one autograd node over all experts: rows ``x`` (n, D) grouped by expert,
``counts[e]`` rows for expert e (rows past ``counts.sum()`` come back as zeros), stacked weights
``w1``, ``w3`` (E, H, D) and ``w2`` (E, D, H); ``y_i = w2[e_i] (silu(w1[e_i] x_i) * w3[e_i] x_i)``.
The backward is hand-written (only silu(h1) recomputed, each weight gradient written once).
Kernels for the per-expert products: ``segments`` (one ``mm`` per expert), ``grouped_mm``
(``torch._grouped_mm``, no host read on CUDA), ``padded`` (``bmm`` over an (E, C, .) buffer);
``impl = loop`` is the reference. The backward formulas, the kernel choice (``auto``,
SMALL_PRODUCT) and measurements: docs/expert-parallel.md ("Expert kernels", "Grouped GEMM vs
the per-expert loop").
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

IMPLS = ("grouped", "loop")
KERNELS = ("auto", "grouped_mm", "padded", "segments")
# ``auto`` off CUDA with a capacity: padded where an expert's product (mean rows x D x H) is at most
# SMALL_PRODUCT, or LOW_PRECISION_PRODUCT in bf16/fp16 while padding adds at most PAD_WASTE of the
# rows; else segments (measured on the 2-core CPU: docs/expert-parallel.md, "Expert kernels").
SMALL_PRODUCT, LOW_PRECISION_PRODUCT, PAD_WASTE = 1 << 20, 1 << 24, 1.3


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, impl: str = "grouped",
               kernel: str = "auto", capacity: int = 0) -> torch.Tensor:
    """``capacity``: an upper bound on every ``counts[e]`` (0 = none known). The padded kernel
    then pads every expert to it: shapes, hence memory, fixed by it and nothing read on the host."""
    if impl == "loop":
        return _loop(x, counts, w1, w3, w2)
    dev = x.device.type
    autocast = torch.is_autocast_enabled(dev)
    if autocast:   # compute in the autocast dtype, as F.linear would
        dt = torch.get_autocast_dtype(dev)
        x, w1, w3, w2 = (t.to(dt) for t in (x, w1, w3, w2))
    sizes = None
    if kernel == "auto":
        if x.is_cuda:
            kernel = "grouped_mm" if _grouped_mm_ok(x, w1) else "padded"
        else:   # counts live in host memory here (no sync); the meta trace gives balanced sizes
            sizes = counts.tolist()
            kernel = _cpu_kernel(x, w1, sizes, capacity)
    if kernel not in KERNELS:
        raise ValueError(f"unknown expert kernel {kernel!r}; one of {KERNELS}")
    if kernel == "grouped_mm" and not _grouped_mm_ok(x, w1):
        raise ValueError(f"torch._grouped_mm cannot take {x.dtype} rows of width {x.shape[1]} here")
    args = (x, counts, w1, w3, w2, kernel, sizes, capacity)
    if not autocast or dev == "meta":  # (torch.autocast cannot be entered on meta: the planner's trace)
        return _Experts.apply(*args)
    with torch.autocast(dev, enabled=False):
        return _Experts.apply(*args)


def _cpu_kernel(x: torch.Tensor, w1: torch.Tensor, sizes: list, capacity: int) -> str:
    """``padded`` or ``segments`` for rows ``sizes[e]`` per expert (see SMALL_PRODUCT)."""
    n = sum(sizes)
    if n == 0 or not capacity:
        return "segments"
    per_expert = n / len(sizes) * w1.shape[1] * w1.shape[2]
    waste = len(sizes) * capacity / n
    low = x.dtype in (torch.bfloat16, torch.float16)
    return ("padded" if per_expert <= SMALL_PRODUCT or (low and per_expert <= LOW_PRECISION_PRODUCT
                                                         and waste <= PAD_WASTE) else "segments")


def _loop(x, counts, w1, w3, w2):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        start += n
        outs.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
    if start < x.shape[0]:
        outs.append(x.new_zeros(x.shape[0] - start, w2.shape[1]))
    return torch.cat(outs) if outs else x[:0]


def _grouped_mm_ok(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """On CUDA only bf16 on sm90+: torch's kernel for it. Other dtypes fall back to a loop over the
    groups that reads the offsets on the host (seen on an H200, torch 2.11: a device sync)."""
    size = x.element_size()
    return (hasattr(torch, "_grouped_mm") and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and w1.dtype == x.dtype and (x.shape[1] * size) % 16 == 0 and (w1.shape[1] * size) % 16 == 0
            and (not x.is_cuda or (x.dtype == torch.bfloat16
                                   and torch.cuda.get_device_capability(x.device) >= (9, 0))))


class _GroupedRows:
    """``torch._grouped_mm`` on the rows as they are, offsets = cumulative counts (on device)."""

    def __init__(self, x, counts):
        self.offs = counts.cumsum(0).to(torch.int32)
        self.valid = (torch.arange(x.shape[0], device=x.device) < self.offs[-1])[:, None]

    def pack(self, t):
        return torch.where(self.valid, t, 0)

    unpack = pack

    def mm(self, a, w):     # rows of expert e times w[e]; rows past the groups are left unwritten
        return torch.where(self.valid, torch._grouped_mm(a, w, offs=self.offs), 0)

    def wmm(self, g, a):    # sum over the rows of expert e of g_i^T a_i -> (E, ., .)
        return torch._grouped_mm(g.t(), a, offs=self.offs)


def padded_slots(counts: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """For ``n`` rows grouped by expert (``counts[e]`` rows each, in order, at most ``C``; rows past
    ``counts.sum()`` belong to no expert): row i's slot in an (E, C) buffer, ``e * C + (i - first
    row of e)``, and ``E * C`` (one spare slot) for the rows of no expert. On device, no host read."""
    E = counts.numel()
    ends = counts.cumsum(0)
    row = torch.arange(n, device=counts.device)
    e = torch.searchsorted(ends, row, right=True)                       # E for rows past the groups
    ec = e.clamp(max=E - 1)
    return torch.where(e < E, ec * C + row - (ends - counts)[ec], E * C)


class _Padded:
    """Rows scattered into an (E, C, .) buffer, C = the capacity if one is known, else the largest
    count (read on the host), and ``bmm``; padding rows are zeros and stay zeros (silu(0) * 0 = 0)."""

    def __init__(self, x, counts, capacity=0, sizes=None):
        self.E = counts.numel()
        # without a capacity: the largest count, the one host read of this kernel
        self.C = capacity or max(max(sizes) if sizes is not None else int(counts.max()), 1)
        if sizes is not None and max(sizes, default=0) > self.C:
            raise ValueError(f"an expert has {max(sizes)} rows, above the capacity {self.C}")
        self.slot = padded_slots(counts, x.shape[0], self.C)

    def pack(self, t):
        buf = t.new_zeros(self.E * self.C + 1, t.shape[1]).index_copy_(0, self.slot, t)
        return buf[:-1].view(self.E, self.C, t.shape[1])

    def unpack(self, t):
        flat = t.reshape(self.E * self.C, -1)
        return torch.cat([flat, flat.new_zeros(1, flat.shape[1])]).index_select(0, self.slot)

    def mm(self, a, w):
        return torch.bmm(a, w)

    def wmm(self, g, a):
        return torch.bmm(g.transpose(1, 2), a)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, w3, w2, kernel, sizes, capacity):
        x = x.contiguous()
        if kernel != "segments":
            lay = _GroupedRows(x, counts) if kernel == "grouped_mm" else _Padded(x, counts, capacity, sizes)
            xp = lay.pack(x)
            h1, h3 = lay.mm(xp, w1.transpose(1, 2)), lay.mm(xp, w3.transpose(1, 2))
            y = lay.unpack(lay.mm(F.silu(h1) * h3, w2.transpose(1, 2)))
            ctx.lay = lay
            ctx.save_for_backward(xp, h1, h3, w1, w3, w2)
        else:
            ends = list(itertools.accumulate(counts.tolist() if sizes is None else sizes))  # its host read
            # (sizes read, then summed here: the planner's meta trace gives balanced sizes for a
            # 1-D tolist, so it runs, and counts the operators of, every expert's segment)
            seg = list(zip([0] + ends[:-1], ends))
            n, H = x.shape[0], w1.shape[1]
            h1, h3, y = x.new_empty(n, H), x.new_empty(n, H), x.new_empty(n, w2.shape[1])
            for t in (h1, h3, y):
                t[ends[-1] if ends else 0:].zero_()             # rows of no expert
            for e, (s, t) in enumerate(seg):
                if t > s:
                    xe = x[s:t]
                    torch.mm(xe, w1[e].t(), out=h1[s:t])
                    torch.mm(xe, w3[e].t(), out=h3[s:t])
                    torch.mm(F.silu(h1[s:t]) * h3[s:t], w2[e].t(), out=y[s:t])
            ctx.seg, ctx.lay = seg, None
            ctx.save_for_backward(x, h1, h3, w1, w3, w2)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_x = ctx.needs_input_grad[0]
        dy = dy.contiguous()
        if ctx.lay is not None:
            lay = ctx.lay
            xp, h1, h3, w1, w3, w2 = ctx.saved_tensors
            dyp = lay.pack(dy)
            act = F.silu(h1)
            dw2 = lay.wmm(dyp, act * h3)
            da = lay.mm(dyp, w2)
            dh3 = da * act
            dh1 = torch.ops.aten.silu_backward(da * h3, h1)
            dw1, dw3 = lay.wmm(dh1, xp), lay.wmm(dh3, xp)
            dx = lay.unpack(lay.mm(dh1, w1) + lay.mm(dh3, w3)) if need_x else None
            return dx, None, dw1, dw3, dw2, None, None, None
        x, h1, h3, w1, w3, w2 = ctx.saved_tensors
        dw1, dw3, dw2 = torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)
        dx = torch.empty_like(x) if need_x else None
        if need_x:
            dx[ctx.seg[-1][1] if ctx.seg else 0:].zero_()
        for e, (s, t) in enumerate(ctx.seg):
            if t == s:
                for g in (dw1, dw3, dw2):
                    g[e].zero_()
            else:
                he1, he3, dye = h1[s:t], h3[s:t], dy[s:t]
                act = F.silu(he1)
                torch.mm(dye.t(), act * he3, out=dw2[e])
                da = dye @ w2[e]
                dh3 = da * act
                dh1 = torch.ops.aten.silu_backward(da.mul_(he3), he1)
                torch.mm(dh1.t(), x[s:t], out=dw1[e])
                torch.mm(dh3.t(), x[s:t], out=dw3[e])
                if need_x:
                    torch.addmm(dh1 @ w1[e], dh3, w3[e], out=dx[s:t])
        return dx, None, dw1, dw3, dw2, None, None, None
