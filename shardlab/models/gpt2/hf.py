"""GPT-2 <-> Hugging Face ``GPT2LMHeadModel`` (config.json and tensor names; shardlab/models/hf.py
does the reading and writing). HF's Conv1D weights are (in, out): transposed; its fused
``c_attn`` (in, 3d) holds shardlab's c_q, c_k, c_v (``Source.split`` = 0, d, 2d)."""
from __future__ import annotations

from ...errors import ConfigError
from ..hf import Source
from ..spec import ffn_dim

MODEL_TYPES = ("gpt2",)
DERIVED = ()
"""config.json keys export writes from the model config alone (none beyond config_to_hf's)."""
SOURCE_WINS = ("attn_pdrop", "resid_pdrop", "embd_pdrop")
"""config.json keys export copies from the source's config.json when it has one: import keeps
``model.dropout`` 0 (docs/pretrained.md), so the source's probabilities are written back unchanged."""


def config_from_hf(hf: dict) -> dict:
    """ModelConfig fields of an HF GPT-2 config.json; refuses variants shardlab does not compute."""
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError("config.json: activation_function", f"{act!r} is not supported; shardlab's GPT-2 "
                                                               "uses the tanh GELU (gelu_new)")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(hf.get(key, ok)) != ok:
            raise ConfigError(f"config.json: {key}", f"must be {str(ok).lower()} for shardlab's GPT-2")
    return {"vocab_size": int(hf["vocab_size"]), "d_model": int(hf["n_embd"]), "n_layers": int(hf["n_layer"]),
            "n_heads": int(hf["n_head"]), "n_kv_heads": 0, "ffn_hidden": int(hf.get("n_inner") or 0),
            "max_seq_len": int(hf["n_positions"]), "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)), "dropout": 0.0}


def config_to_hf(cfg) -> dict:
    """config.json of ``cfg`` for ``GPT2LMHeadModel``."""
    p = cfg.dropout
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_hidden or None, "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new", "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p,
            "scale_attn_weights": True, "tie_word_embeddings": bool(cfg.tie_embeddings),
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def tensor_map(cfg) -> dict[str, Source]:
    """{shardlab parameter name: Source}; the tied head (``tie_embeddings``) is ``wte``."""
    d, V, F = cfg.d_model, cfg.vocab_size, ffn_dim(cfg)

    def s(key, shape):
        return Source(key, shape, shape)

    def conv(key, shape, hf_shape, split=0):
        return Source(key, shape, hf_shape, transpose=len(shape) == 2, split=split)
    out = {"wte.weight": s("transformer.wte.weight", (V, d)), "wpe.weight": s("transformer.wpe.weight",
                                                                              (cfg.max_seq_len, d))}
    for i in range(cfg.n_layers):
        p, L = f"transformer.h.{i}", f"layers.{i}"
        for ln in ("ln_1", "ln_2"):
            out[f"{L}.{ln}.weight"] = s(f"{p}.{ln}.weight", (d,))
            out[f"{L}.{ln}.bias"] = s(f"{p}.{ln}.bias", (d,))
        for j, name in enumerate(("c_q", "c_k", "c_v")):
            out[f"{L}.attn.{name}.weight"] = conv(f"{p}.attn.c_attn.weight", (d, d), (d, 3 * d), j * d)
            out[f"{L}.attn.{name}.bias"] = conv(f"{p}.attn.c_attn.bias", (d,), (3 * d,), j * d)
        out[f"{L}.attn.c_proj.weight"] = conv(f"{p}.attn.c_proj.weight", (d, d), (d, d))
        out[f"{L}.attn.c_proj.bias"] = s(f"{p}.attn.c_proj.bias", (d,))
        out[f"{L}.mlp.c_fc.weight"] = conv(f"{p}.mlp.c_fc.weight", (F, d), (d, F))
        out[f"{L}.mlp.c_fc.bias"] = s(f"{p}.mlp.c_fc.bias", (F,))
        out[f"{L}.mlp.c_proj.weight"] = conv(f"{p}.mlp.c_proj.weight", (d, F), (F, d))
        out[f"{L}.mlp.c_proj.bias"] = s(f"{p}.mlp.c_proj.bias", (d,))
    out["ln_f.weight"] = s("transformer.ln_f.weight", (d,))
    out["ln_f.bias"] = s("transformer.ln_f.bias", (d,))
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = s("lm_head.weight", (V, d))
    return out
