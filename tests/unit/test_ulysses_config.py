"""Ulysses / unified context parallel: the cp sub-groups of Topology, the token-order
permutation and the config refusals (no processes)."""
import pytest
import torch

from shardlab.config import Config, ModelConfig
from shardlab.distributed.topology import AXES, Topology
from shardlab.errors import ConfigError
from shardlab.parallel import context, ulysses


@pytest.mark.parametrize("dr,ds,cp,u,tp,pp", [(1, 1, 4, 2, 1, 1), (2, 1, 4, 2, 2, 1), (1, 2, 8, 4, 1, 2),
                                              (1, 1, 6, 3, 2, 1), (1, 1, 4, 1, 1, 1), (1, 1, 4, 4, 1, 1)])
def test_cp_sub_groups_split_each_cp_group(dr, ds, cp, u, tp, pp):
    topo = Topology(dp_replicate=dr, dp_shard=ds, cp=cp, tp=tp, pp=pp, cp_ulysses=u)
    assert topo.size("cp_ulysses") == u and topo.size("cp_ring") == cp // u
    for name, size in (("cp_ulysses", u), ("cp_ring", cp // u)):
        groups = topo.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        assert all(len(g) == size for g in groups)
    for r in range(topo.world_size):
        c = topo.coords(r)
        assert c["cp"] == c["cp_ring"] * u + c["cp_ulysses"]
        cp_group = topo.group_of("cp", r)
        uly, ring = topo.group_of("cp_ulysses", r), topo.group_of("cp_ring", r)
        assert set(uly) <= set(cp_group) and set(ring) <= set(cp_group) and set(uly) & set(ring) == {r}
        # a Ulysses group is u consecutive cp indices; a ring group strides by u
        assert [topo.coords(x)["cp"] for x in uly] == [c["cp_ring"] * u + j for j in range(u)]
        assert [topo.coords(x)["cp"] for x in ring] == [g * u + c["cp_ulysses"] for g in range(cp // u)]
        for x in uly + ring:  # every other axis fixed
            assert all(topo.coords(x)[a] == c[a] for a in AXES if a != "cp")


def test_cp_ulysses_must_divide_cp_and_default_ring_groups_are_cp():
    with pytest.raises(ValueError, match="cp_ulysses=3 must divide cp=4"):
        Topology(cp=4, cp_ulysses=3)
    topo = Topology(cp=4, tp=2)
    assert topo.groups("cp_ring") == topo.groups("cp")
    assert all(len(g) == 1 for g in topo.groups("cp_ulysses"))


def test_from_config_degree_by_cp_impl():
    cfg = Config()
    cfg.parallel.cp = 4
    assert Topology.from_config(cfg.parallel).cp_ulysses == 1
    cfg.parallel.cp_impl = "ulysses"
    assert Topology.from_config(cfg.parallel).cp_ulysses == 4
    cfg.parallel.cp_impl, cfg.parallel.cp_ulysses = "unified", 2
    assert Topology.from_config(cfg.parallel).cp_ulysses == 2


@pytest.mark.parametrize("u,n", [(2, 4), (4, 2), (3, 6)])
def test_token_orders_put_the_group_in_natural_order(u, n):
    """The rank-ordered concatenation of the u load-balanced shards, reordered by ``natural``, is
    the sequence; ``zigzag`` undoes it (independent of ulysses.py: shard_sequence of a range)."""
    natural, zigzag = ulysses._orders(n, u, "cpu")
    seq = torch.arange(u * n) * 10
    cat = torch.cat([context.shard_sequence(seq, j, u, dim=0) for j in range(u)])
    assert torch.equal(cat[natural], seq)
    assert torch.equal(seq[zigzag], cat)


def _cfg(impl, cp, heads=4, kv=2, tp=1, cp_ulysses=1):
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=64, d_model=48, n_layers=2, n_heads=heads, n_kv_heads=kv,
                            max_seq_len=64)
    cfg.train.seq_len, cfg.train.global_batch = 64, 8
    cfg.parallel.cp, cfg.parallel.cp_impl, cfg.parallel.tp, cfg.parallel.cp_ulysses = cp, impl, tp, cp_ulysses
    return cfg


@pytest.mark.parametrize("impl,cp,heads,kv,tp,u,field,text", [
    ("ulysses", 8, 4, 2, 1, 1, "parallel.cp", "must divide the attention heads"),
    ("ulysses", 2, 6, 3, 1, 1, "parallel.cp", "3 kv heads"),
    ("ulysses", 4, 4, 2, 2, 1, "parallel.cp", "per tp rank"),
    ("unified", 4, 4, 2, 1, 3, "parallel.cp_ulysses", "must divide parallel.cp=4"),
    ("unified", 8, 4, 2, 1, 8, "parallel.cp_ulysses", "must divide the attention heads"),
    ("ring", 4, 4, 2, 1, 2, "parallel.cp_ulysses", "only applies to parallel.cp_impl=unified"),
])
def test_refusals_name_the_field(impl, cp, heads, kv, tp, u, field, text):
    cfg = _cfg(impl, cp, heads, kv, tp, u)
    with pytest.raises(ConfigError) as err:
        cfg.validate(cp * tp)
    assert err.value.field == field and text in str(err.value)


@pytest.mark.parametrize("impl,cp,heads,kv,tp,u", [("ulysses", 4, 4, 2, 1, 1), ("ulysses", 4, 4, 1, 1, 1),
                                                   ("ulysses", 2, 4, 2, 2, 1), ("unified", 4, 4, 1, 1, 2),
                                                   ("ring", 8, 4, 2, 1, 1)])
def test_accepted_layouts(impl, cp, heads, kv, tp, u):
    _cfg(impl, cp, heads, kv, tp, u).validate(cp * tp)
