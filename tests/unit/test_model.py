"""Llama model: shapes, GQA/tied variants, layout-independent init, FLOPs formula."""
import math

import torch
import torch.nn.functional as F

from shardlab.config import ModelConfig
from shardlab.models import build_model, count_params, init_tensor
from shardlab.models.llama.model import Llama, Rope, rotary
from shardlab.models.llama import matmul_params_per_token
from shardlab.train.metrics import flops_per_token

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def test_forward_shapes_and_loss():
    m = build_model(CFG, seed=0, dtype=torch.float64)
    x = torch.randint(0, 64, (3, 16))
    logits = m(x)
    assert logits.shape == (3, 16, 64)
    loss = m(x, x)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 64), x.reshape(-1)))
    assert abs(loss.item() - math.log(64)) < 0.5  # near-uniform at init


def test_init_depends_only_on_seed_and_name():
    a, b = build_model(CFG, seed=7), build_model(CFG, seed=7)
    c = build_model(CFG, seed=8)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb)
        if "norm" not in n:
            assert not torch.equal(pa, pc)
    # slicing the global tensor = what a shard would materialise from init_tensor
    full = init_tensor("layers.0.feed_forward.w1.weight", a.layers["0"].feed_forward.w1.weight.shape, CFG, 7)
    assert torch.equal(full, a.layers["0"].feed_forward.w1.weight)
    assert torch.equal(full[:8], init_tensor("layers.0.feed_forward.w1.weight", full.shape, CFG, 7)[:8])


def test_init_is_independent_of_construction_order():
    """Building on meta then materialising by name equals materialising a real module by name."""
    torch.manual_seed(123)
    real = Llama(CFG)  # default torch init, then overwritten by name
    from shardlab.models import init_weights
    init_weights(real, CFG, 7)
    meta = build_model(CFG, seed=7)
    for (n, p), (_, q) in zip(real.named_parameters(), meta.named_parameters()):
        assert torch.equal(p, q), n


def test_tied_embeddings_and_gqa():
    tied = build_model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}), seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert count_params(tied) == count_params(build_model(CFG, 0)) - 64 * 32
    m = build_model(CFG, 0)
    assert m.layers["0"].attention.wk.weight.shape == (2 * 8, 32)


def test_rotary_is_a_rotation_with_relative_positions():
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    pos = torch.arange(5)
    r = rotary(x, pos, Rope(10000.0))
    assert torch.allclose(r.norm(dim=-1), x.norm(dim=-1))
    # dot products depend only on the position difference
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    def rot(v, p):
        return rotary(v.view(1, 1, 1, 8), torch.tensor([p]), Rope(10000.0)).flatten()
    assert torch.allclose(rot(q, 3) @ rot(k, 1), rot(q, 7) @ rot(k, 5))


def test_flops_formula():
    cfg = ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024, ffn_hidden=3072)
    n = matmul_params_per_token(cfg)
    assert n == 12 * (4 * 768 * 768 + 3 * 768 * 3072) + 768 * 50304
    assert flops_per_token(cfg, 1024) == 6 * n + 12 * 12 * 768 * 1024


def test_output_head_padding_keeps_values_and_gradients():
    """On CUDA the head pads a vocabulary that is not a multiple of 64 rows (aligned logits rows
    for cuBLAS); forced here on CPU: the logits are a view of 100 of 128 padded columns, and loss
    and every gradient equal the unpadded head's (fp64). Both architectures use the head."""
    from shardlab.models.decoder import OutputHead
    for arch, cfg in (("llama", CFG), ("gpt2", ModelConfig(arch="gpt2", vocab_size=100, d_model=32, n_layers=2,
                                                           n_heads=4, max_seq_len=16))):
        cfg = ModelConfig(**{**cfg.__dict__, "vocab_size": 100})
        m = build_model(cfg, seed=0, dtype=torch.float64)
        head = m.output if arch == "llama" else m.lm_head
        assert isinstance(head, OutputHead)
        x = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(1))
        runs = []
        for pad in ((), ("cpu",)):
            head.pad_devices = pad
            m.zero_grad()
            logits = m(x)
            loss = m(x, x)
            loss.backward()
            runs.append((logits, loss, [p.grad.clone() for p in m.parameters()]))
        (l0, loss0, g0), (l1, loss1, g1) = runs
        assert l1.shape == (3, 16, 100) and l1.stride(-2) == 128 and l0.stride(-2) == 100, arch
        assert torch.allclose(l0, l1, rtol=0, atol=1e-12) and abs(loss0.item() - loss1.item()) < 1e-12, arch
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(g0, g1)), arch
