"""Parallel degrees and rank <-> coordinates. Pure Python: no torch.distributed here.

The world is a row-major grid over the axes ``AXES = (pp, dp_replicate, dp_shard, cp, tp)``:
tp varies fastest (tensor-parallel ranks are neighbours, i.e. on the same node), pp slowest.

Expert parallelism borrows ranks from ``dp_shard x cp`` (as torchtitan does): flatten the
pair into ``f = dp_shard_idx * cp + cp_idx``; then ``ep_idx = f % ep`` and the expert-data-
parallel index (ranks that hold the same experts) is ``f // ep`` combined with dp_replicate.

Named groups (each a list of rank lists that partition the world):
  pp, dp_replicate, dp_shard, cp, tp     one axis varies, the others fixed
  dp        = dp_replicate x dp_shard    gradient averaging of replicated params
  dp_cp     = dp_replicate x dp_shard x cp   loss / gradient averaging when cp > 1
  dp_shard_cp = dp_shard x cp            FSDP sharding group when cp > 1
  ep        ranks exchanging tokens in MoE all-to-all
  edp       ranks holding the same experts (expert gradient averaging)
  cp_ulysses, cp_ring   sub-groups of cp for 2-D ("unified") context parallel: the cp index is
            split as ``cp_idx = ring_idx * cp_ulysses + ulysses_idx``; a cp_ulysses group (the
            Ulysses all-to-all) is ``cp_ulysses`` consecutive cp ranks, a cp_ring group (ring
            attention) the ``cp / cp_ulysses`` ranks with the same ulysses_idx. With the default
            cp_ulysses = 1 the cp_ring groups are the cp groups (docs/context-parallel.md).
  pp_pair   DualPipe's pairs: pipeline ranks i and pp-1-i of one pipeline group (the two holders
            of the same stages; the middle rank alone when pp is odd)
  ep_intra, ep_inter   the two tiers of an ep group (docs/expert-parallel.md, "Two tiers"): the
            ep ranks on one node, and the ep ranks with the same index inside their node's part
            of the ep group (one per node). With one node: ep_intra = ep, ep_inter = the rank alone.

Nodes. ``nodes`` contiguous blocks of ``world / nodes`` ranks each share a node (torchrun's
numbering: node n holds ranks n*LOCAL_WORLD_SIZE ...); rank -> node is ``rank // ranks_per_node``.
``inter_node_gbps`` / ``inter_node_latency_us`` describe the slow tier between nodes for the
throttle that simulates it on one host (distributed/tiers.py); 0 = not throttled.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import product

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
GROUPS = {
    "pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "cp": ("cp",),
    "tp": ("tp",), "dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"), "world": AXES,
}
DERIVED = ("ep", "edp", "cp_ulysses", "cp_ring", "ep_intra", "ep_inter", "pp_pair")
"""Groups that are not products of whole axes (see the module doc)."""


@dataclass(frozen=True)
class Topology:
    """Degrees of each parallel axis. ``world_size`` is their product (ep excluded: it borrows)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp_ulysses: int = 1
    """Ulysses (all-to-all) degree inside cp; cp / cp_ulysses ranks form each ring."""
    nodes: int = 1
    """Nodes the world spans, each a contiguous block of world / nodes ranks (simulated on one
    host with ``parallel.sim_nodes``, or the hosts of a real run: Mesh.build)."""
    inter_node_gbps: float = 0.0
    """Bandwidth per rank of the slow tier between nodes, GB/s, for the throttle (0 = none)."""
    inter_node_latency_us: float = 0.0
    """Latency of one message over the slow tier, microseconds, for the throttle."""

    def __post_init__(self):
        for axis in AXES + ("ep", "cp_ulysses", "nodes"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"topology: {axis} must be a positive integer, got {value!r}")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"topology: ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp}")
        if self.cp % self.cp_ulysses:
            raise ValueError(f"topology: cp_ulysses={self.cp_ulysses} must divide cp={self.cp}")
        if self.world_size % self.nodes:
            raise ValueError(f"topology: nodes={self.nodes} must divide the world size {self.world_size}")
        if self.inter_node_gbps < 0 or self.inter_node_latency_us < 0:
            raise ValueError("topology: inter_node_gbps and inter_node_latency_us must be >= 0")
        if self.nodes > 1:
            for g in self.groups("ep"):
                per = [sum(self.node(r) == n for r in g) for n in sorted({self.node(r) for r in g})]
                if len(set(per)) > 1:
                    raise ValueError(f"topology: ep group {g} has {per} ranks on its nodes; an ep group must "
                                     f"have as many ranks on each node it spans (choose sim_nodes so that "
                                     f"world/nodes ranks per node is a multiple or a divisor of ep)")

    @classmethod
    def from_config(cls, parallel) -> "Topology":
        impl = getattr(parallel, "cp_impl", "ring")
        ulysses = {"ulysses": parallel.cp, "unified": getattr(parallel, "cp_ulysses", 1)}.get(impl, 1)
        return cls(parallel.dp_replicate, parallel.dp_shard, parallel.cp, parallel.tp, parallel.pp, parallel.ep,
                   ulysses, getattr(parallel, "sim_nodes", 1), getattr(parallel, "sim_inter_node_gbps", 0.0),
                   getattr(parallel, "sim_inter_node_latency_us", 0.0))

    @property
    def world_size(self) -> int:
        n = 1
        for axis in AXES:
            n *= getattr(self, axis)
        return n

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def node(self, rank: int) -> int:
        """The node of ``rank`` (contiguous blocks of ``ranks_per_node``)."""
        return rank // self.ranks_per_node

    def size(self, group: str) -> int:
        """Number of ranks in one group of the given name."""
        if group in ("ep_intra", "ep_inter"):
            return len(_groups(self, group)[0])
        if group == "pp_pair":
            return min(2, self.pp)
        if group == "ep":
            return self.ep
        if group == "edp":
            return self.dp_replicate * self.dp_shard * self.cp // self.ep
        if group == "cp_ulysses":
            return self.cp_ulysses
        if group == "cp_ring":
            return self.cp // self.cp_ulysses
        n = 1
        for axis in GROUPS[group]:
            n *= getattr(self, axis)
        return n

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> {axis: index}; also ``ep`` and ``edp`` indices."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        out, rest = {}, rank
        for axis in reversed(AXES):
            d = getattr(self, axis)
            out[axis] = rest % d
            rest //= d
        flat = out["dp_shard"] * self.cp + out["cp"]
        out["ep"] = flat % self.ep
        out["edp"] = out["dp_replicate"] * (self.dp_shard * self.cp // self.ep) + flat // self.ep
        out["cp_ulysses"], out["cp_ring"] = out["cp"] % self.cp_ulysses, out["cp"] // self.cp_ulysses
        return dict(out)

    def rank(self, **coords: int) -> int:
        """{axis: index} -> rank; axes left out are 0 (cp given as one index, not its sub-groups)."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; axes are {AXES}")
        r = 0
        for axis in AXES:
            d, i = getattr(self, axis), coords.get(axis, 0)
            if not 0 <= i < d:
                raise ValueError(f"{axis} index {i} outside 0..{d - 1}")
            r = r * d + i
        return r

    def groups(self, name: str) -> list[list[int]]:
        """All groups of this name, each a sorted list of ranks; together they partition the world
        (computed once per topology and name: the planner asks for the same groups of thousands of
        ranks for every layout it weighs)."""
        return [list(g) for g in _groups(self, name)]

    def _compute_groups(self, name: str) -> list[list[int]]:
        if name in ("ep_intra", "ep_inter"):
            return self._tier_groups(name)
        if name == "pp_pair":
            return sorted(sorted({g[i], g[len(g) - 1 - i]}) for g in self.groups("pp") for i in range((len(g) + 1) // 2))
        if name in ("ep", "edp", "cp_ulysses", "cp_ring"):
            return self._derived_groups(name)
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}; groups are {sorted(list(GROUPS) + list(DERIVED))}")
        varying = GROUPS[name]
        fixed = [a for a in AXES if a not in varying]
        result = []
        for fixed_idx in product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, fixed_idx))
            ranks = [self.rank(**base, **dict(zip(varying, v)))
                     for v in product(*(range(getattr(self, a)) for a in varying))]
            result.append(sorted(ranks))
        return result

    def _derived_groups(self, name: str) -> list[list[int]]:
        """Groups that are not products of whole axes: ranks agreeing on every coordinate but the
        group's own index."""
        other = {"ep": "edp", "edp": "ep", "cp_ulysses": "cp_ring", "cp_ring": "cp_ulysses"}[name]
        buckets: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            if name in ("ep", "edp"):
                key = (c["pp"], c["tp"], c[other])
            else:  # the cp sub-groups: every axis but cp fixed, and the other sub-index of cp
                key = tuple(c[a] for a in AXES if a != "cp") + (c[other],)
            buckets.setdefault(key, []).append(r)
        return [sorted(v) for _, v in sorted(buckets.items())]

    def _tier_groups(self, name: str) -> list[list[int]]:
        """ep_intra: the ranks of an ep group on one node; ep_inter: the ranks of an ep group with
        the same index among its ranks on their node (one rank per node the group spans)."""
        out = []
        for g in self.groups("ep"):
            by_node: dict[int, list[int]] = {}
            for r in g:
                by_node.setdefault(self.node(r), []).append(r)
            parts = list(by_node.values())
            out += parts if name == "ep_intra" else [sorted(p[i] for p in parts) for i in range(len(parts[0]))]
        return sorted(out)

    def group_of(self, name: str, rank: int) -> list[int]:
        """The ranks of the ``name`` group that contains ``rank``."""
        for g in _groups(self, name):
            if rank in g:
                return list(g)
        raise AssertionError("groups must partition the world")

    def describe(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in AXES + ("ep",) if getattr(self, a) > 1]
        if 1 < self.cp_ulysses:  # the cp entry says how it is split
            i = parts.index(f"cp={self.cp}")
            parts[i] += " (ulysses)" if self.cp_ulysses == self.cp else \
                f" (ulysses {self.cp_ulysses} x ring {self.cp // self.cp_ulysses})"
        nodes = f" over {self.nodes} nodes" if self.nodes > 1 else ""
        return (" x ".join(parts) if parts else "single process") + nodes


@functools.lru_cache(maxsize=256)  # an entry holds world-size ints: ~20 MB when full at 2,048 ranks
def _groups(topo: Topology, name: str) -> tuple[tuple[int, ...], ...]:
    """:meth:`Topology.groups`, cached (a frozen Topology is its own key)."""
    return tuple(tuple(g) for g in topo._compute_groups(name))
