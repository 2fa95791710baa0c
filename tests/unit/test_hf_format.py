"""Hugging Face format both ways (models/hf.py), checked against transformers itself: a tiny
random LlamaForCausalLM (grouped-query attention, rope_theta 500000, tied and untied) and
GPT2LMHeadModel saved with save_pretrained; imported into shardlab, the logits equal
transformers' logits; a shardlab checkpoint exported with ``shardlab checkpoint export --format
hf`` loads with AutoModelForCausalLM.from_pretrained and gives the same logits; the round trip
HF -> shardlab checkpoint -> HF is bit-equal, tensor by tensor."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from shardlab.cli import main as cli_main  # noqa: E402
from shardlab.models import build_model  # noqa: E402
from shardlab.models.hf import HFReader  # noqa: E402
from shardlab.models.pretrained import load_model as _load  # noqa: E402


def load_model(d):
    model, cfg, _ = _load(str(d))
    return model, cfg
from shardlab.checkpoint import save as ckpt  # noqa: E402

TOL = 1e-5  # float32 (the bar of the issue); transformers and shardlab order some reductions differently


def _llama(tie: bool, rope_scaling=None):
    c = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                 tie_word_embeddings=tie, max_position_embeddings=64, rms_norm_eps=1e-5,
                                 **({"rope_scaling": rope_scaling} if rope_scaling else {}))
    return transformers.LlamaForCausalLM(c)


# Llama 3.1's scaling with a pretrained context of 256 positions and head size 8 (theta 500000): the
# four frequencies' wavelengths (6.3, 167, 4.4e3, 1.2e5) fall in all three of its regimes: kept
# (below 256 / 4), on the ramp, divided by the factor (beyond 256 / 1)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0}


def _gpt2(tie: bool = True):
    c = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=tie,
                                bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(c)


MODELS = {"llama": lambda: _llama(False), "llama-tied": lambda: _llama(True), "gpt2": _gpt2,
          "gpt2-untied": lambda: _gpt2(False), "llama-rope-llama3": lambda: _llama(False, LLAMA3_ROPE),
          "llama-rope-linear": lambda: _llama(False, {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0})}


def _save(name, tmp_path):
    torch.manual_seed(0)
    hf = MODELS[name]().eval()
    with torch.no_grad():  # HF inits norms to ones and biases to zeros: randomise every tensor
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.1)
    d = tmp_path / "hf"
    hf.save_pretrained(d)
    return hf, d


def _tokens(seed=1):
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("name", list(MODELS))
def test_import_logits_equal_transformers(tmp_path, name):
    hf, d = _save(name, tmp_path)
    ours, cfg = load_model(d)
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings
    x = _tokens()
    with torch.no_grad():
        got = ours(x)
    assert (got - _hf_logits(hf, x)).abs().max() <= TOL


def test_permutation_is_not_identity(tmp_path):
    """The q/k row permutation matters: read without it, the logits differ from transformers'."""
    import dataclasses

    from shardlab.models import hf as H
    hf, d = _save("llama", tmp_path)
    ours, _ = load_model(d)
    reader = HFReader(d)
    reader.map = {k: dataclasses.replace(s, rope_head_dim=0) for k, s in reader.map.items()}
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(reader.read(f"model.{n}"))
        x = _tokens()
        assert (ours(x) - _hf_logits(hf, x)).abs().max() > 100 * TOL
    assert H.rope_rows(torch.arange(8), 8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_rope_scaling_is_read_and_matters(tmp_path):
    """Llama 3.1's RoPE scaling (it used to be refused): read into model.rope_*, and the logits with
    it ignored are far from transformers'; the frequencies against the three regimes by hand."""
    import math

    from shardlab.models.llama.model import Rope, inv_frequencies
    hf, d = _save("llama-rope-llama3", tmp_path)
    ours, cfg = load_model(d)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq, cfg.rope_high_freq, cfg.rope_original_len) == \
        ("llama3", 8.0, 1.0, 4.0, 256)
    x = _tokens()
    plain, _ = load_model(d)
    for m in plain.modules():
        if hasattr(m, "rope"):
            m.rope = Rope(500000.0)  # the scaling ignored
    with torch.no_grad():
        assert (plain(x) - _hf_logits(hf, x)).abs().max() > 100 * TOL
    base = [500000.0 ** (-i / 8) for i in (0, 2, 4, 6)]
    ramp = (256 / (2 * math.pi / base[1]) - 1) / (4 - 1)
    assert 0 < ramp < 1
    want = [base[0], (1 - ramp) * base[1] / 8 + ramp * base[1], base[2] / 8, base[3] / 8]
    assert torch.allclose(inv_frequencies(Rope.of(cfg), 8), torch.tensor(want, dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2", "llama-rope-llama3", "llama-rope-linear"])
def test_import_export_round_trip_via_cli(tmp_path, name):
    """HF -> ``checkpoint import`` -> ``checkpoint export --format hf`` -> from_pretrained: logits equal
    the original's, every tensor bit-equal to the saved one."""
    hf, d = _save(name, tmp_path)
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "ck")]) == 0
    step = tmp_path / "ck" / "step_00000000"
    r = ckpt.Reader(step)
    assert not [k for k in r.keys() if not k.startswith("model.")]  # model tensors only
    assert cli_main(["checkpoint", "export", str(step), "--format", "hf", "--to", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    x = _tokens(2)
    assert torch.equal(_hf_logits(back, x), _hf_logits(hf, x))
    with safe_open(d / "model.safetensors", "pt") as a, safe_open(tmp_path / "out" / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_of_a_shardlab_checkpoint_loads_in_transformers(tmp_path, arch):
    """A model shardlab initialised (a trained one would be the same), saved as a sharded
    checkpoint by two 'ranks' (row halves), exported: transformers' logits equal shardlab's."""
    from shardlab.config import ModelConfig
    from shardlab.models.hf import model_config_dict
    cfg = ModelConfig(arch=arch, vocab_size=96, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2 if arch == "llama" else 0, max_seq_len=64, rope_theta=500000.0, init_std=0.1)
    model = build_model(cfg, seed=3)
    staging = ckpt.prepare(tmp_path / "ck", 5)
    for rank in range(2):
        pieces = []
        for n, p in model.named_parameters():
            h = (p.shape[0] + 1) // 2
            lo, hi = (0, h) if rank == 0 else (h, p.shape[0])
            pieces.append(ckpt.Piece(f"model.{n}", tuple(p.shape), (lo,) + (0,) * (p.dim() - 1), p.detach()[lo:hi]))
        ckpt.write_rank(staging, rank, pieces, {})
    ckpt.commit(tmp_path / "ck", 5, 2, {"config": {"model": model_config_dict(cfg)}})
    assert cli_main(["checkpoint", "export", str(tmp_path / "ck"), "--format", "hf", "--to", str(tmp_path / "o")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", local_files_only=True).eval()
    x = _tokens(3)
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() <= TOL


def test_sharded_hf_checkpoint_and_slices(tmp_path):
    """model.safetensors.index.json shards are read; a box read equals the slice of the whole tensor."""
    hf, _ = _save("llama", tmp_path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    whole, sharded = HFReader(tmp_path / "hf"), HFReader(tmp_path / "sharded")
    for key in whole.keys():
        full = whole.read(key)
        assert torch.equal(sharded.read(key), full)
        if full.dim() == 2:
            assert torch.equal(whole.read(key, (8, 3), (8, 5)), full[8:16, 3:8])


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "none").mkdir()
    assert cli_main(["checkpoint", "import", str(tmp_path / "none"), "--to", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no config.json" in err and len(err.splitlines()) == 1
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert cli_main(["checkpoint", "import", str(tmp_path / "bert"), "--to", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert "model_type" in err and "'bert' is not supported" in err and len(err.splitlines()) == 1
    (tmp_path / "w.safetensors").write_bytes(b"")  # `checkpoint export`'s weights file: no config in it
    assert cli_main(["generate", str(tmp_path / "w.safetensors"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds weights without their model config" in err and "--format hf" in err and len(err.splitlines()) == 1


def test_import_refuses_a_directory_with_checkpoints(tmp_path, capsys):
    _, d = _save("gpt2", tmp_path)
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "ck")]) == 0
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "ck")]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
