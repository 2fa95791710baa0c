"""Ulysses (DeepSpeed-Ulysses) context parallel, alone or inside ring attention ("unified", 2-D):
an all-to-all from (my tokens, all heads) to (all tokens, H/u heads) around the attention kernel
(docs/context-parallel.md, Ulysses and unified)."""
from __future__ import annotations

import torch
from torch import nn

from ..config import register_check
from ..distributed import autograd as dist_ag
from . import context


def degree(parallel) -> int:
    """The Ulysses degree the config asks for (1: plain ring attention)."""
    return {"ulysses": parallel.cp, "unified": parallel.cp_ulysses}.get(parallel.cp_impl, 1)


@register_check
def check_config(cfg) -> None:
    """Heads must split over the Ulysses degree (called by ``validate``)."""
    from ..errors import require
    p, m = cfg.parallel, cfg.model
    require(p.cp_impl == "unified" or p.cp_ulysses == 1, "parallel.cp_ulysses",
            f"{p.cp_ulysses} only applies to parallel.cp_impl=unified (now {p.cp_impl}); set it to 1")
    if p.cp_impl == "unified":
        require(p.cp % p.cp_ulysses == 0, "parallel.cp_ulysses",
                f"{p.cp_ulysses} must divide parallel.cp={p.cp}; choose a divisor of cp")
    u = degree(p)
    if u == 1:
        return
    field = "parallel.cp_ulysses" if p.cp_impl == "unified" else "parallel.cp"
    heads, kv = m.n_heads // p.tp, m.kv_heads // p.tp
    where = f" per tp rank (n_heads/tp = {m.n_heads}/{p.tp})" if p.tp > 1 else ""
    require(m.n_heads % p.tp == 0 and heads % u == 0, field,
            f"Ulysses degree {u} must divide the attention heads{where}: {heads} query heads; choose a "
            f"Ulysses degree dividing {heads} (parallel.cp_impl=unified with a smaller cp_ulysses, or ring)")
    require(kv % u == 0 or u % kv == 0, field,
            f"Ulysses degree {u} and {kv} kv heads{' per tp rank' if p.tp > 1 else ''}: one must divide the "
            f"other (kv heads are split, or repeated when fewer than the degree); choose a Ulysses degree "
            f"that divides or is a multiple of {kv}")


def _orders(n_local: int, u: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(natural, zigzag) index vectors over the u * n_local tokens of a group: ``cat[natural]``
    is the natural order of the rank-ordered concatenation ``cat``; ``nat[zigzag]`` inverts it."""
    pieces = [context.shard_sequence(torch.arange(u * n_local), j, u, dim=0) for j in range(u)]
    zigzag = torch.cat(pieces)  # cat position i holds natural token zigzag[i]
    return torch.argsort(zigzag).to(device), zigzag.to(device)


def seq_to_heads(x: torch.Tensor, comm, natural: torch.Tensor) -> torch.Tensor:
    """(B, H, s, D) with my tokens and all heads -> (B, H/u, u*s, D): the group's tokens in
    natural order, my head slice (heads j*H/u .. (j+1)*H/u - 1 on group rank j)."""
    u = comm.size
    b, h, s, d = x.shape
    send = x.reshape(b, u, h // u, s, d).transpose(0, 1).contiguous()  # slice j goes to rank j
    recv = dist_ag.all_to_all(send.reshape(u * b, h // u, s, d), comm)  # piece j from rank j
    cat = recv.reshape(u, b, h // u, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)
    return cat.index_select(2, natural)


def heads_to_seq(y: torch.Tensor, comm, zigzag: torch.Tensor) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: (B, H/u, u*s, D) natural order -> (B, H, s, D) my tokens."""
    u = comm.size
    b, hl, n, d = y.shape
    s = n // u
    cat = y.index_select(2, zigzag).reshape(b, hl, u, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = dist_ag.all_to_all(cat.reshape(u * b, hl, s, d), comm)  # rank j's tokens of my heads
    return recv.reshape(u, b, hl, s, d).transpose(0, 1).reshape(b, u * hl, s, d)


class UlyssesAttention(nn.Module):
    """Drop-in for an attention core: all-to-all around ``inner`` (the model's own core, or ring
    attention over the cp_ring group under unified context parallel)."""

    def __init__(self, comm, inner: nn.Module):
        super().__init__()
        self.comm, self.inner = comm, inner
        self._orders: dict = {}

    def forward(self, q, k, v, causal: bool = True):
        u = self.comm.size
        if u == 1:
            return self.inner(q, k, v, causal=causal)
        hkv = k.shape[1]
        if hkv < u:  # GQA with fewer kv heads than ranks: each rank gets the one kv head it uses
            k, v = k.repeat_interleave(u // hkv, dim=1), v.repeat_interleave(u // hkv, dim=1)
        key = (q.shape[2], q.device)
        if key not in self._orders:
            self._orders[key] = _orders(q.shape[2], u, q.device)
        natural, zigzag = self._orders[key]
        qh, kh, vh = (seq_to_heads(t, self.comm, natural) for t in (q, k, v))
        return heads_to_seq(self.inner(qh, kh, vh, causal=causal), self.comm, zigzag)


def apply(model: nn.Module, mesh, cfg, cores) -> nn.Module:
    """Wrap every attention core in ``cores`` = [(owner, attribute)] with the Ulysses all-to-all
    (over ``cp``, or ``cp_ulysses`` with ring attention over ``cp_ring`` inside), and make the model
    read its tokens as this rank's load-balanced shard (context.py's positions hook)."""
    unified = cfg.parallel.cp_impl == "unified"
    comm = mesh.comm("cp_ulysses" if unified else "cp")
    ring = mesh.comm("cp_ring") if unified else None
    for owner, attr in cores:
        inner = context.RingAttention(ring) if ring is not None and ring.size > 1 else getattr(owner, attr)
        setattr(owner, attr, UlyssesAttention(comm, inner))
    model.register_forward_pre_hook(context.positions_hook(mesh.comm("cp")), with_kwargs=True)
    return model
