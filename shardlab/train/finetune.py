"""Fine-tuning from pretrained weights (``checkpoint.base``), resolved once before any rank
starts: the model section from the base (a conflicting model field refused in one line), the
corpus tokenised with the base's tokenizer (``data.tokenizer``), :func:`base_reader` loaded on
every rank instead of initial values, adapter-only checkpoints of a LoRA run (:func:`adapter_only`).
Docs: docs/finetune.md."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from ..config import Config, ConfigError, ModelConfig
from ..models.lora import is_adapter


def load_resolved(path, overrides, nproc: int | None) -> Config:
    """A config as ``shardlab train --nproc nproc`` runs it, for the commands that describe a run
    (``config show``, ``memory``): loaded with its overrides, the model section from
    ``checkpoint.base`` (:func:`resolve_base`), degrees not given spread over the ranks, validated."""
    from .. import config as C
    from . import checks  # noqa: F401  (registers every config check validate runs)
    cfg = C.load(path, overrides, nproc)
    resolve_base(cfg)
    return C.spread_over(cfg, nproc).validate(world_size=nproc)


def resolve_base(cfg: Config):
    """Apply ``checkpoint.base`` to ``cfg.model``; return the opened source (or None)."""
    if not cfg.checkpoint.base:
        if cfg.data.tokenizer == "base":
            raise ConfigError("data.tokenizer", "'base' needs checkpoint.base (a pretrained model); "
                                                "use bytes, or set checkpoint.base")
        return None
    from ..models.pretrained import open_source
    try:
        src = open_source(cfg.checkpoint.base)
    except ConfigError as e:
        raise ConfigError("checkpoint.base", str(e).split(": ", 2)[-1]) from None
    default = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        if f.name == "dropout":
            continue
        mine, theirs = getattr(cfg.model, f.name), getattr(src.cfg, f.name)
        if mine != getattr(default, f.name) and mine != theirs:
            raise ConfigError(f"model.{f.name}", f"= {mine!r} disagrees with checkpoint.base ({theirs!r}); "
                                                 "drop it: the model comes from the base")
    cfg.model = dataclasses.replace(src.cfg, dropout=cfg.model.dropout)
    return src


def prepare_tokens(cfg: Config, src) -> Path:
    """Tokenise the corpus with the tokenizer ``data.tokenizer`` picks; the prepared directory."""
    from . import data
    choice = cfg.data.tokenizer
    if choice not in ("auto", "base", "bytes"):
        raise ConfigError("data.tokenizer", f"{choice!r} is not one of auto, base, bytes")
    tok = src.tokenizer() if src is not None and choice != "bytes" else None
    if tok is None:
        if choice == "base":
            raise ConfigError("data.tokenizer", f"checkpoint.base {cfg.checkpoint.base!r} has no tokenizer; "
                                                "use bytes")
        if cfg.model.vocab_size < 256:
            raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} < 256 byte-level tokens")
        return data.prepare(cfg.data)
    n = data.vocab_size(tok)
    if n > cfg.model.vocab_size:
        raise ConfigError("data.tokenizer", f"the base's tokenizer has {n} ids but the model only "
                                            f"{cfg.model.vocab_size} rows; use bytes")
    return data.prepare(cfg.data, tok, src.ref())


def base_reader(cfg: Config):
    """The reader of ``checkpoint.base`` (opened on this rank: it reads only its own boxes)."""
    from ..models.pretrained import open_source
    return open_source(cfg.checkpoint.base).reader()


def adapter_only(cfg: Config) -> bool:
    """Checkpoints of this run hold the adapters only (a LoRA run on a base)."""
    return bool(cfg.checkpoint.base and cfg.train.lora_rank)


def drop_frozen(pieces):
    """The pieces an adapter-only checkpoint writes: adapters and their optimizer state."""
    return [p for p in pieces if not p.key.startswith("model.") or is_adapter(p.key)]


@functools.lru_cache(maxsize=4)
def _ref(source: str) -> dict:
    """The record of a base, opened once per process (not at every save: a GGUF's metadata takes
    seconds to parse)."""
    from ..models.pretrained import open_source
    return open_source(source).ref()


@functools.lru_cache(maxsize=4)
def _special(source: str) -> dict:
    """The base's bos/eos/pad and stop ids (models/pretrained.py), read once per process."""
    from ..models.pretrained import open_source
    return open_source(source).special_tokens()


def checkpoint_meta(cfg: Config, data_meta: dict) -> dict:
    """What a checkpoint of a fine-tuning run adds to its meta: ``base`` (adapter-only: where the
    frozen weights are), ``base_source`` (provenance), ``special_tokens`` (the base's bos/eos/pad
    ids, for export) and ``tokenizer_source``."""
    if not cfg.checkpoint.base:
        return {}
    ref = dict(_ref(cfg.checkpoint.base))  # a copy: the cached record is never handed out
    out = {"base_source": ref, "special_tokens": dict(_special(cfg.checkpoint.base))}
    if adapter_only(cfg):
        out["base"] = ref
    if isinstance(data_meta.get("tokenizer"), dict):
        out["tokenizer_source"] = data_meta["tokenizer"]
    return out
