"""Tokenizers of pretrained sources: a GGUF's (``tokenizer.ggml.*``: byte-level BPE, control tokens
matched whole, its chat template), a Hugging Face directory's ``tokenizer.json``, and bytes
(docs/pretrained.md). Nothing downloads. ``encode(text, add_special_tokens=True)`` adds what the
source's own tokenizer adds to a prompt: an HF directory's ``tokenizer.json`` post-processor (what
transformers 5's ``tokenizer(text)`` applies), llama.cpp's add_bos / add_eos for a GGUF; the default
(False) adds nothing, as training data and chat-template text are encoded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError

CONTROL = 3  # llama.cpp's token type of control (special) tokens


@dataclass
class GGUFTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids and chat template the GGUF names."""

    tokenizer: object
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None = None
    stop_ids: set = field(default_factory=set)
    add_bos: bool = False
    """A GGUF's: prepend bos when special tokens are added (llama.cpp's rule, :func:`gguf_adds`)."""
    add_eos: bool = False
    """A GGUF's: append eos when special tokens are added."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: as the source's tokenizer does to a prompt
        (an HF tokenizer.json's post-processor, a GGUF's add_bos / add_eos)."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special_tokens and self.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def chat(self, user: str, system: str | None = None) -> str:
        """The prompt of one user turn followed by the assistant's turn (ChatML, the template of
        SmolLM2-Instruct and most im_start/im_end models; its default system line when the
        template has one)."""
        if not self.chat_template or "<|im_start|>" not in self.chat_template:
            raise ConfigError("--chat", "the source has no ChatML chat template (an HF directory's chat_template.jinja "
                                        "or tokenizer_config.json chat_template, a GGUF's tokenizer.chat_template); "
                                        "drop --chat and write the prompt in the model's format")
        if system is None:
            system = _default_system(self.chat_template)
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _default_system(template: str) -> str | None:
    """The system message a ChatML template inserts when the conversation has none."""
    start = template.find("<|im_start|>system\n")
    if start < 0:
        return None
    end = template.find("<|im_end|>", start)
    return template[start + len("<|im_start|>system\n"):end] if end > 0 else None


def from_gguf_reader(r) -> GGUFTokenizer:
    """Build the tokenizer of an open ``gguf.GGUFReader``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    def get(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError("source", f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only)")
    tokens = get("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
    types = get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):  # digits split one by one first
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre) if len(pre) > 1 else pre[0]
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    tok.add_special_tokens(special)
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    stop = {int(eos)} if eos is not None else set()
    if "<|im_end|>" in vocab:
        stop.add(vocab["<|im_end|>"])
    add_bos, add_eos = gguf_adds(get("tokenizer.ggml.pre"), get("tokenizer.ggml.add_bos_token"),
                                 get("tokenizer.ggml.add_eos_token"))
    return GGUFTokenizer(tok, None if bos is None else int(bos), None if eos is None else int(eos),
                         get("tokenizer.chat_template"), stop, add_bos, add_eos)


LLAMA_CPP_BOS_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "tekken", "chameleon")
"""``tokenizer.ggml.pre`` values for which llama.cpp adds bos to a BPE vocabulary by default."""


def gguf_adds(pre, add_bos, add_eos) -> tuple[bool, bool]:
    """(add bos, add eos) of a byte-level BPE GGUF, as llama.cpp's vocabulary loader decides
    (its per-vocabulary defaults): ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` when the file has
    them, else bos for the pre-tokenizers of :data:`LLAMA_CPP_BOS_PRE` only, never eos."""
    return (bool(add_bos) if add_bos is not None else pre in LLAMA_CPP_BOS_PRE,
            bool(add_eos) if add_eos is not None else False)


def from_hf_dir(hf_dir) -> GGUFTokenizer:
    """The tokenizer of a Hugging Face directory: ``tokenizer.json`` (any ``tokenizers`` model; its
    post-processor adds the prompt's special tokens, as transformers 5 does: it ignores
    tokenizer_config.json's add_bos_token when tokenizer.json exists), the bos/eos tokens of
    ``tokenizer_config.json`` (or ``special_tokens_map.json``) and the chat template
    (:func:`hf_chat_template`)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from .hf import read_json
    d = Path(hf_dir)
    try:
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception on a damaged file
        raise ConfigError("source", f"{d / 'tokenizer.json'}: not a readable tokenizer ({e})") from None
    conf, legacy = read_json(d / "tokenizer_config.json"), read_json(d / "special_tokens_map.json")

    def token_id(name):
        entry = conf.get(name, legacy.get(name))
        text = entry.get("content") if isinstance(entry, dict) else entry
        return tok.token_to_id(text) if isinstance(text, str) else None

    bos, eos = token_id("bos_token"), token_id("eos_token")
    stop = {eos} if eos is not None else set()
    if tok.token_to_id("<|im_end|>") is not None:
        stop.add(tok.token_to_id("<|im_end|>"))
    return GGUFTokenizer(tok, bos, eos, hf_chat_template(d, conf), stop)


def hf_chat_template(d, conf: dict) -> str | None:
    """The default chat template of an HF directory, where transformers 5 looks: ``chat_template.jinja``
    (it wins), else tokenizer_config.json's ``chat_template`` (a string, or a list of named ones:
    ``default``)."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = conf.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class ByteTokenizer:
    """The tokenizer of a byte-level run (``data.tokenizer = bytes``): token = one UTF-8 byte,
    vocabulary 256, no special tokens (no bos/eos: generation stops at --max-new-tokens)."""

    bos_id = eos_id = chat_template = None
    stop_ids: set = set()
    tokenizer = None  # no tokenizers.Tokenizer behind it (export writes byte_level_tokenizer())

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens to add

    def decode(self, ids, skip_special: bool = True) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def chat(self, user: str, system: str | None = None) -> str:
        raise ConfigError("--chat", "a byte-level model has no chat template; drop --chat")


def byte_codepoints() -> list[str]:
    """The printable character standing for each byte in byte-level BPE vocabularies (GPT-2's
    table, which ``tokenizers``' ByteLevel pre-tokenizer and decoder use): printable Latin-1 bytes
    stand for themselves, the other 68 for the code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, extra = {b: chr(b) for b in keep}, 256
    for b in range(256):
        if b not in out:
            out[b], extra = chr(extra), extra + 1
    return [out[b] for b in range(256)]


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` that encodes as :class:`ByteTokenizer` does (token id = UTF-8
    byte) for a byte-level run's Hugging Face export, so ``AutoTokenizer`` and ``shardlab
    generate`` load the exported directory: a BPE model without merges over the 256 byte
    characters, ByteLevel pre-tokenizer (no prefix space, no regex split) and decoder. None without
    the ``tokenizers`` package (``pip install 'shardlab[hf]'``)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return None
    vocab = {ch: b for b, ch in enumerate(byte_codepoints())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok
