"""Topology: exhaustive over every factorization of world sizes 1..16."""
import itertools

import pytest

from shardlab.distributed.topology import AXES, Topology


def factorizations(n):
    """All (dp_replicate, dp_shard, cp, tp, pp) with product n."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    for combo in itertools.product(divs, repeat=4):
        prod = 1
        for c in combo:
            prod *= c
        if n % prod == 0:
            yield combo + (n // prod,)


def all_topologies(max_world=16):
    for n in range(1, max_world + 1):
        for dr, ds, cp, tp, pp in factorizations(n):
            for ep in range(1, ds * cp + 1):
                if (ds * cp) % ep == 0:
                    yield Topology(dr, ds, cp, tp, pp, ep)


TOPOLOGIES = list(all_topologies())


def test_count_is_exhaustive():
    # number of ordered 5-factorizations of n summed over n (a known multiplicative function)
    for n in (1, 2, 8, 12, 16):
        count = sum(1 for _ in factorizations(n))
        brute = sum(1 for c in itertools.product(range(1, n + 1), repeat=5)
                    if c[0] * c[1] * c[2] * c[3] * c[4] == n)
        assert count == brute


def test_rank_coords_roundtrip_and_row_major():
    for topo in TOPOLOGIES:
        seen = set()
        for r in range(topo.world_size):
            c = topo.coords(r)
            assert topo.rank(**{a: c[a] for a in AXES}) == r
            seen.add(tuple(c[a] for a in AXES))
            # tp varies fastest, pp slowest
            assert c["tp"] == r % topo.tp
            assert c["pp"] == r // (topo.world_size // topo.pp)
        assert len(seen) == topo.world_size


@pytest.mark.parametrize("name", ["pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_cp",
                                  "dp_shard_cp", "world", "ep", "edp"])
def test_groups_partition_and_vary_only_their_axes(name):
    varying = {"dp": {"dp_replicate", "dp_shard"}, "dp_cp": {"dp_replicate", "dp_shard", "cp"},
               "dp_shard_cp": {"dp_shard", "cp"}, "world": set(AXES), "ep": {"dp_shard", "cp"},
               "edp": {"dp_replicate", "dp_shard", "cp"}}.get(name, {name})
    for topo in TOPOLOGIES:
        groups = topo.groups(name)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(topo.world_size)), "groups must partition the world"
        assert all(len(g) == topo.size(name) for g in groups)
        for g in groups:
            cs = [topo.coords(r) for r in g]
            for axis in AXES:
                if axis not in varying:
                    assert len({c[axis] for c in cs}) == 1, (topo, name, axis)
            # position in the group equals the group-local index (ep / edp coordinates)
            if name in ("ep", "edp"):
                assert [c[name] for c in cs] == list(range(len(g)))


def test_expert_groups_borrow_from_dp_shard_cp():
    for topo in TOPOLOGIES:
        for g in topo.groups("ep"):
            # all members of an ep group lie in one dp_shard x cp group
            assert set(g) <= set(topo.group_of("dp_shard_cp", g[0]))
        # ep x edp covers the data-parallel x cp ranks exactly once
        assert topo.size("ep") * topo.size("edp") == topo.size("dp_cp")


def test_bad_topologies_are_refused():
    with pytest.raises(ValueError, match="ep=3 must divide"):
        Topology(dp_shard=4, ep=3)
    with pytest.raises(ValueError, match="positive integer"):
        Topology(tp=0)
    with pytest.raises(ValueError, match="outside"):
        Topology(tp=2).coords(2)
    with pytest.raises(ValueError, match="unknown axes"):
        Topology(tp=2).rank(xx=1)


def test_tier_groups_split_each_ep_group_by_node():
    """ep_intra: an ep group's ranks on one node; ep_inter: one rank per node, same index inside
    its node; their sizes multiply to ep. Uneven ep groups over nodes are refused."""
    checked = 0
    for topo in TOPOLOGIES:
        for nodes in range(2, topo.world_size + 1):
            if topo.world_size % nodes:
                continue
            args = {a: getattr(topo, a) for a in AXES + ("ep",)}
            try:
                t = Topology(**args, nodes=nodes)
            except ValueError as e:
                assert "ranks on its nodes" in str(e)
                continue
            checked += 1
            for name in ("ep_intra", "ep_inter"):
                flat = sorted(r for g in t.groups(name) for r in g)
                assert flat == list(range(t.world_size))
            for g in t.groups("ep"):
                intra = [x for x in t.groups("ep_intra") if x[0] in g]
                inter = [x for x in t.groups("ep_inter") if x[0] in g]
                assert all(len({t.node(r) for r in x}) == 1 for x in intra)
                assert all(len({t.node(r) for r in x}) == len(x) for x in inter)
                assert len(intra[0]) * len(inter[0]) == len(g) == t.size("ep_intra") * t.size("ep_inter")
                for x in inter:  # same position inside its node's part of the ep group
                    assert len({next(p for p in intra if r in p).index(r) for r in x}) == 1
    assert checked > 1000


def test_groups_are_cached_per_topology_but_handed_out_as_copies():
    """groups() is computed once per (topology, name) for the planner's thousands of layouts; a
    caller that edits the lists it got must not change what the next caller gets."""
    t = Topology(dp_shard=4, ep=4, nodes=2)
    first = t.groups("ep_intra")
    first[0].append(99)
    t.group_of("ep", 0).append(98)
    again = Topology(dp_shard=4, ep=4, nodes=2)  # an equal topology: the same cached entry
    assert again.groups("ep_intra") == [[0, 1], [2, 3]]
    assert again.group_of("ep", 0) == [0, 1, 2, 3]
