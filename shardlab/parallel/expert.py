"""Expert parallel: the experts of each MoE layer spread over the ``ep`` group (ep rank q keeps
experts [q E/ep, (q+1) E/ep)), tokens moved to them and back by all-to-all (``parallel.ep_dispatch``
padded, exact or hierarchical), MoE aux losses over the global batch (docs/expert-parallel.md)."""
from __future__ import annotations

import time

import torch
from torch import nn

from ..config import register_check
from ..distributed.autograd import all_to_all, sum_over_ranks
from ..distributed.lanes import exchange
from ..errors import ConfigError
from ..distributed.placement import Placement, set_placement
from ..models.init import meta_device
from ..models.moe import MoE, Experts
from ..models.moe_gemm import padded_slots
from .expert_hier import Hierarchy, hierarchical_moe
from .expert_overlap import hierarchical_overlapped, overlapped_experts


class ExpertParallelMoE(MoE):
    """An MoE layer whose experts live on the ep ranks. Parameter names are unchanged."""

    def __init__(self, moe: MoE, mesh, model_cfg, prefix: str, dispatch: str = "padded", overlap: int = 0):
        with meta_device():
            super().__init__(model_cfg)
        self.router = moe.router
        self.ep, self.batch = mesh.comm("ep"), mesh.comm("dp_cp")
        E, ep = self.n_experts, self.ep.size
        self.n_local, self.first = E // ep, self.ep.rank * (E // ep)
        self.padded = padded_dispatch(dispatch, self.capacity_factor)
        self.hier = Hierarchy(mesh, E) if dispatch == "hierarchical" and ep > 1 else None
        self.split = overlap if overlap > 1 and ep > 1 and self.hier is None else 1  # chunks, expert_overlap.py
        self.hier_chunks = overlap if overlap > 1 and self.hier is not None else 1    # lanes, expert_overlap.py
        src = moe.experts
        self.experts = Experts(self.n_local, src.w1.shape[2], src.w1.shape[1], src.impl)
        for name in ("w1", "w2", "w3"):
            full = getattr(src, name)
            local = nn.Parameter(full.detach()[self.first:self.first + self.n_local].clone())
            set_placement(local, Placement(f"{prefix}.experts.{name}", tuple(full.shape), 0, self.first,
                                           self.n_local, ("ep",)))
            setattr(self.experts, name, local)
        self.timing = {"dispatch_s": 0.0, "experts_s": 0.0, "combine_s": 0.0, "calls": 0}

    def forward(self, x):
        if self.hier is None:
            return super().forward(x)
        flat = x.reshape(-1, x.shape[-1])
        r = self.last_routing = self.route(flat)
        if self.hier_chunks > 1:
            out = hierarchical_overlapped(self, self.hier, flat, r, self.capacity(flat.shape[0]), self.hier_chunks)
            return out.view(x.shape)
        return hierarchical_moe(self, self.hier, flat, r, self.capacity(flat.shape[0])).view(x.shape)

    def batch_sum(self, t):
        return sum_over_ranks(t, self.batch)

    def run_experts(self, x, counts, capacity=0):
        ep, n_local = self.ep.size, self.n_local
        if counts.dim() == 2:
            return overlapped_experts(self, x, counts, capacity)
        t0 = time.perf_counter()
        if ep == 1:
            out = self.experts(x, counts, capacity)
            t1 = time.perf_counter()
            self._time(t0, t0, t1, t1)
            return out
        send = counts.view(ep, n_local)
        recv = exchange(self.ep, send.contiguous())                  # row s: counts from rank s
        # received rows come as [source 0: expert 0 rows, expert 1 rows, ...][source 1: ...]; the
        # experts want them by expert: key (source s, expert e) -> e*ep + s
        block = torch.arange(ep * n_local, device=x.device).view(ep, n_local)
        key = (block % n_local) * ep + block // n_local
        if self.padded:
            # GShard's dispatch: every (rank, expert) block padded to the capacity C, so the
            # all-to-alls have fixed equal splits (E C rows each way) and nothing is read on the
            # host; the padding sorts last and the experts skip it (they get the received counts)
            C = capacity                                              # the layer's, per rank
            slot = padded_slots(counts, x.shape[0], C)                # kept row -> e C + position
            buf = x.new_zeros(self.n_experts * C + 1, x.shape[1]).index_copy(0, slot, x)
            rows = all_to_all(buf[:-1], self.ep)                        # [source s][local expert e][C]
            valid = (torch.arange(C, device=x.device) < recv[:, :, None]).flatten()
            key = torch.where(valid, key[:, :, None].expand(ep, n_local, C).flatten(), ep * n_local)
            in_splits = out_splits = None
        else:
            # the one host read of the layer: all-to-all needs its split sizes
            in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
            total, arrived = sum(in_splits), sum(out_splits)
            rows = all_to_all(x[:total], self.ep, in_splits, out_splits)  # dispatch (dropped rows stay)
            key = torch.repeat_interleave(key.flatten(), recv.flatten(), output_size=arrived)
        perm = torch.argsort(key, stable=True)
        t1 = time.perf_counter()
        # a local expert takes at most ``capacity`` rows from each of the ep ranks
        y = self.experts(rows[perm], recv.sum(0), ep * capacity)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=x.device)
        y = y[back]                                                    # back to arrival order
        t2 = time.perf_counter()
        out = all_to_all(y, self.ep, out_splits, in_splits)           # combine: rows as they were sent
        self._time(t0, t1, t2, time.perf_counter())
        if self.padded:
            return torch.cat([out, out.new_zeros(1, out.shape[1])]).index_select(0, slot)
        return torch.cat([out, out.new_zeros(x.shape[0] - total, out.shape[1])])

    def _time(self, t0, t1, t2, t3):
        tm = self.timing
        tm["dispatch_s"] += t1 - t0
        tm["experts_s"] += t2 - t1
        tm["combine_s"] += t3 - t2
        tm["calls"] += 1


def padded_dispatch(dispatch: str, capacity_factor: float) -> bool:
    """Whether the all-to-all pads every (rank, expert) block to the capacity: ``parallel.ep_dispatch
    = padded`` with a capacity (dropless has none to pad to, so it always sends the exact rows)."""
    return dispatch == "padded" and capacity_factor > 0


def moe_layers(model: nn.Module):
    """(module name, MoE module) for every Mixture-of-Experts module of the model."""
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, MoE)]


@register_check
def check_config(cfg) -> None:
    """Expert-parallel constraints (called by ``validate``)."""
    from ..errors import require
    m, p = cfg.model, cfg.parallel
    require((p.dp_shard * p.cp) % p.ep == 0, "parallel.ep",
            f"ep={p.ep} must divide dp_shard*cp={p.dp_shard * p.cp} (experts borrow data-parallel ranks)")
    require(p.ep == 1 or m.n_experts > 0, "parallel.ep", "ep > 1 needs an MoE model (model.n_experts > 0)")
    if m.n_experts:
        require(m.n_experts % p.ep == 0, "model.n_experts", f"{m.n_experts} experts do not divide among ep={p.ep}")
        require(1 <= m.moe_top_k <= m.n_experts, "model.moe_top_k", f"must be in 1..n_experts={m.n_experts}")
    _check_tiers(m, p)


def _check_tiers(m, p) -> None:
    """Simulated nodes, node-limited routing, the hierarchical dispatch and overlap."""
    from ..errors import require
    from ..distributed.topology import Topology
    require(p.world_size % p.sim_nodes == 0, "parallel.sim_nodes",
            f"{p.sim_nodes} nodes do not divide the world of {p.world_size} ranks; choose a divisor")
    try:
        topo = Topology.from_config(p)
    except ValueError as e:
        raise ConfigError("parallel.sim_nodes", str(e).removeprefix("topology: ")) from None
    G, M = m.moe_node_groups, m.moe_max_nodes
    require(M == 0 or (m.n_experts and G), "model.moe_max_nodes",
            "node-limited routing needs an MoE model with expert groups: set model.moe_node_groups too")
    if G:
        require(m.n_experts % G == 0, "model.moe_node_groups", f"{G} groups do not divide {m.n_experts} experts")
        require(M <= G, "model.moe_max_nodes", f"{M} exceeds the {G} expert groups; use at most {G}")
        require(m.moe_top_k <= max(M, 1) * m.n_experts // G or not M, "model.moe_top_k",
                f"top {m.moe_top_k} experts do not fit in {M} groups of {m.n_experts // G}; raise moe_max_nodes")
        spanned = topo.size("ep_inter")
        require(G % spanned == 0, "model.moe_node_groups",
                f"{G} groups cannot each sit on one of the {spanned} nodes an ep group spans; use a multiple of {spanned}")
    require(p.ep_overlap != 1, "parallel.ep_overlap", "one chunk overlaps nothing; use 0 (off) or 2 or more chunks")


def apply(model: nn.Module, mesh, cfg) -> nn.Module:
    """Place each MoE layer's experts over ``ep`` and make its auxiliary losses batch-wide."""
    if mesh.size("ep") == 1 and mesh.size("dp_cp") == 1:
        return model
    for name, moe in moe_layers(model):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr,
                ExpertParallelMoE(moe, mesh, cfg.model, name, cfg.parallel.ep_dispatch, cfg.parallel.ep_overlap))
    return model


def moe_metrics(model: nn.Module, ledger_entries: dict | None = None) -> dict:
    """Per-step MoE metrics: tokens per expert and dropped fraction of each MoE layer (global
    batch, from the last forward) and the all-to-all bytes sent, also those of the hierarchical
    dispatch's two tiers (from ledger entries, e.g. ``mesh.ledger.since(snapshot)``)."""
    out: dict = {}
    drops = []
    for name, moe in moe_layers(model):
        st = moe.last_stats
        if st:
            key = name.removeprefix("layers.").removesuffix(".feed_forward")
            out[f"moe/{key}/tokens_per_expert"] = st["tokens_per_expert"].tolist()
            out[f"moe/{key}/dropped_fraction"] = st["dropped_fraction"]
            drops.append(st["dropped_fraction"])
    if drops:
        out["moe/dropped_fraction"] = sum(drops) / len(drops)
    if ledger_entries is not None:
        a2a = [e for (op, g), e in ledger_entries.items() if op == "all_to_all" and g in ("ep", "ep_intra", "ep_inter")]
        out["moe/all_to_all_bytes"] = sum(e.bytes_sent for e in a2a)
    return out
