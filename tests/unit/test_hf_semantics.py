"""Hugging Face config.json read as transformers 5 reads it, and written back whole (models/hf.py,
models/llama/hf.py, models/gpt2/hf.py), checked against transformers itself:

* RoPE: a non-empty ``rope_scaling`` replaces ``rope_parameters`` (``convert_rope_params_to_dict``),
  a top-level ``original_max_position_embeddings`` overrides the nested one and llama3 without
  either uses ``max_position_embeddings`` (``standardize_rope_params``): shardlab's logits equal
  transformers' on 60 positions of a model whose pretrained context is shorter (the RoPE choice
  moves the logits by ~8 when wrong).
* Import -> export keeps the source's generation_config.json fields (do_sample, temperature, ...)
  and every config.json field shardlab does not model, the dropout probabilities included:
  transformers reads the same config from the export as from the original."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardlab.cli import main as cli_main  # noqa: E402
from shardlab.errors import ConfigError  # noqa: E402
from shardlab.models.pretrained import load_model, open_source  # noqa: E402

L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# config.json RoPE keys (None: key removed) -> what transformers 5 computes with, written by hand
VARIANTS = {
    "rope_scaling_wins": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, ("linear", 10000.0, 4.0, None)),
    "rope_scaling_theta_from_top": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                                     "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 30000.0},
                                    ("linear", 30000.0, 2.0, None)),
    "empty_rope_scaling_ignored": ({"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 20000.0},
                                    "rope_scaling": {}}, ("linear", 20000.0, 3.0, None)),
    "llama3_no_original_len": ({"rope_parameters": {**L3, "rope_theta": 500000.0}}, ("llama3", 500000.0, 8.0, 64)),
    "llama3_toplevel_original_len": ({"rope_parameters": {**L3, "rope_theta": 500000.0,
                                                          "original_max_position_embeddings": 32},
                                      "original_max_position_embeddings": 8}, ("llama3", 500000.0, 8.0, 8)),
    "llama3_toplevel_over_rope_scaling": ({"rope_parameters": None, "rope_theta": 500000.0,
                                           "rope_scaling": {**L3, "original_max_position_embeddings": 32},
                                           "original_max_position_embeddings": 16}, ("llama3", 500000.0, 8.0, 16)),
    "toplevel_original_len_ignored_by_linear": ({"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                                     "rope_theta": 10000.0},
                                                 "original_max_position_embeddings": 8},
                                                ("linear", 10000.0, 4.0, None)),
}


def _randomise(model):
    torch.manual_seed(0)
    with torch.no_grad():  # HF inits norms to ones: randomise every tensor
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.1)
    return model


def _llama_dir(tmp_path, patch=None, name="hf", **kw):
    c = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, **kw)
    d = tmp_path / name
    _randomise(transformers.LlamaForCausalLM(c)).save_pretrained(d)
    if patch:
        conf = json.loads((d / "config.json").read_text())
        conf.update(patch)
        (d / "config.json").write_text(json.dumps({k: v for k, v in conf.items() if v is not None}))
    return d


def _hf_logits(d, x):
    m = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float64).eval()
    with torch.no_grad():
        return m(x).logits


@pytest.mark.parametrize("name", list(VARIANTS))
def test_rope_is_read_as_transformers_reads_it(tmp_path, name):
    patch, (kind, theta, factor, original) = VARIANTS[name]
    d = _llama_dir(tmp_path, patch)
    model, cfg, _ = load_model(str(d), dtype=torch.float64)
    assert (cfg.rope_scaling, cfg.rope_theta) == (kind, theta)
    assert cfg.rope_factor == factor
    if original is not None:
        assert cfg.rope_original_len == original
    x = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(x)
    # HF computes its inverse frequencies in float32 (theta 500000: ~4e-5 of logits ~10)
    assert (got - _hf_logits(d, x)).abs().max() < 1e-4


def test_unsupported_rope_is_refused_naming_the_key_transformers_reads(tmp_path):
    d = _llama_dir(tmp_path, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match=r"rope_scaling\.rope_type: 'dynamic' RoPE scaling is not supported"):
        open_source(str(d))
    d = _llama_dir(tmp_path, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5}}, name="partial")
    with pytest.raises(ConfigError, match=r"partial_rotary_factor: 0.5 is not supported"):
        open_source(str(d))


def _roundtrip(tmp_path, d):
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "ck")]) == 0
    out = tmp_path / "out"
    assert cli_main(["checkpoint", "export", str(tmp_path / "ck"), "--format", "hf", "--to", str(out)]) == 0
    return out


def _same_config(a, b):
    """transformers' reading of two directories' config.json, its version stamp aside."""
    ca, cb = (transformers.AutoConfig.from_pretrained(p, local_files_only=True).to_dict() for p in (a, b))
    for c in (ca, cb):
        c.pop("transformers_version", None), c.pop("_name_or_path", None)
    assert ca == cb


def test_llama_export_keeps_generation_config_and_unmodelled_fields(tmp_path):
    d = _llama_dir(tmp_path, rope_parameters={**L3, "rope_theta": 500000.0, "original_max_position_embeddings": 16},
                   bos_token_id=5, eos_token_id=7, pad_token_id=0, attention_dropout=0.25, initializer_range=0.05)
    gen = transformers.GenerationConfig(bos_token_id=5, eos_token_id=[7, 9], pad_token_id=0, do_sample=True,
                                        temperature=0.6, top_p=0.9, max_new_tokens=17, repetition_penalty=1.3)
    gen.save_pretrained(d)
    out = _roundtrip(tmp_path, d)
    back = transformers.GenerationConfig.from_pretrained(out, local_files_only=True)
    for k in ("do_sample", "temperature", "top_p", "max_new_tokens", "repetition_penalty", "bos_token_id",
              "eos_token_id", "pad_token_id"):
        assert getattr(back, k) == getattr(gen, k), k
    conf = json.loads((out / "config.json").read_text())
    assert (conf["attention_dropout"], conf["initializer_range"]) == (0.25, 0.05)
    _same_config(d, out)
    x = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_hf_logits(out, x), _hf_logits(d, x))


def test_gpt2_dropout_is_written_back_unchanged(tmp_path):
    """Import keeps model.dropout 0 (inference; a fine-tuning run sets its own); export writes
    the source's attn/resid/embd probabilities, not 0."""
    c = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.1,
                                resid_pdrop=0.2, embd_pdrop=0.3, bos_token_id=0, eos_token_id=0,
                                summary_first_dropout=0.4)
    d = tmp_path / "gpt2"
    _randomise(transformers.GPT2LMHeadModel(c)).save_pretrained(d)
    assert open_source(str(d)).cfg.dropout == 0.0
    out = _roundtrip(tmp_path, d)
    conf = json.loads((out / "config.json").read_text())
    assert (conf["attn_pdrop"], conf["resid_pdrop"], conf["embd_pdrop"], conf["summary_first_dropout"]) == \
        (0.1, 0.2, 0.3, 0.4)
    _same_config(d, out)


def test_a_source_config_of_another_model_type_is_not_merged():
    from shardlab.config import ModelConfig
    from shardlab.models.hf import arch_module, merged_config
    cfg = ModelConfig(arch="gpt2", vocab_size=96, d_model=32, n_layers=1, n_heads=4, n_kv_heads=0, max_seq_len=64,
                      dropout=0.1)
    plain = merged_config(arch_module("gpt2"), cfg, {"model_type": "llama", "attn_pdrop": 0.5, "foo": 1})
    assert plain["attn_pdrop"] == 0.1 and "foo" not in plain  # a model trained from scratch: its own dropout
    kept = merged_config(arch_module("gpt2"), cfg, {"model_type": "gpt2", "attn_pdrop": 0.5, "foo": 1,
                                                    "n_embd": 999, "dtype": "bfloat16"})
    assert (kept["attn_pdrop"], kept["foo"], kept["n_embd"]) == (0.5, 1, 32) and "dtype" not in kept
