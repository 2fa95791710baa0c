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
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
GROUPS = {
    "pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "cp": ("cp",),
    "tp": ("tp",), "dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"), "world": AXES,
}


@dataclass(frozen=True)
class Topology:
    """Degrees of each parallel axis. ``world_size`` is their product (ep excluded: it borrows)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for axis in AXES + ("ep",):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"topology: {axis} must be a positive integer, got {value!r}")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"topology: ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp}")

    @classmethod
    def from_config(cls, parallel) -> "Topology":
        return cls(parallel.dp_replicate, parallel.dp_shard, parallel.cp, parallel.tp, parallel.pp, parallel.ep)

    @property
    def world_size(self) -> int:
        n = 1
        for axis in AXES:
            n *= getattr(self, axis)
        return n

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def size(self, group: str) -> int:
        """Number of ranks in one group of the given name."""
        if group == "ep":
            return self.ep
        if group == "edp":
            return self.dp_replicate * self.dp_shard * self.cp // self.ep
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
        return dict(out)

    def rank(self, **coords: int) -> int:
        """{axis: index} -> rank; axes left out are 0."""
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
        """All groups of this name, each a sorted list of ranks; together they partition the world."""
        if name in ("ep", "edp"):
            return self._expert_groups(name)
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}; groups are {sorted(GROUPS) + ['ep', 'edp']}")
        varying = GROUPS[name]
        fixed = [a for a in AXES if a not in varying]
        result = []
        for fixed_idx in product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, fixed_idx))
            ranks = [self.rank(**base, **dict(zip(varying, v)))
                     for v in product(*(range(getattr(self, a)) for a in varying))]
            result.append(sorted(ranks))
        return result

    def _expert_groups(self, name: str) -> list[list[int]]:
        buckets: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = (c["pp"], c["tp"], c["edp"]) if name == "ep" else (c["pp"], c["tp"], c["ep"])
            buckets.setdefault(key, []).append(r)
        return [sorted(v) for _, v in sorted(buckets.items())]

    def group_of(self, name: str, rank: int) -> list[int]:
        """The ranks of the ``name`` group that contains ``rank``."""
        for g in self.groups(name):
            if rank in g:
                return g
        raise AssertionError("groups must partition the world")

    def describe(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in AXES + ("ep",) if getattr(self, a) > 1]
        return " x ".join(parts) if parts else "single process"
