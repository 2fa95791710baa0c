"""Activation memory of an image (``task = "classify"``) model, before launch: one training
micro-batch's forward and backward, and the evaluation pass's forward, run on the meta device
while every tensor an op creates is counted for as long as it is alive (docs/data-parallel.md,
"What a rank holds"). Token models take the block-wise trace of plan_activations.py instead."""
from __future__ import annotations

import contextlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops under it create, alive at once: ``now`` after the latest op
    (or :meth:`settle`), ``peak`` the most seen after any op. A storage counts from the op that
    made it until Python and autograd drop their last reference (a weak reference to the storage
    itself, so views and autograd's saved tensors keep it counted). The storages of ``given``
    (parameters, their gradients, the inputs: made before, priced apart) are never counted, nor a
    view of them an op returns (a weight's transpose)."""

    def __init__(self, given=()):
        super().__init__()
        self.given = {t.untyped_storage()._cdata for t in given}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def settle(self) -> int:
        """Drop the storages freed since the last op; the bytes still alive."""
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]  # before new storages are added: a freed storage's key may be reused
        self.now = sum(n for _, n in self.live.values())
        return self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.settle()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in self.given:
                    self.live.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        self.now = sum(n for _, n in self.live.values())
        self.peak = max(self.peak, self.now)
        return out


def _model_and_cast(cfg, device: str):
    """The rank's meta model in the parameters' dtype, and autocast's rules for ``device``."""
    from .plan_activations import mode_parts, trace_mode
    from .shadow import AutocastTrace, local_model
    autocast, dtype = mode_parts(trace_mode(cfg, device))
    model = local_model(cfg, 0, dtype)
    cast = AutocastTrace(torch.bfloat16, autocast) if autocast else contextlib.nullcontext()
    return model, cast


def _batch(cfg, model, batch: int, targets: bool = True) -> tuple:
    from ..models.spec import get_spec
    from .shadow import _meta_batch
    dtype = next(model.parameters()).dtype
    x, y = _meta_batch(cfg, get_spec(cfg.model), model, batch, 0, dtype)
    return (x, y) if targets else (x,)


def step_activations(cfg, device: str = "cpu") -> tuple[float, float]:
    """(bytes alive at the end of one micro-batch's forward: what autograd saved and the loss,
    the most alive beyond them at any op of the forward and backward). The parameters' gradients
    exist before the trace (model state, priced apart), so a gradient added into one is a
    temporary here, as in the engines."""
    from .plan_activations import micro_batch
    model, cast = _model_and_cast(cfg, device)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    x = _batch(cfg, model, micro_batch(cfg))
    given = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.requires_grad), *x]
    with LiveBytes(given) as live:
        with cast:  # the backward runs outside autocast, as in the engines
            loss = model(*x)
        saved = live.settle()  # the forward's locals are gone: what autograd saved, and the loss
        loss.backward()
    return float(saved), float(max(0, live.peak - saved))


def eval_activations(cfg, device: str = "cpu") -> float:
    """The most bytes alive at once in the evaluation pass (``train/images.accuracy``): one batch of
    ``EVAL_BATCH`` test images (fewer if this rank's share of the test split is smaller), its
    forward under no_grad in eval mode (dropout off), the batch itself included."""
    from ..train.images import EVAL_BATCH, SPLITS
    n_test = SPLITS.get(cfg.data.dataset, (0, EVAL_BATCH, 0))[1]
    share = -(-min(n_test, cfg.data.limit_test or n_test) // max(1, cfg.parallel.dp * cfg.parallel.cp))
    model, cast = _model_and_cast(cfg, device)
    model.eval()
    x = _batch(cfg, model, max(1, min(EVAL_BATCH, share)), targets=False)
    with torch.no_grad(), LiveBytes([*model.parameters(), *model.buffers(), *x]) as live, cast:
        model(*x)
    return float(x[0].untyped_storage().nbytes() + live.peak)
