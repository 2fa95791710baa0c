"""Expert parallel over two tiers of links: the dispatch / combine time when the ep group spans
nodes (flat and hierarchical dispatch, node-limited routing) and DualPipe's overlapped F&B pairs
(docs/planner_deepseek.md, "The model")."""
from __future__ import annotations

import math


def ep_nodes(topo, dev) -> tuple[int, int]:
    """(N nodes, L ep ranks per node) of rank 0's ep group on ``dev``'s nodes."""
    # listing every group of a large world is slow; there rank 0's ep group is taken as its first ranks
    ranks = topo.group_of("ep", 0) if topo.world_size <= 4096 else list(range(topo.size("ep")))
    per = {}
    for r in ranks:
        per[r // dev.gpus_per_node] = per.get(r // dev.gpus_per_node, 0) + 1
    return len(per), max(per.values())


def nodes_hit(n_experts: int, k: int, nodes: int, groups: int = 0, max_groups: int = 0) -> float:
    """Expected distinct nodes among a token's k distinct experts, routing uniform over the experts
    it may use. With node-limited routing (``max_groups`` M of ``groups`` G, G a multiple of
    ``nodes``: whole groups per node, DeepSeek-V3's n_group = nodes): the M groups are a uniform
    draw of G, the k experts a uniform draw without replacement from their M E / G experts. Exact
    under that assumption: for each node, P(hit) = sum over c (its groups drawn, hypergeometric)
    of P(c) (1 - C(pool - c e, k) / C(pool, k)), e = E / G experts per group. Groups that do not
    tile the nodes are taken as no limit (more nodes hit: the slow tier's bound)."""
    k = min(k, n_experts)
    if not groups or not max_groups or max_groups >= groups or groups % nodes:
        groups, max_groups = nodes, nodes
    e = n_experts / groups
    pool = max_groups * e
    total = math.comb(groups, max_groups)
    p_hit = 0.0
    g_in = groups // nodes  # groups per node
    for c in range(0, min(g_in, max_groups) + 1):
        pc = math.comb(g_in, c) * math.comb(groups - g_in, max_groups - c) / total
        if c:
            p_hit += pc * (1 - _comb(pool - c * e, k) / _comb(pool, k))
    return nodes * p_hit


def _comb(n: float, k: int) -> float:
    """C(n, k) for real n >= 0 (falling factorial / k!)."""
    out = 1.0
    for i in range(k):
        out *= max(0.0, n - i) / (i + 1)
    return out


def rows_per_token(cfg, n: int, l: int) -> dict:
    """Rows per routed assignment (flat) or per token (hierarchical) and MoE layer pass on each
    tier: {"flat": (slow, fast) per assignment, "hierarchical": (slow, fast) per token,
    "nodes_hit": D}."""
    m = cfg.model
    k = m.moe_top_k
    d = nodes_hit(m.n_experts, k, n, m.moe_node_groups, m.moe_max_nodes)
    return {"flat": ((n - 1) / n, (l - 1) / (n * l)), "hierarchical": (d * (n - 1) / n, k * (l - 1) / l),
            "nodes_hit": d}


def a2a_seconds(cfg, topo, dev, tokens: int, el: int, assignments: float = 0.0) -> tuple[float, dict]:
    """Seconds of one dispatch (or combine) pass of ``tokens`` tokens on this rank over a two-tier
    ep group, and the bytes per tier: (seconds, {"slow": B, "fast": B, "nodes_hit": D, "N", "L"}).
    ``assignments``: the rows the flat dispatch sends (default tokens x k; the padded dispatch's
    E x C)."""
    p, m = cfg.parallel, cfg.model
    n, l = ep_nodes(topo, dev)
    rows = rows_per_token(cfg, n, l)
    row = m.d_model * el
    if p.ep_dispatch == "hierarchical":
        slow_rows, fast_rows = rows["hierarchical"]
        # gate weights and ids ride along (2k columns) in the dispatch and its gradient, not in the combine
        # and its gradient: k columns on average over the four passes the caller charges
        slow = tokens * slow_rows * (row + m.moe_top_k * el)
        fast = tokens * fast_rows * row
        t = (2 * math.log2(n) * dev.inter_alpha + slow / dev.inter_bw
             + (2 * math.log2(l) * dev.intra_alpha + fast / dev.intra_bw if l > 1 else 0.0))
    else:
        a = assignments or tokens * m.moe_top_k
        slow_rows, fast_rows = rows["flat"]
        slow, fast = a * slow_rows * row, a * fast_rows * row
        t = 2 * math.log2(p.ep) * dev.inter_alpha + max(slow / dev.inter_bw, fast / dev.intra_bw)
    return t, {"slow": slow, "fast": fast, "nodes_hit": rows["nodes_hit"], "N": n, "L": l}


def paired_share(schedule: str, pp: int, m: int) -> float:
    """Share of the forward and backward chunks that DualPipe's or DualPipeV's order
    (parallel/pipeline/dualpipe.py, DeepSeek's eight steps) runs in overlapped F&B pairs, on the
    rank with the fewest (rank 0: h = 0). DualPipe: p / 2 ranks per half, m / 2 micro-batches per
    chunk; DualPipeV: p and m."""
    n_half, n = (pp // 2, m // 2) if schedule == "dualpipe" else (pp, m)
    pairs = 2 * (n - 2 * n_half + 1) + (n_half - 1)  # step 4: F0&B1, F1&B0 each; step 5: F1&B0
    return max(0.0, min(1.0, 2 * pairs / (4 * n)))  # chunks in pairs over 2n forwards + 2n backwards
