"""Attention kernels that return the log-sum-exp, for ring attention's chunk pairs.

Ring attention (context.py) computes attention of a query chunk over one key chunk at a time
and merges the partial results by their log-sum-exp (lse); its backward recomputes each pair's
gradients from the *final* output O and lse of the query rows (flash-attention style:
D = rowsum(dO * O), P = exp(q k^T * scale - lse)). PyTorch's fused SDPA kernels expose exactly
these two entry points as aten ops:

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` -> (out, lse) and its ``_backward``
  taking (dO, q, k, v, O, lse); float64, float32, bfloat16 and float16.
* CUDA: ``_scaled_dot_product_efficient_attention`` (compute_log_sumexp=True) -> (out, lse,
  philox seed, offset) and its ``_backward``; float32, bfloat16, float16 (not float64).

Passing the final O and lse of the query rows (not the pair's own) to the backward gives the
pair's share of dQ, dK, dV, as in the hand-written path. ``is_causal`` on a diagonal pair (query
and key chunk equal length) is the triangular mask of that pair.

``forward``/``backward`` return None where no kernel covers the device and dtype (CUDA
float64, other devices); the caller then uses its hand-written fp32/fp64 matmuls. The CUDA path
checks itself once per (device, dtype) against the hand-written one on a small problem before
it is used (its op signatures have changed between PyTorch releases).
"""
from __future__ import annotations

import torch

_aten = torch.ops.aten
_CUDA_OK: dict = {}


def _cpu(q) -> bool:
    return q.device.type == "cpu" and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu")


def _cuda(q) -> bool:
    if q.device.type != "cuda" or q.dtype == torch.float64:
        return False
    if not hasattr(_aten, "_scaled_dot_product_efficient_attention"):
        return False
    key = (q.device, q.dtype)
    if key not in _CUDA_OK:
        _CUDA_OK[key] = False  # while checking, and for good if the check fails
        _CUDA_OK[key] = _self_check(q.device, q.dtype)
    return _CUDA_OK[key]


def available(q) -> bool:
    return _cpu(q) or _cuda(q)


def forward(q, k, v, scale: float, causal: bool):
    """(out, lse) of q over (k, v), same head count; None where no kernel applies."""
    if _cpu(q):
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if _cuda(q):
        return _cuda_forward(q, k, v, scale, causal)
    return None


def backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    """(dq, dk, dv) of this pair given the final (out, lse) of the query rows; None as forward."""
    if _cpu(q):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if _cuda(q):
        return _cuda_backward(dout, q, k, v, out, lse, scale, causal)
    return None


def _cuda_forward(q, k, v, scale, causal):
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]]  # some releases pad lse's query dim to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, scale, causal):
    seed = offset = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, torch.empty(0, device=q.device, dtype=q.dtype), out, lse.contiguous(), seed, offset,
        0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _self_check(device, dtype) -> bool:
    """The CUDA kernel against plain matmuls on a small problem (both directions)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v, do = (torch.randn(1, 2, 40, 16, generator=g).to(device, dtype) for _ in range(4))
        scale, tol = 0.25, (1e-3 if dtype == torch.float32 else 3e-2)
        for causal in (False, True):
            res = _cuda_forward(q, k, v, scale, causal)
            s = (q.float() @ k.float().transpose(-1, -2)) * scale
            if causal:
                s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool, device=device).triu(1), float("-inf"))
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[..., None])
            out = p @ v.float()
            if not (torch.allclose(res[0].float(), out, atol=tol) and torch.allclose(res[1].float(), lse, atol=tol)):
                return False
            dq, dk, dv = _cuda_backward(do, q, k, v, res[0], res[1], scale, causal)
            dv_ref = p.transpose(-1, -2) @ do.float()
            ds = p * (do.float() @ v.float().transpose(-1, -2) - (do.float() * out).sum(-1, keepdim=True))
            for got, ref in ((dq, ds @ k.float() * scale), (dk, ds.transpose(-1, -2) @ q.float() * scale),
                             (dv, dv_ref)):
                if not torch.allclose(got.float(), ref, atol=tol * 10):
                    return False
        return True
    except (RuntimeError, TypeError):
        return False
