"""``model.attention``: the explicit ``math`` core (scores materialised) against PyTorch's fused
``scaled_dot_product_attention`` (an independent implementation), the bytes it saves, its
attention dropout, and the refusal under ring context parallel."""
import pytest
import torch

from shardlab.config import Config, ModelConfig
from shardlab.errors import ConfigError
from shardlab.models import build_model

SHAPES = {"llama": dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
          "gpt2": dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)}


def _model(arch, kind, dropout=0.0):
    return build_model(ModelConfig(arch=arch, attention=kind, dropout=dropout, **SHAPES[arch]), 0,
                       dtype=torch.float64)


def _loss_and_grads(model, tokens):
    loss = model(tokens[:, :-1], tokens[:, 1:])  # the mean loss
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_math_core_equals_fused_kernel(arch):
    """Same weights (init by name), float64: loss and every gradient equal to 1e-12 (llama with
    grouped-query attention: 2 kv heads for 4 query heads)."""
    tokens = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _loss_and_grads(_model(arch, "sdpa"), tokens)
    loss, got = _loss_and_grads(_model(arch, "math"), tokens)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    assert set(got) == set(ref)
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=0, atol=1e-12), name


def test_math_core_saves_the_scores():
    """Autograd keeps (B, H, S, S) score-shaped tensors under ``math`` (the softmax output, used again
    by the product with v), one storage per layer at least; none under the fused kernel."""
    b, s = 2, 16
    tokens = torch.randint(0, 64, (b, s))
    for kind, layers in (("sdpa", 0), ("math", 2)):
        model, square = _model("llama", kind), set()

        def pack(t):
            if t.dim() == 4 and t.shape[-2:] == (s, s) and t.is_floating_point():
                square.add(t.untyped_storage().data_ptr())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens)
        assert len(square) >= layers and (layers or not square), (kind, len(square))


def test_math_core_attention_dropout():
    """gpt2 ``math`` drops attention probabilities in training (model.dropout) and not in eval,
    where it equals the fused kernel."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    model, ref = _model("gpt2", "math", dropout=0.5), _model("gpt2", "sdpa", dropout=0.5)
    model.eval(), ref.eval()
    assert torch.allclose(model(tokens), ref(tokens), rtol=0, atol=1e-12)  # logits
    core = model.layers["0"].attn.core
    core.train()
    q = k = v = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    torch.manual_seed(0)
    a = core(q, k, v)
    core.eval()
    assert not torch.allclose(a, core(q, k, v))


def test_math_core_is_refused_under_ring_context_parallel():
    cfg = Config()
    cfg.model.attention, cfg.parallel.cp, cfg.train.seq_len = "math", 2, 64
    with pytest.raises(ConfigError, match="model.attention") as e:
        cfg.validate(2)
    assert "cp_impl" in str(e.value)
    cfg.parallel.cp_impl = "ulysses"  # Ulysses wraps the model's own core: accepted
    cfg.validate(2)
    cfg.model.attention = "flash"
    with pytest.raises(ConfigError, match="model.attention"):
        cfg.validate(2)
