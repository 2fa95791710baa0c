"""GPT-2 model: the forward equals an independent functional GPT-2 written from the paper's
equations, the 124M config has GPT-2's 124,439,808 parameters, init by name, tied head,
learned positions, pipeline-stage forward, config checks."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardlab import config as C
from shardlab.config import ModelConfig
from shardlab.models import build_model, count_params, get_spec, init_tensor, meta_model

CFG = ModelConfig(arch="gpt2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


def functional_gpt2(sd: dict, cfg, tokens, positions):
    """GPT-2 from its equations, reading the state dict: no module of shardlab runs."""
    def ln(x, p):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + cfg.norm_eps) * sd[p + ".weight"] + sd[p + ".bias"]

    def lin(x, p, bias=True):
        return x @ sd[p + ".weight"].T + (sd[p + ".bias"] if bias else 0)

    def gelu(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    b, s = tokens.shape
    nh, hd = cfg.n_heads, cfg.d_model // cfg.n_heads
    h = sd["wte.weight"][tokens] + sd["wpe.weight"][positions]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        x = ln(h, p + "ln_1")
        q, k, v = (lin(x, p + "attn." + n).view(b, s, nh, hd).transpose(1, 2) for n in ("c_q", "c_k", "c_v"))
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + lin((att @ v).transpose(1, 2).reshape(b, s, -1), p + "attn.c_proj")
        h = h + lin(gelu(lin(ln(h, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    w_out = sd.get("lm_head.weight", sd["wte.weight"])
    return ln(h, "ln_f") @ w_out.T


def _perturbed(m):
    """Biases and norm parameters are 0/1 at init; randomise them so the comparison sees them."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.mark.parametrize("tie", [False, True])
def test_forward_equals_functional_gpt2(tie):
    cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": tie})
    m = _perturbed(build_model(cfg, seed=0, dtype=torch.float64))
    x = torch.randint(0, 64, (3, 16))
    logits = m(x)
    assert logits.shape == (3, 16, 64)
    want = functional_gpt2({k: v.detach() for k, v in m.state_dict().items()}, cfg, x, torch.arange(16))
    assert (logits - want).abs().max() < 1e-10
    loss = m(x, x)
    assert torch.allclose(loss, F.cross_entropy(want.reshape(-1, 64), x.reshape(-1)))


def test_positions_select_rows_of_wpe():
    m = build_model(CFG, seed=0, dtype=torch.float64)
    x = torch.randint(0, 64, (2, 8))
    shifted = m(x, positions=torch.arange(5, 13))
    with torch.no_grad():
        m.wpe.weight[:8] = m.wpe.weight[5:13].clone()
    assert (m(x) - shifted).abs().max() < 1e-12
    assert not torch.allclose(m(x, positions=torch.arange(1, 9)), shifted)


def test_pipeline_stage_forward_takes_and_returns_hidden_states():
    m = build_model(CFG, seed=0, dtype=torch.float64)
    x = torch.randint(0, 64, (2, 16))
    full = m(x)
    first = build_model(CFG, seed=0, dtype=torch.float64)
    first.ln_f = first.lm_head = None
    del first.layers["1"]
    last = build_model(CFG, seed=0, dtype=torch.float64)
    last.wte = last.wpe = None
    del last.layers["0"]
    h = first(x)
    assert h.shape == (2, 16, 32)
    assert (last(h) - full).abs().max() < 1e-12


def test_124m_config_has_gpt2_parameter_count():
    cfg = C.load("configs/gpt2-124m.toml").validate(1)
    assert cfg.model.arch == "gpt2"
    m = meta_model(cfg.model)
    assert count_params(m) == 124_439_808        # GPT-2 small as released (tied head)
    assert m.lm_head.weight is m.wte.weight
    # the FLOPs count uses every matmul weight (head included) once, plus attention
    matmul = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, nn.Linear))
    assert get_spec("gpt2").flops_per_token(cfg.model, 1024) == 6 * matmul + 12 * 12 * 768 * 1024


def test_tied_head_shares_the_embedding():
    tied = build_model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}), seed=0)
    untied = build_model(CFG, seed=0)
    assert tied.lm_head.weight is tied.wte.weight and tied.lm_head.bias is None
    assert count_params(untied) - count_params(tied) == 64 * 32


def test_init_by_name_is_layout_independent():
    cfg = ModelConfig(**{**CFG.__dict__, "d_model": 128, "n_layers": 6})
    a, b, c = build_model(cfg, seed=7), build_model(cfg, seed=7), build_model(cfg, seed=8)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), n
        if n.endswith(".bias"):
            assert not pa.any(), n                     # biases (LayerNorm's too) are zeros
        elif ".ln_" in f".{n}":
            assert torch.equal(pa, torch.ones_like(pa)), n
        else:
            assert not torch.equal(pa, pc), n
    name = "layers.3.mlp.c_fc.weight"
    full = a.get_parameter(name).detach()
    box = init_tensor(name, full.shape, cfg, 7, offsets=(128, 0), sizes=(64, 128))
    assert torch.equal(box, full[128:192])
    # residual projections scaled by 1/sqrt(2 L); other matrices init_std
    std = lambda n: a.get_parameter(n).std().item()  # noqa: E731
    assert abs(std("layers.2.mlp.c_proj.weight") - 0.02 / math.sqrt(12)) < 5e-4
    assert abs(std("layers.2.attn.c_proj.weight") - 0.02 / math.sqrt(12)) < 5e-4
    assert abs(std("layers.2.attn.c_q.weight") - 0.02) < 1e-3


def test_config_checks_name_the_field():
    cfg = C.Config()
    cfg.model = ModelConfig(**{**CFG.__dict__, "n_kv_heads": 2})
    with pytest.raises(C.ConfigError, match="model.n_kv_heads"):
        cfg.validate(1)
    cfg.model.n_kv_heads = 4
    cfg.train.seq_len = 16
    cfg.validate(1)
    cfg.model.n_heads, cfg.model.n_kv_heads = 5, 0
    with pytest.raises(C.ConfigError, match="model.n_heads"):
        cfg.validate(1)
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.n_experts = 4, 0, 4
    with pytest.raises(C.ConfigError, match="model.n_experts"):
        cfg.validate(1)


def test_verify_layouts_per_architecture(capsys):
    from shardlab.analysis import verify
    from shardlab.cli import main as cli_main
    names = verify.layouts("gpt2")
    assert "ep2" not in names and {"tp2-sp", "pp2-1f1b", "cp2", "fsdp", "dp2-tp2-pp2"} <= set(names)
    assert "ep2" in verify.layouts("llama")
    cfg = verify.layout_config("pp2-1f1b", 2, arch="gpt2")
    assert cfg.model.arch == "gpt2" and not cfg.model.tie_embeddings and cfg.model.kv_heads == cfg.model.n_heads
    assert verify.layout_config("tp2", 2, arch="gpt2").model.tie_embeddings
    assert cli_main(["verify", "--arch", "gpt2", "--layouts", "ep2"]) == 2
    assert "unknown layout 'ep2' for --arch gpt2" in capsys.readouterr().err
