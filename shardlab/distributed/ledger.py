"""Ledger: calls and bytes of every collective issued through shardlab, per op and per group.

One Ledger lives on each rank's :class:`~shardlab.distributed.mesh.Mesh` (no global). Own
algorithms (algorithms.py, through Comm) record the bytes they really sent and received;
backend ops record the bytes a ring algorithm would move per rank (:func:`ring_bytes`,
REFERENCE.md), since the backend does not say what it moved.
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


def ring_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends under the ring algorithm (REFERENCE.md table).

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
    """``ledger.record(op, group_name, sent, recv)``; ``ledger.totals()`` -> {(op, group): Entry}."""

    def __init__(self):
        self.entries: dict[tuple[str, str], Entry] = defaultdict(Entry)
        self.enabled = True

    def record(self, op: str, group: str, sent: int, recv: int | None = None, seconds: float = 0.0):
        if not self.enabled:
            return
        e = self.entries[(op, group)]
        e.calls += 1
        e.bytes_sent += int(sent)
        e.bytes_recv += int(sent if recv is None else recv)
        e.seconds += seconds

    def reset(self):
        self.entries.clear()

    def snapshot(self) -> dict[tuple[str, str], Entry]:
        return {k: Entry(**vars(v)) for k, v in self.entries.items()}

    def since(self, snap: dict) -> dict[tuple[str, str], Entry]:
        """Entries accumulated since ``snap = ledger.snapshot()``."""
        out = {}
        for k, v in self.entries.items():
            base = snap.get(k, Entry())
            d = Entry(v.calls - base.calls, v.bytes_sent - base.bytes_sent,
                      v.bytes_recv - base.bytes_recv, v.seconds - base.seconds)
            if d.calls:
                out[k] = d
        return out

    def total_sent(self, group: str | None = None, op: str | None = None) -> int:
        return sum(e.bytes_sent for (o, g), e in self.entries.items()
                   if (group is None or g == group) and (op is None or o == op))

    def table(self) -> str:
        rows = [f"{'op':<16}{'group':<14}{'calls':>8}{'sent MiB':>12}{'recv MiB':>12}"]
        for (op, group), e in sorted(self.entries.items()):
            rows.append(f"{op:<16}{group:<14}{e.calls:>8}{e.bytes_sent / 2**20:>12.3f}{e.bytes_recv / 2**20:>12.3f}")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        return {f"{op}/{group}": vars(e).copy() for (op, group), e in sorted(self.entries.items())}
