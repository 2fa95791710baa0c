"""The CNN (models/cnn) and its data (train/images.py): IDX reader, loader, config refusals."""
from __future__ import annotations

import dataclasses
import gzip
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlab.config import Config, ConfigError
from shardlab.models import build_model, get_spec
from shardlab.parallel import DataParallel
from shardlab.train import images

ROOT = Path(__file__).resolve().parents[2]


def write_idx(path: Path, arr: np.ndarray, type_code: int = 0x08, magic: bytes | None = None) -> None:
    head = magic if magic is not None else bytes([0, 0, type_code, arr.ndim])
    with gzip.open(path, "wb") as fh:
        fh.write(head + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(arr.dtype.newbyteorder(">")).tobytes())


def synthetic_dataset(root: Path, n_train: int = 40, n_test: int = 12) -> dict:
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        write_idx(root / f"{split}-images-idx3-ubyte.gz", x)
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", y)
        arrays[split] = (x, y)
    return arrays


def cnn_cfg(**model) -> Config:
    cfg = Config()
    cfg.model.arch, cfg.model.d_model, cfg.data.dataset = "cnn", 16, "fashion-mnist"
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_idx_reader_roundtrip_limit_and_bad_magic(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", arr)
    assert np.array_equal(images.read_idx(tmp_path / "a.gz"), arr)
    assert np.array_equal(images.read_idx(tmp_path / "a.gz", limit=1), arr[:1])
    ints = np.array([-5, 7, 1 << 20], dtype=np.int32)  # big-endian int32 (type 0x0c)
    write_idx(tmp_path / "i.gz", ints, type_code=0x0C)
    assert images.read_idx(tmp_path / "i.gz").tolist() == ints.tolist()
    write_idx(tmp_path / "bad.gz", arr, magic=b"\x12\x34\x08\x03")
    with pytest.raises(ValueError, match="bad magic 12340803"):
        images.read_idx(tmp_path / "bad.gz")
    with gzip.open(tmp_path / "short.gz", "wb") as fh:
        fh.write(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"abc")
    with pytest.raises(ValueError, match="truncated"):
        images.read_idx(tmp_path / "short.gz")


def test_fashion_mnist_on_synthetic_files_and_missing_package(tmp_path):
    arrays = synthetic_dataset(tmp_path)
    x, y = images.fashion_mnist("test", limit=5, root=tmp_path)
    assert x.dtype == torch.uint8 and x.shape == (5, 28, 28) and y.dtype == torch.int64 and y.shape == (5,)
    assert np.array_equal(x.numpy(), arrays["t10k"][0][:5]) and y.tolist() == arrays["t10k"][1][:5].tolist()
    with pytest.raises(ConfigError) as e:
        images.fashion_mnist("train", root=tmp_path / "absent")
    assert e.value.field == "data.dataset" and "apt-get install dataset-fashion-mnist" in str(e.value)
    norm = images.normalise(x)
    assert norm.shape == (5, 1, 28, 28)
    assert torch.allclose(norm[0, 0], (x[0].float() / 255 - 0.2860) / 0.3530)


def test_image_loader_disjoint_shards_epochs_and_resume(tmp_path):
    synthetic_dataset(tmp_path, n_train=40, n_test=13)
    data = images.ImageData(tmp_path)
    assert abs(data.unigram_entropy - np.log(10)) < 1e-9
    whole = images.ImageLoader(data, 8, 1, 0, 1, seed=3)
    ranks = [images.ImageLoader(data, 8, 2, r, 2, seed=3) for r in range(2)]
    seen = []
    for step in range(10):  # 80 samples = 2 epochs of 40
        (xw, yw), = whole.next_batch()
        parts = [ranks[r].next_batch() for r in range(2)]
        xs = torch.cat([x for p in parts for x, _ in p])
        assert torch.equal(xs, xw) and torch.equal(torch.cat([y for p in parts for _, y in p]), yw)
        seen.append(xw)
    flat = torch.cat(seen).flatten(1)
    epoch0 = {tuple(r.tolist()) for r in flat[:40]}
    assert len(epoch0) == 40  # every training image once per epoch
    assert not torch.equal(flat[:40], flat[40:])  # reshuffled per epoch
    state = ranks[1].state_dict()
    nxt = ranks[1].next_batch()
    other = images.ImageLoader(data, 8, 2, 1, 2, seed=3)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for p, q in zip(nxt, other.next_batch()) for a, b in zip(p, q))
    shares = [list(images.ImageLoader(data, 9, 1, r, 3, seed=3).test_share(3)) for r in range(3)]
    assert len({len(s) for s in shares}) == 1  # same batch count on every rank
    assert sum(y.numel() for s in shares for _, y in s) == 13


def test_model_shapes_loss_init_and_flops():
    cfg = cnn_cfg(d_model=32)
    model = build_model(cfg.model, 1)
    x, y = torch.randn(5, 1, 28, 28), torch.arange(5)
    assert model(x).shape == (5, 10)
    assert torch.allclose(model(x, y), torch.nn.functional.cross_entropy(model(x), y))
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {
        "conv1.weight": (32, 1, 3, 3), "conv1.bias": (32,), "conv2.weight": (64, 32, 3, 3), "conv2.bias": (64,),
        "fc1.weight": (32, 9216), "fc1.bias": (32,), "fc2.weight": (10, 32), "fc2.bias": (10,)}
    spec = get_spec("cnn")
    assert spec.task == "classify" and list(spec.blocks(model)) == ["conv1", "conv2", "fc1", "fc2"]
    assert model.fc1.bias.abs().max() == 0
    assert abs(float(model.fc1.weight.detach().std()) - 1 / 96) < 1e-3  # 1/sqrt(9216)
    macs = 26 * 26 * 32 * 9 + 24 * 24 * 64 * 288 + 9216 * 32 + 32 * 10
    assert spec.flops_per_token(cfg.model, 1) == 6 * macs


def test_legacy_dataparallel_equals_plain_module():
    torch.set_num_threads(1)
    cfg = cnn_cfg()
    ref, twin = build_model(cfg.model, 5, dtype=torch.float64), build_model(cfg.model, 5, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 28, 28, generator=g, dtype=torch.float64), torch.randint(0, 10, (6,), generator=g)
    dp = DataParallel(twin, device_ids=["cpu", "cpu"])
    assert torch.allclose(dp(x), ref(x), atol=1e-12, rtol=0)
    losses = dp(x, y)
    losses.mean().backward()
    loss = ref(x, y)
    loss.backward()
    assert abs(float(losses.detach().mean()) - float(loss.detach())) <= 1e-12
    for (n, p), q in zip(ref.named_parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-10, rtol=0), n


@pytest.mark.parametrize("override,field", [
    (dict(parallel=dict(tp=2)), "parallel.tp"), (dict(parallel=dict(pp=2)), "parallel.pp"),
    (dict(parallel=dict(cp=2)), "parallel.cp"), (dict(model=dict(n_experts=4)), "model.n_experts"),
    (dict(data=dict(dataset="shakespeare")), "data.dataset"), (dict(model=dict(dropout=1.5)), "model.dropout"),
    (dict(parallel=dict(activation_checkpointing="selective")), "parallel.activation_checkpointing"),
])
def test_config_refusals(override, field):
    from shardlab import config as C
    cfg = C.load(ROOT / "configs/cnn-fashion-mnist.toml", override)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert e.value.field == field and "\n" not in str(e.value)


def test_cli_refuses_tp_with_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "shardlab.cli", "train", "configs/cnn-fashion-mnist.toml",
                        "--parallel.tp=2", "--nproc", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.tp" in lines[0] and "cnn" in lines[0], r.stderr


def test_real_fashion_mnist_slice():
    if not images.DEFAULT_ROOT.is_dir():
        pytest.skip("Fashion-MNIST absent: install the Debian package dataset-fashion-mnist")
    x, y = images.fashion_mnist("train", limit=256)
    assert x.shape == (256, 28, 28) and x.dtype == torch.uint8 and 0 <= int(y.min()) and int(y.max()) <= 9
    assert len(set(y.tolist())) == 10
    xt, yt = images.fashion_mnist("test", limit=100)
    assert xt.shape == (100, 28, 28) and yt.shape == (100,)
    norm = images.normalise(images.fashion_mnist("train", limit=2000)[0])
    assert abs(float(norm.mean())) < 0.05 and abs(float(norm.std()) - 1) < 0.05


@pytest.mark.parametrize("limits", [(0, 0), (300, 50)])
def test_memory_prediction_holds_the_dataset_the_ranks_load(limits):
    """Every CPU rank holds both splits in memory (``ImageData``); ``shardlab memory`` priced none
    of it (its measured peak was 1.25-1.27x the prediction). The term equals the bytes of the
    tensors the loader actually builds."""
    if not images.DEFAULT_ROOT.is_dir():
        pytest.skip("Fashion-MNIST absent: install the Debian package dataset-fashion-mnist")
    from shardlab.analysis.predict import memory_per_rank
    cfg = cnn_cfg()
    cfg.data.limit_train, cfg.data.limit_test = limits
    cfg.parallel.dp_replicate = 2
    data = images.ImageData(limit_train=limits[0], limit_test=limits[1])
    held = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    assert images.resident_bytes(cfg.data) == held
    cpu, cuda = memory_per_rank(cfg.validate(2), "cpu"), memory_per_rank(cfg.validate(2), "cuda")
    assert [r.data for r in cpu] == [held, held] and [r.data for r in cuda] == [0.0, 0.0]
    assert dataclasses.replace(cpu[0], data=0.0).total == pytest.approx(cpu[0].total - held)  # in the peak
