"""An HF directory's tokenizer as transformers 5 uses it (models/tokenizer.py, commands/generate_cmd.py,
commands/checkpoint_cmd.py), checked against transformers itself on a tokenizer saved by
``save_pretrained`` (a post-processor that adds BOS, chat_template.jinja, pad / unk tokens, left
padding, model_max_length, extra special tokens):

* ``shardlab generate HF_DIR`` encodes the prompt as ``tokenizer(prompt)`` does (BOS added) and
  continues it as ``model.generate`` does; ``--chat`` finds chat_template.jinja and encodes as
  ``apply_chat_template`` does (no BOS added to the template's text).
* import -> export copies the tokenizer files byte for byte: AutoTokenizer reads the same settings;
  the HF directory may be deleted after import; a checkpoint whose recorded tokenizer source is
  gone still exports its weights and config, with one warning line."""
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402

from shardlab.cli import main as cli_main  # noqa: E402
from shardlab.models.tokenizer import from_hf_dir  # noqa: E402

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<|im_start|>": 4, "<|im_end|>": 5,
         **{w: 6 + i for i, w in enumerate("hello world the a cat dog user assistant system".split())}}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _hf_dir(tmp_path, bos_post=True, name="hf"):
    bt = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    bt.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos_post:  # as Llama 2 / 3 tokenizers: the post-processor adds BOS
        bt.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", 1)])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bt, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=64, padding_side="left", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = TEMPLATE
    c = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(c)
    with torch.no_grad():  # norms near 1, weights large enough for a varied greedy continuation
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    d = tmp_path / name
    model.save_pretrained(d)
    tok.save_pretrained(d)
    assert (d / "chat_template.jinja").exists() and "chat_template" not in json.loads(
        (d / "tokenizer_config.json").read_text())  # transformers 5's layout
    return d


def _auto(d):
    return transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)


@pytest.mark.parametrize("bos_post", [True, False])
def test_prompt_and_chat_encoding_equal_transformers(tmp_path, bos_post):
    d = _hf_dir(tmp_path, bos_post)
    ours, theirs = from_hf_dir(d), _auto(d)
    for text in ("hello world the cat", "dog", "<|im_start|>user hello"):
        assert ours.encode(text, add_special_tokens=True) == theirs(text).input_ids
        assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids
    assert ours.encode("cat", add_special_tokens=True)[0] == (1 if bos_post else VOCAB["cat"])
    chat = theirs.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                      tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert ours.chat_template == TEMPLATE
    assert ours.encode(ours.chat("hello world")) == list(chat)


def test_generate_continues_as_transformers_generate(tmp_path, capsys):
    d = _hf_dir(tmp_path)
    tok = _auto(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    ids = tok("hello world the cat", return_tensors="pt").input_ids
    assert ids[0, 0] == 1
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=[2, 5], pad_token_id=3)
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    with torch.no_grad():  # without the BOS transformers' tokenizer adds, the continuation differs
        plain = model.generate(ids[:, 1:], do_sample=False, max_new_tokens=6, eos_token_id=[2, 5], pad_token_id=3)
    assert tok.decode(plain[0, ids.shape[1] - 1:], skip_special_tokens=True) != want
    assert cli_main(["generate", str(d), "--prompt", "hello world the cat", "--max-new-tokens", "6",
                     "--temperature", "0", "--threads", "1"]) == 0
    got = capsys.readouterr()
    assert got.out.rstrip("\n") == want and want.strip()
    assert f"[5 prompt tokens, {out.shape[1] - 5} new" in got.err  # BOS + 4 words; stops where transformers does
    assert cli_main(["generate", str(d), "--chat", "--prompt", "hello", "--max-new-tokens", "2", "--quiet"]) == 0


def test_tokenizer_files_survive_import_export_and_a_deleted_source(tmp_path, capsys):
    d = _hf_dir(tmp_path)
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "ck")]) == 0
    kept = {f.name: f.read_bytes() for f in d.iterdir() if f.name != "model.safetensors"}
    shutil.rmtree(d)  # "import, then delete the download"
    out = tmp_path / "out"
    assert cli_main(["checkpoint", "export", str(tmp_path / "ck"), "--format", "hf", "--to", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == kept[name], name
    a, b = json.loads(kept["generation_config.json"]), json.loads((out / "generation_config.json").read_text())
    assert b.pop("eos_token_id") == [2, 5] and a.pop("eos_token_id") == 2  # eos + <|im_end|>: every stop id
    assert {k: v for k, v in b.items() if k in a} == a
    tok = _auto(out)
    assert (tok.pad_token, tok.unk_token, tok.padding_side, tok.model_max_length) == ("<pad>", "<unk>", "left", 64)
    assert {"<|im_start|>", "<|im_end|>"} <= set(tok.all_special_tokens)
    assert tok("hello world").input_ids == [1, 6, 7]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # the imported checkpoint generates with the tokenizer it keeps (its HF directory is gone)
    assert cli_main(["generate", str(tmp_path / "ck"), "--chat", "--prompt", "hello", "--max-new-tokens", "2",
                     "--quiet"]) == 0


def test_a_checkpoint_whose_tokenizer_source_is_gone_still_exports(tmp_path, capsys):
    """A checkpoint imported before the tokenizer was kept (no hf/ folder, only the recorded path),
    its HF directory since moved: the weights and config.json are written, one warning line."""
    from shardlab.models.pretrained import HF_COPY
    d = _hf_dir(tmp_path)
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "ck")]) == 0
    shutil.rmtree(tmp_path / "ck" / "step_00000000" / HF_COPY)
    d.rename(tmp_path / "moved")
    capsys.readouterr()
    out = tmp_path / "out"
    assert cli_main(["checkpoint", "export", str(tmp_path / "ck"), "--format", "hf", "--to", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if "warning" in line]) == 1 and str(d) in err[-1], err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    back = json.loads((out / "config.json").read_text())
    assert (back["bos_token_id"], back["eos_token_id"], back["pad_token_id"]) == (1, 2, 3)  # kept in the meta
    assert transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True) is not None
    # generate names what is missing in one line (exit 2)
    assert cli_main(["generate", str(tmp_path / "ck"), "--prompt", "hello"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
