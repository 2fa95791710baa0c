"""The experts' SwiGLU as one autograd node over all experts (no per-expert autograd graph).

Input: rows ``x`` (n, D) grouped by expert, ``counts[e]`` rows for expert e in order, as a
tensor; rows past ``counts.sum()`` belong to no expert and come back as zeros (the MoE layer
puts its dropped assignments there, so shapes never depend on routing). Weights are stacked:
``w1``, ``w3`` (E, H, D) and ``w2`` (E, D, H).

  h1 = w1[e_i] x_i,  h3 = w3[e_i] x_i,  a = silu(h1) * h3,  y_i = w2[e_i] a_i    e_i = expert of row i

Backward (hand-written, so nothing is recomputed or padded and the weight gradients are
written once, not summed from E full-size zero tensors as autograd does for ``w[e]``):

  dW2[e] = dY_e^T A_e      dA = dY w2[e]      dH1 = dA * h3 * silu'(h1)      dH3 = dA * silu(h1)
  dW1[e] = dH1_e^T X_e     dW3[e] = dH3_e^T X_e     dX = dH1 w1[e] + dH3 w3[e]  (only if x needs it)

with silu'(h) = s (1 + h (1 - s)), s = sigmoid(h) (one ``aten.silu_backward``). Two kernels
evaluate the per-expert products:
  grouped_mm  ``torch._grouped_mm`` with the cumulative counts as offsets (fp32/bf16/fp16, rows
              16-byte aligned, CUDA sm90+ or CPU): no host read, the offsets stay on the device;
              the elementwise SwiGLU runs once over all rows. ``auto`` picks it on CUDA.
  segments    one ``mm`` per expert on its contiguous slice of rows, the SwiGLU computed per
              slice while it is in cache (any dtype and width). It reads ``counts`` on the
              host once per forward (free on CPU, where the tensor already lives in host
              memory). ``auto`` picks it on CPU: measured faster there than ``torch._grouped_mm``,
              whose CPU implementation is itself a loop of ``mm`` over the groups
              (docs/expert-parallel.md, "Grouped GEMM on CPU").
``impl = loop`` is the reference: one ``F.linear`` triple per expert under autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLS = ("grouped", "loop")
KERNELS = ("auto", "grouped_mm", "segments")


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, impl: str = "grouped",
               kernel: str = "auto") -> torch.Tensor:
    if impl == "loop":
        return _loop(x, counts, w1, w3, w2)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):   # compute in the autocast dtype, as F.linear would
        dt = torch.get_autocast_dtype(dev)
        x, w1, w3, w2 = (t.to(dt) for t in (x, w1, w3, w2))
    if kernel == "auto":
        kernel = "grouped_mm" if x.is_cuda and _grouped_mm_ok(x, w1) else "segments"
    if kernel == "grouped_mm" and not _grouped_mm_ok(x, w1):
        raise ValueError(f"torch._grouped_mm cannot take {x.dtype} rows of width {x.shape[1]} here")
    with torch.autocast(dev, enabled=False):
        return _Experts.apply(x, counts, w1, w3, w2, kernel == "grouped_mm")


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


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, w3, w2, use_gmm):
        x = x.contiguous()
        if use_gmm:
            offs = counts.cumsum(0).to(torch.int32)
            valid = (torch.arange(x.shape[0], device=x.device) < offs[-1])[:, None]
            gmm = lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)  # noqa: E731
            # rows past the last offset are left unwritten (garbage, maybe NaN): ``where`` zeroes them
            h1, h3 = torch.where(valid, gmm(x, w1), 0), torch.where(valid, gmm(x, w3), 0)
            y = torch.where(valid, gmm(F.silu(h1) * h3, w2), 0)
            ctx.save_for_backward(x, h1, h3, w1, w3, w2, offs, valid)
        else:
            ends = counts.cumsum(0).tolist()                    # the host read of this kernel
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
            ctx.seg = seg
            ctx.save_for_backward(x, h1, h3, w1, w3, w2)
        ctx.use_gmm = use_gmm
        return y

    @staticmethod
    def backward(ctx, dy):
        need_x = ctx.needs_input_grad[0]
        dy = dy.contiguous()
        if ctx.use_gmm:
            x, h1, h3, w1, w3, w2, offs, valid = ctx.saved_tensors
            gmm = lambda a, b: torch._grouped_mm(a, b, offs=offs)  # noqa: E731
            dy = torch.where(valid, dy, 0)
            act = F.silu(h1)
            dw2 = gmm(dy.t(), act * h3)
            da = gmm(dy, w2)
            dh3 = da * act
            dh1 = torch.ops.aten.silu_backward(da * h3, h1)
            dw1, dw3 = gmm(dh1.t(), x), gmm(dh3.t(), x)
            dx = torch.where(valid, gmm(dh1, w1) + gmm(dh3, w3), 0) if need_x else None
            return dx, None, dw1, dw3, dw2, None
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
        return dx, None, dw1, dw3, dw2, None
