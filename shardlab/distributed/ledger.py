"""Ledger: calls and bytes of every collective issued through shardlab, per op and per group.

One Ledger lives on each rank's :class:`~shardlab.distributed.mesh.Mesh` (no global). Every
record says where its bytes come from (``Entry.source``, the "source" column of ``table()``):

  measured   own algorithms (algorithms.py, through Comm) and point-to-point sends/receives:
             the bytes this rank really passed to send and receive;
  modelled   backend (torch.distributed) collectives: the bytes a ring algorithm would move per
             rank (:func:`ring_bytes`; all-to-all: the rows that leave / reach the rank), since
             the backend does not say what it moved (NCCL may pick a tree, for instance).

Tiers. On a group that spans nodes (topology.py, ``nodes``) the tier wrapper (tiers.py) also
records which part of each call crossed the slow tier between nodes: ``Entry.inter_sent`` /
``inter_recv`` (same source as the entry's bytes); the rest stayed inside a node.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Entry:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0
    modelled_calls: int = 0
    """How many of ``calls`` recorded modelled bytes (backend collectives); the rest are measured."""
    inter_sent: int = 0
    """Of ``bytes_sent``, the bytes that crossed the slow tier to another node (tiers.py)."""
    inter_recv: int = 0
    """Of ``bytes_recv``, the bytes that came over the slow tier from another node."""

    @property
    def source(self) -> str:
        """"measured", "modelled", or "mixed" (an op on one group run both ways)."""
        if self.modelled_calls == 0:
            return "measured"
        return "modelled" if self.modelled_calls == self.calls else "mixed"


def ring_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends under the ring algorithm (docs/collectives.md table).

    ``nbytes``: all_reduce/broadcast -> the message; reduce_scatter -> the full input;
    all_gather -> the full output; all_to_all -> the local input; send/recv -> the message."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * nbytes * (n - 1) // n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return nbytes * (n - 1) // n
    if op in ("broadcast", "send", "recv"):
        return nbytes
    raise ValueError(f"unknown op {op!r}")


class Ledger:
    """``ledger.record(op, group_name, sent, recv, modelled=...)``; ``ledger.entries`` ->
    {(op, group): Entry}."""

    def __init__(self):
        self.entries: dict[tuple[str, str], Entry] = defaultdict(Entry)
        self.enabled = True

    def record(self, op: str, group: str, sent: int, recv: int | None = None, seconds: float = 0.0,
               modelled: bool = False):
        """``modelled``: the bytes come from a model (backend collectives), not from what this
        rank passed to send and receive."""
        if not self.enabled:
            return
        e = self.entries[(op, group)]
        e.calls += 1
        e.modelled_calls += bool(modelled)
        e.bytes_sent += int(sent)
        e.bytes_recv += int(sent if recv is None else recv)
        e.seconds += seconds

    def record_inter(self, op: str, group: str, sent: int, recv: int):
        """Add the slow-tier part of the call just recorded under (op, group) (tiers.py)."""
        if not self.enabled:
            return
        e = self.entries[(op, group)]
        e.inter_sent += int(sent)
        e.inter_recv += int(recv)

    def reset(self):
        self.entries.clear()

    def snapshot(self) -> dict[tuple[str, str], Entry]:
        return {k: Entry(**vars(v)) for k, v in self.entries.items()}

    def since(self, snap: dict) -> dict[tuple[str, str], Entry]:
        """Entries accumulated since ``snap = ledger.snapshot()``."""
        out = {}
        for k, v in self.entries.items():
            base = snap.get(k, Entry())
            d = Entry(**{f: x - getattr(base, f) for f, x in vars(v).items()})
            if d.calls:
                out[k] = d
        return out

    def total_sent(self, group: str | None = None, op: str | None = None, tier: str = "all") -> int:
        """Bytes sent; ``tier``: all, inter (over the slow tier between nodes) or intra (inside one)."""
        part = {"all": lambda e: e.bytes_sent, "inter": lambda e: e.inter_sent,
                "intra": lambda e: e.bytes_sent - e.inter_sent}[tier]
        return sum(part(e) for (o, g), e in self.entries.items()
                   if (group is None or g == group) and (op is None or o == op))

    def table(self) -> str:
        """One row per (op, group); "source": measured bytes (own algorithms, p2p) or modelled
        (backend collectives, ring model)."""
        tiers = any(e.inter_sent or e.inter_recv for e in self.entries.values())
        rows = [f"{'op':<16}{'group':<14}{'calls':>8}{'sent MiB':>12}{'recv MiB':>12}"
                + (f"{'inter sent':>12}{'inter recv':>12}" if tiers else "") + "  source"]
        for (op, group), e in sorted(self.entries.items()):
            inter = f"{e.inter_sent / 2**20:>12.3f}{e.inter_recv / 2**20:>12.3f}" if tiers else ""
            rows.append(f"{op:<16}{group:<14}{e.calls:>8}{e.bytes_sent / 2**20:>12.3f}"
                        f"{e.bytes_recv / 2**20:>12.3f}{inter}  {e.source}")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        """{"op/group": {calls, bytes_sent, bytes_recv, seconds, modelled_calls, source}}."""
        return {f"{op}/{group}": dict(vars(e), source=e.source) for (op, group), e in sorted(self.entries.items())}
