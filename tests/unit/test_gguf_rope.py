"""GGUFs with RoPE scaling (Llama 3.1 / 3.2 as llama.cpp writes them: a ``rope_freqs`` tensor of
per-frequency divisors; linear as ``rope.scaling.type``), written here from a random transformers
LlamaForCausalLM the way llama.cpp's converter does (q / k rows interleaved per head, the divisors
from its rule, written out below): loaded by shardlab, the logits equal transformers'."""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from shardlab.errors import ConfigError  # noqa: E402
from shardlab.models.pretrained import load_model, open_source  # noqa: E402

HEADS, KV_HEADS, HIDDEN = 2, 1, 128  # head size 64: 32 frequencies, several of them on llama3's ramp
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256, "rope_theta": 500000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}


def _hf(rope):
    c = transformers.LlamaConfig(vocab_size=97, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=500000.0,
                                 max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 rope_scaling=rope)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(c).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.1)
    return model


def _llama_cpp_divisors(rope, head_dim):
    """llama.cpp's convert_hf_to_gguf for rope_type llama3: a divisor per frequency."""
    out = []
    orig, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                               rope["high_freq_factor"], rope["factor"])
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < orig / high:
            out.append(1.0)
        elif wavelength > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _interleave(w, heads):
    """HF's rotary halves -> GGUF's interleaved pairs (llama.cpp's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, hf, divisors=None, scaling=None):
    import numpy as np
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in {"vocab_size": c.vocab_size, "embedding_length": c.hidden_size, "block_count": c.num_hidden_layers,
                 "feed_forward_length": c.intermediate_size, "attention.head_count": HEADS,
                 "attention.head_count_kv": KV_HEADS, "context_length": 512}.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if scaling:
        w.add_string("llama.rope.scaling.type", scaling[0])
        if scaling[1] is not None:
            w.add_float32("llama.rope.scaling.factor", scaling[1])
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    names = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
             "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names.update({
            f"blk.{i}.attn_q.weight": _interleave(sd[p + "self_attn.q_proj.weight"], HEADS),
            f"blk.{i}.attn_k.weight": _interleave(sd[p + "self_attn.k_proj.weight"], KV_HEADS),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"]})
    if divisors is not None:
        names["rope_freqs.weight"] = torch.tensor(divisors, dtype=torch.float32)
    for name, t in names.items():
        w.add_tensor(name, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _load(path):
    src = open_source(str(path))
    src.tokenizer = lambda: None  # the file carries no vocabulary: the weights are what is checked
    model, cfg, _ = load_model(src)
    return model, cfg


def _logits_gap(ours, hf):
    x = torch.randint(0, 97, (2, 300), generator=torch.Generator().manual_seed(1))  # beyond the 256 pretrained
    with torch.no_grad():
        return (ours(x).float() - hf(x).logits.float()).abs().max().item()


def test_llama3_rope_freqs_read_back_and_logits_equal_transformers(tmp_path):
    from shardlab.models.llama.model import Rope
    hf = _hf(LLAMA3)
    divisors = _llama_cpp_divisors(LLAMA3, HIDDEN // HEADS)
    assert 2 <= sum(1 < d < 8 for d in divisors)  # on the ramp: the case being read back
    ours, cfg = _load(_write(tmp_path / "l31.gguf", hf, divisors))
    # original_len 8192 stands for llama.cpp's missing pretrained length: 8192 / 32 = 256 / 1
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq, cfg.rope_high_freq, cfg.rope_original_len) == \
        ("llama3", 8.0, 32.0, 128.0, 8192)
    assert _logits_gap(ours, hf) < 1e-4
    for m in ours.modules():
        if hasattr(m, "rope"):
            m.rope = Rope(500000.0)  # the scaling ignored: far off, so the check above can fail
    assert _logits_gap(ours, hf) > 1e-2


def test_linear_scaling_type_read(tmp_path):
    hf = _hf(LINEAR)
    ours, cfg = _load(_write(tmp_path / "lin.gguf", hf, scaling=("linear", 4.0)))
    assert (cfg.rope_scaling, cfg.rope_factor) == ("linear", 4.0)
    assert _logits_gap(ours, hf) < 1e-4


def test_all_ones_divisors_mean_no_scaling(tmp_path):
    hf = _hf(None)
    ours, cfg = _load(_write(tmp_path / "ones.gguf", hf, [1.0] * (HIDDEN // HEADS // 2)))
    assert cfg.rope_scaling == "none"
    assert _logits_gap(ours, hf) < 1e-4


@pytest.mark.parametrize("case", ["yarn", "not-llama3", "linear-no-factor"])
def test_unreadable_scaling_refused_by_name(tmp_path, case, capsys):
    from shardlab.cli import main
    hf = _hf(None)
    if case == "yarn":
        path = _write(tmp_path / "y.gguf", hf, scaling=("yarn", 4.0))
    elif case == "linear-no-factor":
        path = _write(tmp_path / "l.gguf", hf, scaling=("linear", None))
    else:  # a divisor per frequency, but not of the llama3 form: nothing to read it into
        path = _write(tmp_path / "odd.gguf", hf, [1.0 + 0.1 * (i % 3) for i in range(HIDDEN // HEADS // 2)])
    with pytest.raises(ConfigError, match={"yarn": "yarn", "not-llama3": "rope_freqs"}.get(case, "factor")):
        open_source(str(path))
    assert main(["generate", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
