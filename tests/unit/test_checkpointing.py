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
