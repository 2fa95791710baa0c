"""Box initialisation (models/init.py) equals slicing the whole tensor drawn at once, and flat
ranges cut into boxes (distributed/regions.py) cover exactly the range, in order."""
import itertools
import math

import pytest
import torch

from shardlab.distributed.regions import flat_boxes, intersect
from shardlab.models import init as I


def _whole(shape, seed=11, std=0.5):
    g = torch.Generator().manual_seed(I.param_seed(seed, "w"))
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


@pytest.mark.parametrize("shape", [(48, 32), (50, 17), (7, 3), (1, 40), (37,), (5,), (3, 5, 7), (300, 1)])
def test_init_box_equals_slice_of_whole(shape, monkeypatch):
    monkeypatch.setattr(I, "CHUNK", 64)   # many chunks, awkward row sizes, short tails
    whole = _whole(shape)
    assert torch.equal(I.init_box("w", shape, 0.5, 11), whole)
    for dim in range(len(shape)):
        n = shape[dim]
        for start, length in [(0, n), (n // 3, max(1, n // 2)), (n - 1, 1)]:
            off = [0] * len(shape)
            size = list(shape)
            off[dim], size[dim] = start, length
            got = I.init_box("w", shape, 0.5, 11, off, size, torch.float64)
            assert torch.equal(got, whole.narrow(dim, start, length).double()), (shape, dim, start)


def test_init_box_ones_and_seed():
    assert torch.equal(I.init_box("n", (4, 2), None, 1, (1, 0), (2, 2)), torch.ones(2, 2))
    a, b = I.init_box("w", (8, 8), 1.0, 1), I.init_box("w", (8, 8), 1.0, 2)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (4, 1, 3)])
def test_flat_boxes_cover_range_in_order(shape):
    n = math.prod(shape)
    ref = torch.arange(n).reshape(shape)
    for lo, hi in itertools.combinations(range(n + 1), 2):
        boxes = flat_boxes(shape, lo, hi)
        got = torch.cat([ref[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes])
        assert torch.equal(got, torch.arange(lo, hi)), (shape, lo, hi, boxes)
        assert len(boxes) <= 2 * len(shape) - 1


def test_intersect():
    assert intersect(((0, 0), (4, 4)), ((2, 3), (5, 5))) == ((2, 3), (2, 1))
    assert intersect(((0,), (2,)), ((2,), (2,))) is None


@pytest.mark.parametrize("config", ["tiny", "tiny-moe", "gpt2-124m", "cnn-fashion-mnist"])
def test_meta_device_builds_the_same_shapes_without_the_fills(config):
    """``meta_device`` skips the fills of meta tensors only: every architecture's parameters and
    buffers have the names, shapes, dtypes and requires_grad of a plain ``torch.device("meta")``
    build, and a real (CPU) tensor is still filled inside it."""
    from shardlab import config as C
    from shardlab.models.spec import get_spec
    cfg = C.load(f"configs/{config}.toml", []).model
    with torch.device("meta"):
        plain = get_spec(cfg).build(cfg)
    with I.meta_device():
        skipped = get_spec(cfg).build(cfg)
        real = torch.nn.init.normal_(torch.zeros(64, device="cpu"))
    assert real.std() > 0.5  # not skipped: only meta tensors are left unfilled
    describe = lambda m: [(n, t.shape, t.dtype, t.requires_grad, t.device.type)  # noqa: E731
                          for n, t in [*m.named_parameters(), *m.named_buffers()]]
    assert describe(skipped) == describe(plain) and describe(plain)


def test_building_a_model_does_not_import_dynamo():
    """The fills of meta tensors imported torch._dynamo (about 800 modules, 2 CPU-s) in every process
    that built a model, ``shardlab generate`` and ``checkpoint export`` among them."""
    import subprocess
    import sys
    code = ("import sys; from shardlab import config as C; from shardlab.models.spec import meta_model; "
            "m = meta_model(C.load('configs/tiny.toml', []).model); "
            "print(sum(p.numel() for p in m.parameters()), 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False", out
