"""Llama <-> Hugging Face ``LlamaForCausalLM`` (config.json and tensor names; models/hf.py does the
reading and writing). HF rotates halves (x[i], x[i + d/2]), shardlab interleaved pairs
(x[2i], x[2i+1]): the q and k rows are permuted per head (``Source.rope_head_dim``)."""
from __future__ import annotations

import re

from ...errors import ConfigError
from ..hf import Source
from ..spec import ffn_dim

MODEL_TYPES = ("llama",)
BLOCK = {  # shardlab name under layers.<i> -> (HF name under model.layers.<i>, GGUF name under blk.<i>)
    "attention_norm.weight": ("input_layernorm.weight", "attn_norm.weight"),
    "attention.wq.weight": ("self_attn.q_proj.weight", "attn_q.weight"),
    "attention.wk.weight": ("self_attn.k_proj.weight", "attn_k.weight"),
    "attention.wv.weight": ("self_attn.v_proj.weight", "attn_v.weight"),
    "attention.wo.weight": ("self_attn.o_proj.weight", "attn_output.weight"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", "ffn_up.weight"),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", "ffn_down.weight"),
}
TOP = {"tok_embeddings.weight": ("model.embed_tokens.weight", "token_embd.weight"),
       "norm.weight": ("model.norm.weight", "output_norm.weight"), "output.weight": ("lm_head.weight", "output.weight")}
"""Llama's name table: Hugging Face's and GGUF's names of each shardlab parameter (gguf.py reads it)."""


ROPE_KEYS = {"default": {}, "linear": {"rope_factor": "factor"},
             "llama3": {"rope_factor": "factor", "rope_low_freq": "low_freq_factor",
                        "rope_high_freq": "high_freq_factor", "rope_original_len": "original_max_position_embeddings"}}
"""HF rope_type -> {ModelConfig field: HF rope_parameters key} of the RoPE kinds shardlab computes."""


def _rope_to_hf(cfg) -> dict:
    kind = "default" if cfg.rope_scaling == "none" else cfg.rope_scaling
    return {"rope_type": kind, **{key: getattr(cfg, name) for name, key in ROPE_KEYS[kind].items()}}


def _refuse(key: str, why: str):
    raise ConfigError(f"config.json: {key}", why)


def rope_parameters(hf: dict) -> dict:
    """The RoPE parameters transformers 5 computes with, from a Llama config.json, as its
    ``PreTrainedConfig.convert_rope_params_to_dict`` and ``standardize_rope_params``
    (modeling_rope_utils.py) derive them: a non-empty ``rope_scaling`` (4.x name) replaces
    ``rope_parameters`` whole; ``rope_theta`` inside wins over the top-level one (default 10000);
    ``rope_type`` defaults to ``type``, then ``default``; for llama3 (and yarn, longrope) a top-level
    ``original_max_position_embeddings`` overrides the nested one, and without either it is
    ``max_position_embeddings`` (its second standardisation, run when the model builds its rotary
    embedding, is the one that sees the top-level key)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        _refuse("rope_scaling" if hf.get("rope_scaling") else "rope_parameters",
                f"{params!r} is not a JSON object; re-save the model")
    params = dict(params)
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in hf:
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return params


DERIVED = ("rope_scaling", "rope_parameters", "rope_theta", "original_max_position_embeddings",
           "partial_rotary_factor")
"""config.json keys export writes from the model config alone (a source's are not carried over:
a stale top-level ``original_max_position_embeddings`` would override the exported RoPE)."""
SOURCE_WINS = ("attention_dropout",)
"""config.json keys export copies from the source's config.json when it has one (shardlab's Llama
has no dropout; docs/pretrained.md)."""


def config_from_hf(hf: dict) -> dict:
    """ModelConfig fields of an HF Llama config.json; refuses what shardlab's Llama does not compute."""
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("head_dim") not in (None, d // heads):
        _refuse("head_dim", f"{hf['head_dim']} != hidden_size / num_attention_heads = {d // heads}; "
                            "shardlab's Llama derives the head size")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", f"{hf['hidden_act']!r} is not supported; shardlab's Llama uses silu (SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            _refuse(flag, "biased projections are not supported by shardlab's Llama; use a bias-free model")
    rope = rope_parameters(hf)  # transformers' reading; attention_factor is unused by these three kinds
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    kind = rope["rope_type"]
    if kind not in ROPE_KEYS:
        _refuse(f"{where}.rope_type", f"{kind!r} RoPE scaling is not supported; shardlab's Llama computes "
                                      f"{', '.join(ROPE_KEYS)}")
    if rope.get("partial_rotary_factor") not in (None, 1, 1.0):
        _refuse(f"{where}.partial_rotary_factor", f"{rope['partial_rotary_factor']} is not supported; "
                                                  "shardlab's Llama rotates the whole head (1.0)")
    if rope["rope_theta"] is None:
        _refuse("rope_theta", "is null; give the RoPE base (e.g. 10000.0)")
    scaling = {"rope_scaling": "none" if kind == "default" else kind}
    for field_name, key in ROPE_KEYS[kind].items():
        if rope.get(key) is None:
            _refuse(f"{where}.{key}", f"{kind} RoPE needs it")
        scaling[field_name] = rope[key]
    return {**scaling, "vocab_size": int(hf["vocab_size"]), "d_model": d, "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": heads, "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "ffn_hidden": int(hf["intermediate_size"]), "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
            "rope_theta": float(rope["rope_theta"]), "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "dropout": 0.0}


def config_to_hf(cfg) -> dict:
    """config.json of ``cfg`` for ``LlamaForCausalLM``; ConfigError for MoE models (no HF Llama
    equivalent)."""
    if cfg.n_experts:
        raise ConfigError("model.n_experts", "a Mixture-of-Experts Llama has no Hugging Face Llama "
                                             "equivalent; export a dense model (n_experts = 0)")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": ffn_dim(cfg), "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_parameters": {**_rope_to_hf(cfg), "rope_theta": cfg.rope_theta},
            **({"rope_scaling": _rope_to_hf(cfg)} if cfg.rope_scaling != "none" else {}),  # transformers 4.x
            "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def tensor_map(cfg) -> dict[str, Source]:
    """{shardlab parameter name: Source}, in the model's order (shapes from the meta model; the tied
    head is the embedding, not listed)."""
    from ..spec import meta_model
    out = {}
    for name, p in meta_model(cfg).named_parameters():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        key = f"model.layers.{m[1]}.{BLOCK[m[2]][0]}" if m else TOP[name][0]
        rope = cfg.head_dim if name.endswith(("wq.weight", "wk.weight")) else 0
        out[name] = Source(key, tuple(p.shape), tuple(p.shape), rope_head_dim=rope)
    return out
