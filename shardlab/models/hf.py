"""Hugging Face format both ways, for every architecture whose ModelSpec has an ``hf`` adapter
(``MODEL_TYPES``, ``config_from_hf``, ``config_to_hf``, ``tensor_map(cfg) -> {shardlab name:
Source}``). Here, naming no architecture: :class:`HFReader`, the checkpoint reader interface over
an HF directory (each read takes only the safetensors slice covering its box), and
:func:`export_hf`. Docs: docs/pretrained.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from .spec import get_spec, specs

_ST_TORCH = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class Source:
    """Where one shardlab tensor lives in an HF checkpoint."""

    hf_key: str
    """Tensor name in the HF safetensors files."""
    shape: tuple
    """The shardlab (global) shape."""
    hf_shape: tuple
    """The shape of the whole HF tensor (a fused tensor holds several shardlab tensors)."""
    transpose: bool = False
    """The HF tensor is (in, out) (GPT-2's Conv1D), shardlab's is (out, in)."""
    split: int = 0
    """Offset of this tensor's dim-0 (output) rows inside the HF tensor's output dimension."""
    rope_head_dim: int = 0
    """> 0: rows are rotary heads of this size, HF halves order -> shardlab interleaved pairs."""


def _by_model_type() -> dict:
    """config.json ``model_type`` -> the ModelSpec whose ``hf`` adapter reads it."""
    return {t: sp for sp in specs().values() if sp.hf is not None for t in sp.hf.MODEL_TYPES}


def arch_module(arch: str):
    """The ``hf`` adapter of ``arch``; ConfigError when the architecture has none."""
    mod = get_spec(arch).hf
    if mod is None:
        raise ConfigError("model.arch", f"{arch!r} has no Hugging Face mapping; supported: "
                                        f"{', '.join(sorted(n for n, sp in specs().items() if sp.hf))}")
    return mod


def read_hf_config(hf_dir) -> dict:
    """config.json of ``hf_dir`` as a dict; ConfigError naming the file when missing or damaged."""
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ConfigError("HF_DIR", f"{path}: missing; pass a directory written by save_pretrained "
                                    "(config.json + model.safetensors)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("HF_DIR", f"{path}: not valid JSON ({e}); re-save the model") from None


def model_config_from_hf(hf: dict):
    """The ModelConfig of an HF config dict; ConfigError for an unsupported ``model_type``."""
    from ..config import ModelConfig
    mt, found = hf.get("model_type"), _by_model_type()
    if mt not in found:
        raise ConfigError("config.json: model_type", f"{mt!r} is not supported; supported: "
                                                     f"{', '.join(sorted(found))}")
    return ModelConfig(**{"arch": found[mt].name, **found[mt].hf.config_from_hf(hf)})


def rope_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF row of each shardlab row of a rotary projection: within a head, shardlab's pair element
    (2i + p) is HF's (p * head_dim/2 + i) (the llama.cpp permute, inverted)."""
    h, j = rows // head_dim, rows % head_dim
    return h * head_dim + (j % 2) * (head_dim // 2) + j // 2


def _hf_rows(s: Source, rows: torch.Tensor) -> torch.Tensor:
    return (rope_rows(rows, s.rope_head_dim) if s.rope_head_dim else rows) + s.split


class HFReader:
    """Read shardlab tensors ``model.<name>`` (boxes of them) from an HF checkpoint directory."""

    def __init__(self, hf_dir, cfg=None):
        self.path = Path(hf_dir)
        self.hf_config = read_hf_config(self.path)
        self.cfg = cfg if cfg is not None else model_config_from_hf(self.hf_config)
        self.map = arch_module(self.cfg.arch).tensor_map(self.cfg)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            try:
                self.files = {k: self.path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError("HF_DIR", f"{index}: damaged ({e}); re-save the model") from None
        elif single.exists():
            from safetensors import safe_open
            with safe_open(single, "pt") as fh:
                self.files = {k: single for k in fh.keys()}
        else:
            raise ConfigError("HF_DIR", f"{self.path}: no model.safetensors or model.safetensors.index.json; "
                                        "save with save_pretrained(safe_serialization=True)")
        for name, s in self.map.items():
            if s.hf_key not in self.files:
                raise ConfigError("HF_DIR", f"{self.path}: tensor {s.hf_key} (for {name}) missing; "
                                            "is config.json from the same model?")
        self._open: dict[Path, object] = {}

    def _slice(self, hf_key: str):
        f = self.files[hf_key]
        if f not in self._open:
            from safetensors import safe_open
            self._open[f] = safe_open(f, "pt")
        return self._open[f].get_slice(hf_key)

    def _source(self, key: str) -> Source:
        name = key[len("model."):] if key.startswith("model.") else None
        if name not in self.map:
            raise RuntimeError(f"{self.path}: no tensor {key} in this Hugging Face checkpoint")
        return self.map[name]

    def keys(self) -> list[str]:
        return [f"model.{n}" for n in self.map]

    def has(self, key: str) -> bool:
        return key.startswith("model.") and key[len("model."):] in self.map

    def global_shape(self, key: str) -> tuple:
        return tuple(self._source(key).shape)

    def dtype(self, key: str) -> torch.dtype:
        return _ST_TORCH[self._slice(self._source(key).hf_key).get_dtype()]

    def read(self, key: str, offsets=None, sizes=None, dtype=None) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of shardlab tensor ``key``; reads only the span of
        the HF tensor that holds it."""
        s = self._source(key)
        shape = tuple(s.shape)
        offsets = (0,) * len(shape) if offsets is None else tuple(int(o) for o in offsets)
        sizes = tuple(g - o for g, o in zip(shape, offsets)) if sizes is None else tuple(int(n) for n in sizes)
        sl = self._slice(s.hf_key)
        if tuple(sl.get_shape()) != tuple(s.hf_shape):
            raise ConfigError("HF_DIR", f"{self.files[s.hf_key]}: {s.hf_key} has shape {tuple(sl.get_shape())}, "
                                        f"config.json implies {tuple(s.hf_shape)}; re-save the model")
        idx = [torch.arange(o, o + n) for o, n in zip(offsets, sizes)]
        if idx:
            idx[0] = _hf_rows(s, idx[0])
        hf_idx = idx[::-1] if s.transpose else idx
        if any(len(i) == 0 for i in hf_idx):
            t = torch.empty([len(i) for i in hf_idx], dtype=self.dtype(key))
        else:
            spans = tuple(slice(int(i.min()), int(i.max()) + 1) for i in hf_idx)
            t = sl[spans] if spans else sl[:]
            for d, (i, sp) in enumerate(zip(hf_idx, spans)):
                if len(i) != sp.stop - sp.start or bool((i[1:] < i[:-1]).any()):
                    t = t.index_select(d, i - sp.start)
        if s.transpose:
            t = t.t()
        t = t.contiguous()
        return t if dtype is None else t.to(dtype)

    def close(self) -> None:
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt")
"""The tokenizer files transformers reads from a model directory (and ``additional_chat_templates/``)."""
SOURCE_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES
"""What ``checkpoint import`` copies from an HF directory into the checkpoint (docs/checkpoints.md)."""


def copy_hf_files(src_dir, out_dir, names=SOURCE_FILES) -> list[str]:
    """Copy the files of ``names`` (and ``additional_chat_templates/*.jinja``) that ``src_dir``
    holds into ``out_dir``, byte for byte; the names copied."""
    import shutil
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            done.append(name)
    extra = src / "additional_chat_templates"
    if "chat_template.jinja" in names and extra.is_dir():
        (out / extra.name).mkdir(exist_ok=True)
        for f in sorted(extra.glob("*.jinja")):
            shutil.copyfile(f, out / extra.name / f.name)
            done.append(f"{extra.name}/{f.name}")
    return done


def read_json(path) -> dict:
    """A JSON object file as a dict; {} when missing or not a JSON object."""
    try:
        out = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return out if isinstance(out, dict) else {}


def merged_config(mod, cfg, source: dict | None) -> dict:
    """config.json of ``cfg``: the source's config.json (same ``model_type``) with every field
    shardlab derives replaced by ``mod.config_to_hf(cfg)``, except ``mod.SOURCE_WINS`` (dropout),
    kept from the source; the fields shardlab does not model (initializer_range, use_cache,
    task_specific_params, ...) are written back unchanged."""
    hf_cfg = mod.config_to_hf(cfg)  # refuses what HF cannot express before writing anything
    if not source or source.get("model_type") not in mod.MODEL_TYPES:
        return hf_cfg
    drop = set(getattr(mod, "DERIVED", ())) | {"dtype", "torch_dtype", "_name_or_path"}
    out = {**{k: v for k, v in source.items() if k not in drop}, **hf_cfg}
    out.update({k: source[k] for k in getattr(mod, "SOURCE_WINS", ()) if k in source})
    return out


def export_hf(reader, cfg, out_dir, dtype: torch.dtype | None = None, special: dict | None = None,
              source: dict | None = None) -> tuple[int, int]:
    """Write ``out_dir/model.safetensors``, ``config.json`` and ``generation_config.json`` from
    ``reader`` (tensors ``model.<name>``), one HF tensor in memory at a time. ``special``: the
    source's ids (``Pretrained.special_tokens``; generation's eos = every stop id, docs/pretrained.md).
    ``source``: ``{"config": ..., "generation": ...}``, the source model's config.json and
    generation_config.json (:func:`merged_config`; generation fields such as do_sample,
    temperature, top_p are kept, the ids replaced). Returns (tensors, parameters)."""
    from ..checkpoint.format import SafetensorsWriter, volume
    mod = arch_module(cfg.arch)
    source = source or {}
    hf_cfg = merged_config(mod, cfg, source.get("config"))
    special = special or {}
    ids = {k: special.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    hf_cfg.update(ids)
    stops = list(special.get("stop_ids") or [])
    gen = {**(source.get("generation") or {}), **{k: v for k, v in ids.items() if v is not None}}
    if stops:
        gen["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    groups: dict[str, list[tuple[str, Source]]] = {}
    for name, s in mod.tensor_map(cfg).items():
        groups.setdefault(s.hf_key, []).append((name, s))
    def _dtype(key):
        return reader.dtype(key) if hasattr(reader, "dtype") else reader.read(key).dtype
    dt = {k: dtype or _dtype(f"model.{v[0][0]}") for k, v in groups.items()}
    layout = [(k, dt[k], tuple(v[0][1].hf_shape)) for k, v in groups.items()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".model.safetensors.part"
    writer = SafetensorsWriter(tmp, layout, {"format": "pt"}, progress="export")
    try:
        for hf_key, members in groups.items():
            full = torch.empty(members[0][1].hf_shape, dtype=dt[hf_key])
            for name, s in members:
                value = reader.read(f"model.{name}").to(dt[hf_key])
                target = full.t() if s.transpose else full
                target.index_copy_(0, _hf_rows(s, torch.arange(s.shape[0])), value)
            writer.write(hf_key, full)
        writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out / "model.safetensors")
    hf_cfg["torch_dtype"] = str(next(iter(dt.values()), torch.float32)).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return len(layout), sum(volume(s[2]) for s in layout)


def model_config_dict(cfg) -> dict:
    """A ModelConfig as a plain dict (checkpoint meta)."""
    return dataclasses.asdict(cfg)

