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
