"""``shardlab checkpoint inspect|verify|export|import DIR [--to PATH] [--format safetensors|hf] [--force]``.

DIR is one checkpoint (``.../step_00000100``) or a checkpoint directory (the newest valid one
is used). ``inspect`` reads only index.json and the shard headers; ``verify`` reads every piece
and checks its crc32; ``export`` writes the ``model.*`` tensors as one safetensors file, one
tensor (in slices of at most ``--chunk-mib``) at a time, never the whole model in memory.
``export --format hf --to OUT_DIR`` writes a Hugging Face directory (model.safetensors +
config.json) instead; ``--merge-lora`` folds LoRA adapters into their weights (an adapter-only
checkpoint reads its base for the rest). ``import SOURCE --to CKPT_DIR`` writes a one-rank
checkpoint ``CKPT_DIR/step_00000000`` of the model.* tensors of any pretrained source (an HF
directory, a .gguf file, ``smollm2``; no optimizer state, streamed one tensor at a time) that
``shardlab train --resume`` loads under any layout (models/pretrained.py, docs/pretrained.md); from
an HF directory it also keeps that directory's config, generation config and tokenizer files in
``step_00000000/hf``, which ``export --format hf`` writes back (docs/checkpoints.md).
A damaged checkpoint is refused with the file named (exit 2). Docs: docs/checkpoints.md.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..config import ConfigError
from ..checkpoint import save as ckpt
from ..checkpoint.format import SafetensorsWriter, volume


def _resolve(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise ConfigError("DIR", f"{p} does not exist; pass a step_XXXXXXXX directory or a checkpoint directory")
    if (p / "index.json").exists() or p.name.startswith(ckpt.PREFIX):
        return p
    from ..checkpoint.tags import load_root
    p = load_root(p, None)  # saved with a tag (the engine's save_checkpoint): the one `latest` names
    skipped: list[str] = []
    found = ckpt.latest_valid(p, warn=skipped.append)
    if found is None:
        why = f" (newest: {skipped[0].split(': ', 2)[-1]})" if skipped else ""
        raise ConfigError("DIR", f"no valid checkpoint in {p}{why}; pass a step_XXXXXXXX directory or the "
                                 "checkpoint directory of a run (logging.run_dir/checkpoints)")
    for line in skipped:
        print(line, file=sys.stderr)
    return found


CHUNK_MIB = 64.0
"""``--chunk-mib``'s default: MiB per slice an export reads and writes."""


def configure(parser):
    parser.add_argument("action", choices=["inspect", "verify", "export", "import"])
    parser.add_argument("dir", help="a checkpoint (step_XXXXXXXX) or a directory of checkpoints; "
                                    "import: a pretrained source (HF directory, .gguf file, smollm2)")
    parser.add_argument("--to", default=None, help="export: output .safetensors path (consolidated weights), or "
                                                   "the output directory with --format hf; import: the "
                                                   "checkpoint directory to create")
    parser.add_argument("--format", default="safetensors", choices=["safetensors", "hf"],
                        help="export: one safetensors file of shardlab names, or a Hugging Face directory")
    parser.add_argument("--force", action="store_true", help="export: overwrite an existing output file")
    parser.add_argument("--merge-lora", action="store_true",
                        help="export: fold LoRA adapters into their weights (W + alpha/r B A); required to "
                             "export a LoRA checkpoint in Hugging Face format")
    parser.add_argument("--chunk-mib", type=float, default=CHUNK_MIB,
                        help="export: read and write each tensor in slices of at most this many MiB")


def _inspect(reader: ckpt.Reader) -> None:
    meta = reader.meta
    print(f"checkpoint {reader.path}")
    print(f"  step {reader.step}   world size {reader.world_size}   layout {meta.get('layout', '?')}"
          + (f"   engine {meta['engine']}" if "engine" in meta else ""))
    others = {k: v for k, v in meta.items() if k not in ("layout", "engine", "config")}
    if others:
        print(f"  meta {json.dumps(others, sort_keys=True)}"[:200])
    width = max((len(k) for k in reader.keys()), default=10)
    print(f"  {'tensor':<{width}} {'shape':<20} {'dtype':<9} pieces")
    for key in reader.keys():
        print(f"  {key:<{width}} {str(reader.global_shape(key)):<20} "
              f"{str(reader.dtype(key)).replace('torch.', ''):<9} {len(reader.pieces(key))}")
    for r in reader.rank_files():
        extra = ", ".join(r["extra"]) or "-"
        print(f"  rank {r['rank']:>5}  {r['file']}  {r['size'] / 2**20:10.3f} MiB   extra: {extra}")
    print(f"  total {reader.nbytes() / 2**20:.3f} MiB in {len(reader.rank_files())} files")


def _export(reader: ckpt.Reader, out: Path, chunk_bytes: int) -> tuple[int, int]:
    """Stream the model.* tensors into ``out`` (written under a temporary name, then renamed)."""
    keys = [k for k in reader.keys() if k.startswith("model.")]
    if not keys:
        raise ckpt.CheckpointError(f"{reader.path}: no model.* tensors to export")
    specs = [(k[len("model."):], reader.dtype(k), reader.global_shape(k)) for k in keys]
    tmp = out.with_name(f".{out.name}.part")
    writer = SafetensorsWriter(tmp, specs, {"source": str(reader.path), "step": reader.step}, progress="export")
    try:
        for key, (name, dtype, shape) in zip(keys, specs):
            if not shape:
                writer.write(name, reader.read(key))
                continue
            row = volume(shape[1:]) * torch.empty((), dtype=dtype).element_size()
            rows = max(1, chunk_bytes // max(row, 1))
            starts = range(0, shape[0], rows) if shape[0] else [0]
            for start in starts:
                n = min(rows, shape[0] - start)
                writer.write(name, reader.read(key, (start,) + (0,) * (len(shape) - 1), (n,) + shape[1:]),
                             last=start + n >= shape[0])
        writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return len(specs), sum(volume(s) for _, _, s in specs)


def _import(source: str, out: Path) -> tuple[Path, object]:
    """Stream a pretrained source into a one-rank checkpoint ``out/step_00000000``."""
    from ..models.hf import model_config_dict
    from ..models.pretrained import open_source
    src = open_source(source)
    reader = src.reader()
    pieces = []
    for key in reader.keys():
        if key.startswith("optim."):  # a shardlab checkpoint's optimizer state: an import holds weights only
            continue
        shape = reader.global_shape(key)
        pieces.append(ckpt.Piece(key, shape, (0,) * len(shape),
                                 ckpt.Deferred(shape, reader.dtype(key), lambda k=key: reader.read(k))))
    staging = ckpt.prepare(out, 0)
    ckpt.write_rank(staging, 0, pieces, {}, progress="import")
    meta = {"layout": "imported", "world_size": 1, "source": src.ref(),
            "config": {"model": model_config_dict(src.cfg)}}
    if src.kind == "gguf" or (src.path / "tokenizer.json").exists():
        meta["tokenizer_source"] = src.ref()
    if src.kind == "hf":  # its config, generation config and tokenizer files, kept for generate and export
        from ..models.hf import copy_hf_files
        from ..models.pretrained import HF_COPY
        copy_hf_files(src.path, staging / HF_COPY)
    meta["special_tokens"] = src.special_tokens()  # bos/eos/pad and stop ids, kept for export
    path = ckpt.commit(out, 0, 1, meta)
    reader.close()
    return path, src.cfg


def _hf_source(src, warn: list) -> tuple[dict, Path | None]:
    """The source model's ``{"config", "generation"}`` (its config.json and generation_config.json)
    and the directory of its tokenizer files, followed from the checkpoint ``src`` (models/pretrained.py
    ``hf_origin``); an origin that is gone adds a line to ``warn`` and counts as none."""
    from ..models.hf import read_json
    found = []
    for tokenizer in (False, True):
        try:
            found.append(src.hf_origin(tokenizer))
        except ConfigError as e:
            line = f"its source is gone ({e.detail.split('; ')[0]})"
            if line not in warn:
                warn.append(line)
            found.append(None)
    config_dir, tok_dir = found
    source = {"config": read_json(config_dir / "config.json"),
              "generation": read_json(config_dir / "generation_config.json")} if config_dir else {}
    return source, tok_dir


def _export_tokenizer(src, out: Path, tok_dir: Path | None) -> bool:
    """The checkpoint's tokenizer files in ``out``, so ``AutoTokenizer`` loads the exported directory:
    those of the HF directory it came from, byte for byte (``tok_dir``: chat_template.jinja, pad /
    unk tokens, padding side, model_max_length and extra special tokens included), else
    tokenizer.json + tokenizer_config.json of ``src``'s tokenizer (a GGUF's, with llama.cpp's add_bos
    as the post-processor; bytes as a BPE without merges over the 256 byte characters); False if none."""
    from ..models.hf import TOKENIZER_FILES, copy_hf_files
    from ..models.tokenizer import ByteTokenizer, byte_level_tokenizer
    if tok_dir is not None:
        return bool(copy_hf_files(tok_dir, out, TOKENIZER_FILES))
    tok = src.tokenizer(missing_ok=True)
    backend = byte_level_tokenizer() if isinstance(tok, ByteTokenizer) else getattr(tok, "tokenizer", None)
    if backend is None:
        return False
    if getattr(tok, "add_bos", False) or getattr(tok, "add_eos", False):
        backend = _with_adds(backend, tok)
    backend.save(str(out / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
        if i is not None:
            conf[name] = backend.id_to_token(i)
    if tok.chat_template:
        conf["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return True


def _with_adds(backend, tok):
    """A copy of ``backend`` whose post-processor adds the GGUF's bos / eos, as transformers 5 reads
    them (from tokenizer.json, not tokenizer_config.json's add_bos_token)."""
    from tokenizers import Tokenizer, processors
    parts, ends = ["$A:0"], []
    for on, i, at in ((tok.add_bos, tok.bos_id, 0), (tok.add_eos, tok.eos_id, 1)):
        if on and i is not None:
            parts.insert(at * len(parts), f"{backend.id_to_token(i)}:0")
            ends.append((backend.id_to_token(i), i))
    copy = Tokenizer.from_str(backend.to_str())
    try:
        copy.post_processor = processors.TemplateProcessing(single=" ".join(parts), special_tokens=ends)
    except ValueError:  # a token text the template syntax cannot hold (a ':' or a space in it)
        return backend
    return copy


def _open(args):
    """The checkpoint to export: over its base when adapter-only, adapters folded with --merge-lora."""
    from ..models.pretrained import merged_reader, with_base
    try:
        reader = with_base(ckpt.Reader(_resolve(args.dir)))
    except ckpt.CheckpointError as e:
        raise ConfigError("DIR", f"refused: {e}") from None
    return merged_reader(reader) if args.merge_lora else reader


def _refuse_unused(args) -> None:
    """A flag the action would ignore is refused, naming it (inspect and verify only read)."""
    for flag, given, actions in (("--to", args.to is not None, ("export", "import")),
                                 ("--force", args.force, ("export", "import")),
                                 ("--format", args.format != "safetensors", ("export",)),
                                 ("--merge-lora", args.merge_lora, ("export",)),
                                 ("--chunk-mib", args.chunk_mib != CHUNK_MIB, ("export",))):
        if given and args.action not in actions:
            raise ConfigError(flag, f"applies to {' and '.join(actions)}, not to {args.action}; drop it")


def _not_inside(out: Path, source: Path) -> None:
    """An export written into the checkpoint it reads (``--to CKPT/rank_00000.safetensors --force``)
    destroyed that checkpoint's own shard."""
    if out.resolve().is_relative_to(Path(source).resolve()):
        raise ConfigError("--to", f"{out} is inside the checkpoint {source} being exported; write it elsewhere")


def main(args) -> int:
    _refuse_unused(args)
    out = Path(args.to) if args.to else None
    if args.action == "import":
        if out is None:
            raise ConfigError("--to", "import needs a checkpoint directory, e.g. --to runs/ft/checkpoints")
        if ckpt.list_checkpoints(out) and not args.force:  # resume would pick the newest, not the import
            raise ConfigError("--to", f"{out} already holds checkpoints; import into an empty directory, or "
                                      "pass --force to add step_00000000 anyway")
        from ..errors import writable_dir
        writable_dir(out, "--to")  # a file there used to end the import in a traceback
        path, _ = _import(args.dir, out)
        print(f"wrote {path} ({len(ckpt.Reader(path).keys())} tensors); fine-tune it with "
              f"--checkpoint.base={out} (the model section comes from it; docs/finetune.md)")
        return 0
    if args.action == "export" and args.format == "hf":
        if out is None:
            raise ConfigError("--to", "export --format hf needs an output directory, e.g. --to hf_model")
        if out.is_dir() and any(out.iterdir()) and not args.force:  # its config.json, tokenizer files, ...
            raise ConfigError("--to", f"{out} is not empty; export into a new directory, or pass --force to "
                                      "overwrite the files of the same names")
        if out.exists() and not out.is_dir():
            raise ConfigError("--to", f"{out} is a file; --format hf writes a directory")
        from ..models.hf import export_hf
        from ..models.pretrained import checkpoint_model_config
        reader = _open(args)
        _not_inside(out, reader.path)
        if any(k.endswith(".lora_A") for k in reader.keys()):
            raise ConfigError("--merge-lora", f"{reader.path} holds LoRA adapters, which a Hugging Face "
                                              "model cannot hold; pass --merge-lora to fold them into the weights")
        from ..models.pretrained import open_source
        src = open_source(str(reader.path))  # opened once: its tokenizer is built once, for all below
        special = src.special_tokens()  # its meta's, its base's or its tokenizer's
        warn: list[str] = []
        source, tok_dir = _hf_source(src, warn)
        n, numel = export_hf(reader, checkpoint_model_config(reader), out, special=special, source=source)
        tok = _export_tokenizer(src, out, tok_dir)
        if warn:
            print(f"warning: {reader.path}: {'; '.join(warn)}: wrote the weights and config.json without the "
                  f"source's other config fields{'' if tok else ' and tokenizer files'}", file=sys.stderr)
        print(f"wrote {n} tensors ({numel:,} parameters) from {reader.path} to {out} (Hugging Face format"
              f"{', with its tokenizer' if tok else ''})")
        return 0
    if args.action == "export":
        if out is None:
            raise ConfigError("--to", "export needs an output path, e.g. --to model.safetensors")
        if out.exists() and not args.force and not out.is_dir():
            raise ConfigError("--to", f"{out} exists; pass --force to overwrite it")
        from ..errors import output_file
        output_file(out, "--to", ".safetensors")  # a safetensors file named .pt or .bin misleads torch.load
        if args.chunk_mib <= 0:
            raise ConfigError("--chunk-mib", "must be > 0, e.g. --chunk-mib 64")
    try:
        reader = _open(args) if args.action == "export" else ckpt.Reader(_resolve(args.dir))
        if args.action == "inspect":
            _inspect(reader)
        elif args.action == "verify":
            n = reader.verify_all()
            print(f"ok: {reader.path}: {n} tensors in {len(reader.rank_files())} files, all crc32 match, "
                  f"every key fully covered")
        else:
            _not_inside(out, reader.path)
            out.parent.mkdir(parents=True, exist_ok=True)
            n, numel = _export(reader, out, int(args.chunk_mib * 2**20))
            print(f"wrote {n} tensors ({numel:,} parameters) from {reader.path} to {out}")
    except ckpt.CheckpointError as e:
        raise ConfigError("DIR", f"refused: {e}") from None
    except OSError as e:
        raise ConfigError("--to" if args.action == "export" else "DIR",
                          f"{e.filename or args.dir}: {e.strerror or e}") from None
    return 0
