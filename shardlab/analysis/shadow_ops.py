"""What a meta forward needs beyond shapes (analysis/shadow.py's trace): stand-ins for the MoE
kernels that have no meta implementation, and a count of the operators the forward dispatches
(the planner's CPU time model charges each operator a probed latency, docs/planner.md)."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _GroupedMM(torch.autograd.Function):
    """Stand-in for ``torch._grouped_mm`` on meta (whose meta kernel takes bf16 only): the
    (rows, out) product, saving what the kernel's backward saves (both operands, the offsets)."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - traces never run backward
        a, b, _ = ctx.saved_tensors
        return torch.zeros_like(a), torch.zeros_like(b), None


@contextlib.contextmanager
def meta_routing(state: dict, autocast_dtype: torch.dtype | None = None):
    """MoE layers run on meta as they are: ``_grouped_mm`` is :class:`_GroupedMM`, and a 1-D meta
    tensor's ``tolist`` (the all-to-all split sizes) spreads ``state["rows"]`` evenly (balanced
    routing, no drop). ``is_autocast_enabled("meta")`` / ``get_autocast_dtype("meta")`` report
    ``autocast_dtype`` (None: off), so code that asks takes the branch a real run takes."""
    old_gmm, old_tl = getattr(torch, "_grouped_mm", None), torch.Tensor.tolist
    old_ac, old_dt = torch.is_autocast_enabled, torch.get_autocast_dtype

    def tolist(t):
        if t.is_meta and t.dim() == 1:
            n, rows = t.shape[0], state.get("rows", 0)
            return [rows // n + (1 if i < rows % n else 0) for i in range(n)]
        return old_tl(t)

    torch.Tensor.tolist = tolist
    torch.is_autocast_enabled = lambda *a: (autocast_dtype is not None) if a and a[0] == "meta" else old_ac(*a)
    torch.get_autocast_dtype = lambda dev: autocast_dtype if dev == "meta" and autocast_dtype else old_dt(dev)
    torch._grouped_mm = lambda a, b, offs=None, **kw: _GroupedMM.apply(a, b, offs)
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.is_autocast_enabled, torch.get_autocast_dtype = old_tl, old_ac, old_dt
        if old_gmm is not None:
            torch._grouped_mm = old_gmm


_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm"}


class OpCount(TorchDispatchMode):
    """Counts the aten operators of a forward by region, and the bytes the non-matmul ones write.
    Per region also the forward FLOPs of its 2-D matrix products (``mm_flops``) and, applying
    recompute.op_keeps to them in order (the count restarting at each region, as the policy's
    restarts at each checkpointed block), the FLOPs the ``op`` policy recomputes
    (``op_recompute_flops``) and the bytes of the outputs it keeps (``op_kept``). In the last region
    it also keeps the largest tensor an operator creates (``loss_copy``)."""

    def __init__(self, out, state):
        super().__init__()
        self.out, self.state, self.mms = out, state, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from ..parallel.recompute import is_product, op_keeps
        res = func(*args, **(kwargs or {}))
        region = self.state["region"]
        self.out.ops[region] = self.out.ops.get(region, 0) + 1
        name = func.overloadpacket.__name__
        if is_product(func):  # out (M, N) = a (M, K) @ b (K, N) [+ bias]
            k = self.mms[region] = self.mms.get(region, 0) + 1
            flops = 2 * res.numel() * args[-1].shape[0]
            self.out.mm_flops[region] = self.out.mm_flops.get(region, 0) + flops
            if op_keeps(func, k):
                self.out.op_kept[region] = self.out.op_kept.get(region, 0) + res.numel() * res.element_size()
            else:
                self.out.op_recompute_flops[region] = self.out.op_recompute_flops.get(region, 0) + flops
        outs = _tensors(res if isinstance(res, (tuple, list)) else [res])
        if region == "last":  # the loss's fp32 copy of bf16 logits is the region's largest tensor
            self.out.loss_copy = max([self.out.loss_copy] + [t.numel() * t.element_size() for t in outs if t.dim() > 1])
        if name not in _MATMULS:
            ins = {a.untyped_storage()._cdata for a in _tensors(args) + _tensors((kwargs or {}).values())}
            new = sum(t.numel() * t.element_size() for t in outs if t.untyped_storage()._cdata not in ins)
            self.out.ew_bytes[region] = self.out.ew_bytes.get(region, 0) + new
        return res


def _tensors(xs) -> list:
    out = []
    for x in xs:
        if torch.is_tensor(x):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            out += _tensors(x)
    return out
