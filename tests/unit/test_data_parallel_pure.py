"""Pure checks of the data-parallel helpers: memory formula, buckets, flat-parameter layout."""
import torch
from torch import nn

from shardlab.analysis.memory import formula
from shardlab.parallel.data import make_buckets
from shardlab.parallel.zero import FlatParam


def test_zero_formula_matches_paper_table():
    psi, n = 7_500_000_000, 64  # the ZeRO paper's example: 7.5B params, 64 GPUs
    gb = lambda s: formula(psi, n, s, "mixed").total / 1e9
    assert round(gb(0)) == 120 and round(gb(1), 2) == 31.41 and round(gb(2), 2) == 16.64
    assert round(gb(3), 2) == 1.88


def test_buckets_reverse_order_and_cap():
    ps = [nn.Parameter(torch.zeros(100)) for _ in range(5)]  # 400 bytes each
    b = make_buckets(ps, cap_bytes=900)
    assert [[id(p) for p in bk] for bk in b] == [[id(ps[4]), id(ps[3])], [id(ps[2]), id(ps[1])], [id(ps[0])]]


def test_flat_param_padding_and_views():
    ps = [torch.arange(6.0).view(2, 3), torch.arange(5.0)]
    for n in (1, 2, 3, 4):
        f = FlatParam(["a", "b"], ps, n, n - 1, 0.0)
        assert f.padded % n == 0 and f.padded - f.total < n
        flat = f.flatten(ps)
        assert [torch.equal(v, p) for v, p in zip(f.views(flat), ps)] == [True, True]
        assert f.own(flat).numel() == f.shard_size
