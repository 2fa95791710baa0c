"""Activation checkpointing keeps names, keeps results, and really saves fewer activations."""
import torch

from shardlab.config import ModelConfig
from shardlab.models import build_model
from shardlab.models import get_spec
from shardlab.parallel import recompute as checkpointing

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


def _saved_bytes_and_grads(mode):
    model = build_model(CFG, seed=3, dtype=torch.float64)
    names = [n for n, _ in model.named_parameters()]
    checkpointing.apply(model, mode, get_spec("llama"))
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = model(x, x)
    loss.backward()
    return sum(saved), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recomputation_saves_less_and_changes_nothing():
    base, loss, grads = _saved_bytes_and_grads("none")
    for mode in ("full", "selective"):
        saved, loss_ac, grads_ac = _saved_bytes_and_grads(mode)
        assert saved < base, mode
        assert loss_ac == loss
        for n, g in grads.items():
            assert torch.allclose(grads_ac[n], g, atol=1e-12, rtol=0), (mode, n)


def _backward_ops(mode):
    """aten operators dispatched during loss.backward() (recomputation included), by name."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    model = build_model(CFG, seed=3, dtype=torch.float64)
    checkpointing.apply(model, mode, get_spec("llama"))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(x, x)
    seen = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        loss.backward()
    return seen, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_op_policy_recomputes_every_second_matmul_and_no_attention():
    """``op``: per block of the Llama (q, k, v, o, gate, up, down: 7 products) backward re-runs
    the 2nd, 4th and 6th (k, o, up) and not the attention kernel; ``full`` re-runs the first 6
    (the down projection's output is saved by nothing, so recomputation stops before it) and the
    attention. Gradients equal those without recomputation."""
    none, grads = _backward_ops("none")
    blocks = CFG.n_layers
    for mode, extra_mm, extra_attn in (("op", 3 * blocks, 0), ("full", 6 * blocks, blocks)):
        seen, grads_ac = _backward_ops(mode)
        assert seen["mm"] - none["mm"] == extra_mm, (mode, seen["mm"], none["mm"])
        attn = "_scaled_dot_product_flash_attention_for_cpu"
        assert seen[attn] - none[attn] == extra_attn, (mode, seen[attn], none[attn])
        for n, g in grads.items():
            assert torch.allclose(grads_ac[n], g, atol=1e-12, rtol=0), (mode, n)


def test_op_keeps_rule():
    aten = torch.ops.aten
    keeps = [checkpointing.op_keeps(aten.mm.default, i) for i in range(1, 8)]
    assert keeps == [True, False, True, False, True, False, True]
    assert checkpointing.op_keeps(aten._scaled_dot_product_flash_attention.default, 2)
    assert not checkpointing.op_keeps(aten.silu.default, 1) and not checkpointing.op_keeps(aten.mul.Tensor, 3)
    assert not checkpointing.op_keeps(aten.mm.out, 1)  # an out= product writes a caller's buffer
