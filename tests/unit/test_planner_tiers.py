"""Expert parallel over two tiers in the planner (analysis/plan_moe.py): the expected nodes a token
uses, each tier's bytes for the flat and the hierarchical dispatch, DualPipe's paired chunks, all
checked against brute-force enumerations and the engine's own DualPipe order, not the planner's
formulas; and the DeepSeek-V3 plan from the command line."""
import contextlib
import io
import itertools

import pytest
import torch

from shardlab import cli
from shardlab.analysis.devices import get_device, with_nodes
from shardlab.analysis.plan_layout import apply_layout, parse_layout
from shardlab.analysis.plan_moe import a2a_seconds, ep_nodes, nodes_hit, paired_share
from shardlab.analysis.predict import predict
from shardlab.commands.plan_cmd import load_model
from shardlab.distributed.topology import Topology
from shardlab.parallel.pipeline.dualpipe import _rank_order, dualpipe, dualpipev


def _routes(E, k, N, G=0, M=0):
    """Every routing a token can take with equal probability: the k-subsets of its allowed experts
    (node-limited: each M-subset of the G groups, then the k-subsets of their experts), as rows
    of expert ids. Experts in contiguous blocks per node and per group."""
    if not G or not M:
        return torch.combinations(torch.arange(E), k)
    e = E // G
    return torch.cat([torch.combinations(torch.tensor([g * e + i for g in gs for i in range(e)]), k)
                      for gs in itertools.combinations(range(G), M)])


@pytest.mark.parametrize("E,k,N,G,M", [(8, 2, 4, 0, 0), (16, 4, 4, 0, 0), (16, 4, 4, 4, 2), (16, 3, 2, 4, 2),
                                       (12, 3, 3, 6, 2)])
def test_nodes_hit_equals_the_enumeration(E, k, N, G, M):
    routes = _routes(E, k, N, G, M)  # equally likely: each M-subset has as many k-subsets
    mean = sum(len(set((r // (E // N)).tolist())) for r in routes) / len(routes)
    assert nodes_hit(E, k, N, G, M) == pytest.approx(mean, rel=1e-12)


def _cfg(layout, gpus, dispatch="exact", M=0, model="deepseek-v3"):
    base = load_model(model)
    base.parallel.ep_dispatch, base.model.moe_max_nodes = dispatch, M
    return apply_layout(base, parse_layout(layout), gpus)


@pytest.mark.parametrize("dispatch,M", [("exact", 0), ("exact", 4), ("hierarchical", 0), ("hierarchical", 4)])
def test_tier_bytes_equal_the_counted_rows(dispatch, M):
    """One pass of the DeepSeek-V3 shape's dispatch on ep 64 over 8 nodes: the bytes over the
    network and over NVLink equal what the rows of every routing of a token (node-limited or
    not, from rank 0 on node 0, local index 0) send, averaged over the routings: flat, one row
    per assignment on another node (network) or on another rank of node 0 (NVLink); hierarchical,
    one row + 2k columns per other node used (network), then each assignment not on the receiving
    rank (local index 0 of its node) over NVLink. Enumerated on a scaled copy (16 experts, 4 per
    node would be too few for top-8: the ratios are checked on E = 64, k = 4, 8 x 8 ranks)."""
    cfg = _cfg("ddp128 ep64 pp16 dualpipe mb1x120 ac-full", 2048, dispatch, M)
    m = cfg.model
    m.n_experts, m.moe_top_k = 64, 4   # enumerable: C(64, 4) routings
    dev = get_device("h800")
    topo = Topology.from_config(cfg.parallel)
    N, L = ep_nodes(topo, dev)
    assert (N, L) == (8, 8)
    per_rank, per_node = m.n_experts // 64, m.n_experts // 8
    routes = _routes(m.n_experts, m.moe_top_k, N, m.moe_node_groups if M else 0, M)  # (routings, k)
    node = routes // per_node
    if dispatch == "exact":
        slow = float((node != 0).sum())
        fast = float(((node == 0) & (routes // per_rank != 0)).sum())
    else:
        used = torch.zeros(len(routes), N, dtype=torch.bool).scatter_(1, node, True)  # the nodes each routing uses
        slow = float(used[:, 1:].sum()) * (1 + m.moe_top_k / m.d_model)  # 2k columns in 2 of 4 passes
        fast = float(((routes % per_node) // per_rank != 0).sum())
    tokens, el, row = 4096, 2, m.d_model * 2
    _, got = a2a_seconds(cfg, topo, dev, tokens, el)
    assert got["slow"] == pytest.approx(tokens * row * slow / len(routes), rel=1e-9)
    assert got["fast"] == pytest.approx(tokens * row * fast / len(routes), rel=1e-9)


def test_hierarchical_time_is_its_two_hops_and_flat_the_slower_tier():
    cfg = _cfg("ddp128 ep64 pp16 dualpipe mb1x120 ac-full", 2048, "exact", 4)
    dev, topo = get_device("h800"), Topology.from_config(cfg.parallel)
    t, b = a2a_seconds(cfg, topo, dev, 4096, 2)
    assert t == pytest.approx(12 * dev.inter_alpha + max(b["slow"] / dev.inter_bw, b["fast"] / dev.intra_bw))
    cfg.parallel.ep_dispatch = "hierarchical"
    t, b = a2a_seconds(cfg, topo, dev, 4096, 2)
    assert t == pytest.approx(6 * dev.inter_alpha + b["slow"] / dev.inter_bw + 6 * dev.intra_alpha + b["fast"] / dev.intra_bw)


@pytest.mark.parametrize("schedule,pp,m", [("dualpipe", 4, 8), ("dualpipe", 8, 16), ("dualpipe", 16, 120),
                                           ("dualpipe", 8, 40), ("dualpipev", 4, 8), ("dualpipev", 16, 120)])
def test_paired_share_counts_the_engines_dualpipe_order(schedule, pp, m):
    """DualPipe's F&B pairs in the engine's order for rank 0 (dualpipe._rank_order, as
    dualpipe.dualpipe / dualpipev call it for rank 0): a forward followed at once by a plain
    backward (zero-bubble backwards, whose W is deferred, are not overlapped pairs)."""
    ref = _rank_order(pp // 2, 0, m // 2) if schedule == "dualpipe" else _rank_order(pp, 0, m)
    rank0 = (dualpipe if schedule == "dualpipe" else dualpipev)(pp, m)[0]
    assert sum(a[0] == "F" for a in rank0) == sum(o[0] == "F" for o in ref)
    pairs = sum(1 for a, b in zip(ref, ref[1:]) if a[0] == "F" and b[0] == "B" and not b[2])
    chunks = sum(1 for o in ref if o[0] in "FB")
    assert paired_share(schedule, pp, m) == pytest.approx(2 * pairs / chunks)


def test_tiers_apply_only_across_nodes():
    """An ep group inside one node keeps the one-link all-to-all: the tiers leave it unchanged."""
    cfg = _cfg("ddp256 ep8 pp8 1f1b mb1x60 ac-full", 2048)
    assert ep_nodes(Topology.from_config(cfg.parallel), with_nodes(get_device("h800"), 8))[0] == 1
    assert predict(cfg, "h800", per_rank=False).breakdown["ep_tiers"] == {}


def _run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(list(argv))
    return code, out.getvalue()


def test_deepseek_plan_prints_the_tiers_and_the_overlap_hides_all_to_all(capsys):
    layout = "ddp128 ep64 pp16 dualpipe mb1x120 ac-full"
    code, plain = _run("plan", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--layout", layout)
    _, overlap = _run("plan", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--layout", layout,
                      "--dualpipe-overlap")
    assert "expert all-to-all over 8 nodes x 8 ranks" in plain and code == 1  # the fp32 DDP stage is over 92%
    exposed = [float(line.split()[-3]) for out in (plain, overlap) for line in out.splitlines() if "exposed" in line]
    assert exposed[1] < exposed[0]
    code = cli.main(["plan", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--layout",
                     "ddp128 ep64 pp16 1f1b mb1x120 ac-full", "--dualpipe-overlap"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("config error: --dualpipe-overlap")


@pytest.mark.parametrize("label,dispatch", [("ddp128 ep64-hier pp16:dualpipev mb1x120 ac-full", "hierarchical"),
                                            ("ddp128 ep64 pp16:dualpipe mb1x120 ac-full", "exact")])
def test_the_dispatch_in_a_layout_and_its_label(label, dispatch):
    """``epN-hier`` sets parallel.ep_dispatch (plain ``epN`` keeps the config's), and the search's
    label prints it back: a printed label parses to the same layout."""
    base = load_model("deepseek-v3")
    base.parallel.ep_dispatch = "exact"
    cfg = apply_layout(base, parse_layout(label), 2048)
    from shardlab.analysis.plan_search import layout_label
    assert cfg.parallel.ep_dispatch == dispatch and layout_label(cfg) == label
