"""The experts' SwiGLU as grouped matrix products (one kernel per weight for all experts).

Input: rows ``x`` (n, D) grouped by expert, ``counts[e]`` rows for expert e in order, as a
tensor (it stays on the device); rows past ``counts.sum()`` belong to no expert and come back
as zeros (the MoE layer puts its dropped assignments there, so shapes never depend on routing).
Weights are stacked: ``w1``, ``w3`` (E, H, D) and ``w2`` (E, D, H).

  y_i = w2[e_i] (silu(w1[e_i] x_i) * w3[e_i] x_i)        e_i = the expert of row i

Implementations (``model.moe_impl``):
  grouped  ``torch._grouped_mm`` with the cumulative counts as offsets when the dtype is fp32,
           bf16 or fp16 and the rows are 16-byte aligned: no Python loop over experts and no
           host read (the offsets never leave the device). Otherwise (float64, odd widths) a
           padded batched matmul: the rows are scattered into an (E, C, D) buffer, C = the
           largest count, and three ``bmm`` cover every expert; reading C is the one host
           read of this path.
  loop     one ``F.linear`` triple per expert (the reference: ``counts`` read on the host).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLS = ("grouped", "loop")


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, impl: str = "grouped") -> torch.Tensor:
    if impl == "loop":
        return _loop(x, counts, w1, w3, w2)
    if _grouped_mm_ok(x, w1):
        return _grouped_mm(x, counts, w1, w3, w2)
    return _padded_bmm(x, counts, w1, w3, w2)


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
    size = x.element_size()
    return (hasattr(torch, "_grouped_mm") and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and w1.dtype == x.dtype and (x.shape[1] * size) % 16 == 0 and (w1.shape[1] * size) % 16 == 0
            and (not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (9, 0)))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm``'s
    backward refuses expanded gradients, e.g. that of ``y.sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm(x, counts, w1, w3, w2):
    offs = counts.cumsum(0).to(torch.int32)
    # rows past the last offset are left unwritten by the kernel, forward and backward: ``where``
    # (not a product: garbage may be NaN) zeroes their outputs and their input gradients
    valid = (torch.arange(x.shape[0], device=x.device) < offs[-1])[:, None]
    mm = lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)  # noqa: E731
    x = torch.where(valid, x, 0)
    h = _ContiguousGrad.apply(F.silu(mm(x, w1)) * mm(x, w3))
    y = _ContiguousGrad.apply(mm(h, w2))
    return torch.where(valid, y, 0)


def _padded_bmm(x, counts, w1, w3, w2):
    E, n, D = counts.numel(), x.shape[0], x.shape[1]
    ends = counts.cumsum(0)
    row = torch.arange(n, device=x.device)
    e = torch.searchsorted(ends, row, right=True)                       # E for rows past the groups
    ec = e.clamp(max=E - 1)
    C = max(int(counts.max()), 1)                                       # the host read of this path
    slot = torch.where(e < E, ec * C + row - (ends - counts)[ec], E * C)  # E*C: a spare row
    xb = x.new_zeros(E * C + 1, D).index_add(0, slot, x)[:E * C].view(E, C, D)
    h = F.silu(torch.bmm(xb, w1.transpose(1, 2))) * torch.bmm(xb, w3.transpose(1, 2))
    y = torch.bmm(h, w2.transpose(1, 2)).reshape(E * C, -1)
    return torch.cat([y, y.new_zeros(1, y.shape[1])])[slot]
