"""Llama <-> Hugging Face ``LlamaForCausalLM`` (config.json and tensor names; shardlab/models/hf.py
does the reading and writing). HF rotates halves (x[i], x[i + d/2]), shardlab interleaved pairs
(x[2i], x[2i+1]): the q and k rows are permuted per head (``Source.rope_head_dim``)."""
from __future__ import annotations

from ...errors import ConfigError
from ..hf import Source

MODEL_TYPES = ("llama",)


def _refuse(key: str, why: str):
    raise ConfigError(f"config.json: {key}", why)


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
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        _refuse("rope_parameters.rope_type", f"{kind!r} RoPE scaling is not supported; only default RoPE")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {"vocab_size": int(hf["vocab_size"]), "d_model": d, "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": heads, "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "ffn_hidden": int(hf["intermediate_size"]), "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
            "rope_theta": float(theta), "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "dropout": 0.0}


def config_to_hf(cfg) -> dict:
    """config.json of ``cfg`` for ``LlamaForCausalLM``; ConfigError for MoE models (no HF Llama
    equivalent)."""
    if cfg.n_experts:
        raise ConfigError("model.n_experts", "a Mixture-of-Experts Llama has no Hugging Face Llama "
                                             "equivalent; export a dense model (n_experts = 0)")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def tensor_map(cfg) -> dict[str, Source]:
    """{shardlab parameter name: Source}; the tied head (``tie_embeddings``) is the embedding."""
    d, hd, V, F = cfg.d_model, cfg.head_dim, cfg.vocab_size, cfg.ffn_dim
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd

    def s(key, shape, rope=0):
        return Source(key, shape, shape, rope_head_dim=rope)
    out = {"tok_embeddings.weight": s("model.embed_tokens.weight", (V, d))}
    for i in range(cfg.n_layers):
        a, m, p = f"layers.{i}.attention", f"layers.{i}.feed_forward", f"model.layers.{i}"
        out.update({
            f"layers.{i}.attention_norm.weight": s(f"{p}.input_layernorm.weight", (d,)),
            f"{a}.wq.weight": s(f"{p}.self_attn.q_proj.weight", (q, d), hd),
            f"{a}.wk.weight": s(f"{p}.self_attn.k_proj.weight", (kv, d), hd),
            f"{a}.wv.weight": s(f"{p}.self_attn.v_proj.weight", (kv, d)),
            f"{a}.wo.weight": s(f"{p}.self_attn.o_proj.weight", (d, q)),
            f"layers.{i}.ffn_norm.weight": s(f"{p}.post_attention_layernorm.weight", (d,)),
            f"{m}.w1.weight": s(f"{p}.mlp.gate_proj.weight", (F, d)),
            f"{m}.w3.weight": s(f"{p}.mlp.up_proj.weight", (F, d)),
            f"{m}.w2.weight": s(f"{p}.mlp.down_proj.weight", (d, F)),
        })
    out["norm.weight"] = s("model.norm.weight", (d,))
    if not cfg.tie_embeddings:
        out["output.weight"] = s("lm_head.weight", (V, d))
    return out
