"""The tier wrapper's byte model and the ledger's per-tier counts, without processes: a stand-in
communicator records what it was asked and returns its input (distributed/tiers.py)."""
import time

import torch

from shardlab.distributed.collectives import Comm
from shardlab.distributed.ledger import Ledger, ring_bytes
from shardlab.distributed.tiers import Delayed, Link, TieredComm


class _Local(Comm):
    """A Comm whose collectives do not communicate: the ledger entry as a backend call, the input back."""

    def all_to_all(self, t, in_splits=None, out_splits=None, algorithm=None):
        ins, outs = self._a2a_splits(t, in_splits, out_splits)
        self._count_a2a(t, ins, outs)
        return t

    def all_reduce(self, t, op="sum", algorithm=None):
        self._count("all_reduce", t.numel() * t.element_size())
        return t


def _tiered(rank, nodes, link=Link()):
    ledger = Ledger()
    return TieredComm(_Local("ep", None, list(range(len(nodes))), rank, ledger), nodes, link), ledger


def test_all_to_all_counts_the_rows_to_and_from_other_nodes():
    nodes = [0, 0, 1, 1]
    comm, ledger = _tiered(1, nodes)
    x = torch.zeros(10, 3, dtype=torch.float64)  # 24 bytes a row
    comm.all_to_all(x, [1, 2, 3, 4], [4, 0, 2, 5])
    e = ledger.entries[("all_to_all", "ep")]
    assert (e.inter_sent, e.inter_recv) == ((3 + 4) * 24, (2 + 5) * 24)
    assert e.bytes_sent == (1 + 3 + 4) * 24  # every row that leaves the rank; the inter part of it above
    assert ledger.total_sent(tier="inter") == 7 * 24 and ledger.total_sent(tier="intra") == 24
    assert "inter sent" in ledger.table()


def test_ring_ops_cross_where_the_next_rank_is_on_another_node():
    nodes = [0, 0, 1, 1]
    x = torch.zeros(100)
    per = ring_bytes("all_reduce", 400, 4)
    for rank, crosses_out, crosses_in in ((0, False, True), (1, True, False), (2, False, True), (3, True, False)):
        comm, ledger = _tiered(rank, nodes)
        comm.all_reduce(x)
        e = ledger.entries[("all_reduce", "ep")]
        assert (e.inter_sent, e.inter_recv) == (per * crosses_out, per * crosses_in)


def test_throttle_and_since_and_one_node():
    link = Link(gbps=0.001, latency_us=1000)  # 1 MB/s: 2400 bytes take 2.4 ms, + 1 ms latency
    assert abs(link.seconds(2400) - 0.0034) < 1e-12 and not Link().throttled
    comm, ledger = _tiered(0, [0, 1], link)
    snap = ledger.snapshot()
    t0 = time.perf_counter()
    comm.all_to_all(torch.zeros(200, 3, dtype=torch.float64))  # 100 rows = 2400 bytes each way
    assert time.perf_counter() - t0 >= link.seconds(2400)
    d = ledger.since(snap)[("all_to_all", "ep")]
    assert (d.calls, d.inter_sent, d.inter_recv) == (1, 2400, 2400)
    same, ledger = _tiered(0, [3, 3])
    same.all_to_all(torch.zeros(4, 1))
    assert ledger.total_sent(tier="inter") == 0 and ledger.total_sent() > 0


def test_delayed_work_waits_for_its_deadline():
    class Done:
        def wait(self):
            return "ok"

        def is_completed(self):
            return True

    w = Delayed(Done(), time.perf_counter() + 0.02)
    assert not w.is_completed()
    t0 = time.perf_counter()
    assert w.wait() == "ok" and time.perf_counter() - t0 >= 0.015 and w.is_completed()
