"""The load-balanced causal split of context parallel (pure functions)."""
import torch

from shardlab.parallel import context


def test_split_roundtrip_and_positions():
    t = torch.arange(24).view(1, 24)
    parts = [context.shard_sequence(t, i, 3) for i in range(3)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert torch.equal(context.unshard_sequence(parts), t)
    for i in range(3):
        assert torch.equal(context.positions(8, i, 3), parts[i][0])
