"""Image classification data (``task = "classify"``): Fashion-MNIST from its IDX files (the Debian
package ``dataset-fashion-mnist``; nothing is downloaded), the data-parallel image loader (sampled
as train/data.py's Loader: a seeded per-epoch permutation, a cursor that resumes exactly) and the
accuracy evaluation. Docs: docs/cnn.md."""
from __future__ import annotations

import gzip
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
SPLITS = {"fashion-mnist": (60_000, 10_000, 28 * 28)}
"""Images in the training and test splits, and pixels per image (uint8), of each dataset."""
DATASETS = tuple(SPLITS)
EVAL_BATCH = 500
"""Test images per forward of the evaluation pass (:func:`accuracy`)."""
MEAN, STD = 0.2860, 0.3530
"""Fashion-MNIST's training-set pixel mean and std (pixels scaled to [0, 1])."""
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
          "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def resident_bytes(data_cfg) -> int:
    """What :class:`ImageData` holds in memory on every rank: both splits' images (uint8) and
    labels (int64), ``data.limit_train`` / ``limit_test`` applied; from the datasets' sizes, no file
    read (``shardlab memory`` prices it before any rank starts)."""
    if data_cfg.dataset not in SPLITS:  # not an image dataset this module loads: nothing held
        return 0
    n_train, n_test, pixels = SPLITS[data_cfg.dataset]
    n_train = min(n_train, data_cfg.limit_train or n_train)
    n_test = min(n_test, data_cfg.limit_test or n_test)
    return (n_train + n_test) * (pixels + 8)


def read_idx(path: str | Path, limit: int | None = None) -> np.ndarray:
    """An IDX file (gzip-compressed if the name ends in .gz): magic ``00 00 <type> <ndim>``, ndim
    big-endian uint32 sizes, then the data. ``limit``: read only the first ``limit`` items."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        head = fh.read(4)
        if len(head) != 4 or head[0] != 0 or head[1] != 0 or head[2] not in _DTYPES or head[3] == 0:
            raise ValueError(f"{path}: not an IDX file (bad magic {head.hex() or 'empty'}; expected "
                             f"00 00 <type 08..0e> <ndim >= 1>)")
        dtype, ndim = np.dtype(_DTYPES[head[2]]), head[3]
        raw = fh.read(4 * ndim)
        if len(raw) != 4 * ndim:
            raise ValueError(f"{path}: truncated IDX header ({ndim} dimensions announced)")
        dims = [int(d) for d in np.frombuffer(raw, dtype=">u4")]
        n = dims[0] if limit is None else min(dims[0], limit)
        count = n * math.prod(dims[1:])
        data = fh.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
        raise ValueError(f"{path}: truncated IDX data ({len(data)} of {count * dtype.itemsize} bytes)")
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape([n] + dims[1:])


def check_files(root=DEFAULT_ROOT) -> Path:
    """The dataset directory, or ConfigError on ``data.dataset`` naming the package to install."""
    root = Path(root)
    missing = [f for pair in _FILES.values() for f in pair if not (root / f).is_file()]
    if missing:
        raise ConfigError("data.dataset", f"Fashion-MNIST not found under {root}: install the Debian package "
                                          "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)")
    return root


def fashion_mnist(split: str, limit: int | None = None, root=DEFAULT_ROOT) -> tuple[torch.Tensor, torch.Tensor]:
    """``split`` = "train" (60,000) or "test" (10,000) -> (images uint8 (N, 28, 28), labels int64 (N,)),
    the first ``limit`` of them if given."""
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = check_files(root)
    images = read_idx(root / _FILES[split][0], limit)
    labels = read_idx(root / _FILES[split][1], limit)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"{root}: {split} images {images.shape} and labels {labels.shape} do not match")
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 28, 28) -> float (N, 1, 28, 28), ``(x/255 - MEAN) / STD``."""
    return ((images.float() / 255.0 - MEAN) / STD).unsqueeze(1)


def prepare(data_cfg) -> Path:
    """Check the files once, before any rank starts; returns the directory the ranks read."""
    if data_cfg.dataset not in DATASETS:
        raise ConfigError("data.dataset", f"{data_cfg.dataset!r} is not an image dataset; use fashion-mnist")
    return check_files(DEFAULT_ROOT)


class ImageData:
    """Both splits in memory (uint8). ``limit_train`` / ``limit_test``: 0 = all."""

    def __init__(self, root=DEFAULT_ROOT, limit_train: int = 0, limit_test: int = 0):
        self.train_x, self.train_y = fashion_mnist("train", limit_train or None, root)
        self.test_x, self.test_y = fashion_mnist("test", limit_test or None, root)
        self.n_classes = int(self.train_y.max()) + 1

    @property
    def unigram_entropy(self) -> float:
        """Loss (nats/image) of the best input-free predictor (the class prior): the baseline."""
        p = torch.bincount(self.train_y).double()
        p = p[p > 0] / p.sum()
        return float(-(p * p.log()).sum())


class ImageLoader:
    """Deterministic sharded batches: ``next_batch()`` -> this rank's micro-batches of a step."""

    tokens_per_sample = 1  # throughput and MFU count images

    def __init__(self, data: ImageData, global_batch: int, microbatches: int, dp_rank: int, dp_size: int,
                 seed: int, device="cpu", dtype=torch.float32):
        if global_batch % (dp_size * microbatches):
            raise ConfigError("train.global_batch", f"{global_batch} not divisible by dp*microbatches")
        if len(data.train_y) < global_batch:
            raise ConfigError("data.limit_train", f"{len(data.train_y)} training images, fewer than one "
                                                  f"global batch ({global_batch})")
        self.data, self.global_batch, self.microbatches = data, global_batch, microbatches
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.device, self.dtype = torch.device(device), dtype
        self.n = len(data.train_y)
        self.cursor = 0  # global samples consumed
        self._perm_epoch, self._perm = -1, None

    def _index(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = np.random.default_rng([self.seed, epoch]).permutation(self.n), epoch
        return int(self._perm[i])

    def _micro(self, images: torch.Tensor, labels: torch.Tensor):
        x = normalise(images).to(self.device, self.dtype)
        y = labels.to(self.device)
        return list(zip(x.chunk(self.microbatches), y.chunk(self.microbatches)))

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of the next global batch, split into micro-batches; advances the cursor."""
        per_rank = self.global_batch // self.dp_size
        first = self.cursor + self.dp_rank * per_rank
        idx = torch.tensor([self._index(g) for g in range(first, first + per_rank)])
        self.cursor += self.global_batch
        return self._micro(self.data.train_x[idx], self.data.train_y[idx])

    def val_batches(self, n_batches: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The first ``n_batches`` global batches of the test split, sharded like training."""
        total = min(n_batches, len(self.data.test_y) // self.global_batch)
        if total < 1:
            raise ConfigError("data.limit_test", "the test split holds fewer images than one global batch")
        per_rank, out = self.global_batch // self.dp_size, []
        for b in range(total):
            lo = b * self.global_batch + self.dp_rank * per_rank
            out.append(self._micro(self.data.test_x[lo:lo + per_rank], self.data.test_y[lo:lo + per_rank]))
        return out

    def test_share(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's contiguous share of the whole test split in batches of at most ``batch``,
        each made as it is asked for (one batch in memory at a time); every rank gets the same
        number of batches (a rank with fewer images gets empty ones), so sharded engines run the
        same collectives on every rank."""
        n = len(self.data.test_y)
        bounds = [n * r // self.dp_size for r in range(self.dp_size + 1)]
        lo, hi = bounds[self.dp_rank], bounds[self.dp_rank + 1]
        n_batches = math.ceil(max(b - a for a, b in zip(bounds, bounds[1:])) / batch)
        for k in range(n_batches):
            a, b = min(lo + k * batch, hi), min(lo + (k + 1) * batch, hi)
            x = normalise(self.data.test_x[a:b]).to(self.device, self.dtype)
            yield x, self.data.test_y[a:b].to(self.device)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "n_train": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n_train", self.n) != self.n:
            raise ConfigError("data.limit_train", f"checkpoint was written with {state['n_train']} training "
                                                  f"images; resume with the same data.limit_train")
        self.cursor = int(state["cursor"])
        self.seed = int(state.get("seed", self.seed))
        self._perm_epoch = -1


@torch.no_grad()
def accuracy(engine, loader: ImageLoader, batch: int = EVAL_BATCH, autocast=None) -> float:
    """Top-1 accuracy over the whole test split: each data-parallel rank classifies its share
    (argmax of the logits of ``engine.model(images)``; under FSDP the root's forward hooks gather
    the parameters), then the (correct, total) counts are all-reduced over the data-parallel ranks."""
    from contextlib import nullcontext
    model = engine.model
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=engine.mesh.device)
    try:
        for x, y in loader.test_share(batch):
            empty = x.shape[0] == 0
            with autocast() if autocast else nullcontext():
                logits = model(_dummy(loader) if empty else x)
            if not empty:
                counts[0] += (logits.argmax(-1) == y).sum().double()
                counts[1] += y.numel()
    finally:
        model.train(was_training)
    if engine.mesh.size("dp_cp") > 1:
        counts = engine.mesh.comm("dp_cp").all_reduce(counts)
    return float(counts[0] / counts[1])


def _dummy(loader: ImageLoader) -> torch.Tensor:
    """One blank image: a rank with no images left still runs the forward (FSDP's all-gathers)."""
    return torch.zeros(1, 1, 28, 28, device=loader.device, dtype=loader.dtype)
