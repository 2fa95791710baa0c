"""Context parallel: ring attention over a load-balanced split of the sequence (cp rank i holds
chunks i and 2cp-1-i of 2cp), K/V blocks travelling around the ring while each pair is computed,
partial results merged by the online softmax (docs/context-parallel.md)."""
from __future__ import annotations

import math
import time

import torch
from torch import nn

from ..config import register_check
from ..distributed.eager import eager
from . import lse_kernel


# -- the load-balanced split ---------------------------------------------------------------------

def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(t: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's 2 of the 2*cp chunks of ``t`` along ``dim``, concatenated."""
    if cp == 1:
        return t
    if t.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {t.shape[dim]} is not divisible by 2*cp={2 * cp}; "
                         f"set train.seq_len to a multiple of {2 * cp}")
    chunks = t.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the per-rank pieces (in cp rank order) -> the full tensor."""
    cp = len(parts)
    chunks: list = [None] * (2 * cp)
    for i, part in enumerate(parts):
        a, b = chunk_ids(i, cp)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def positions(local_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens a cp rank holds."""
    c = local_len // 2
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                      torch.arange(b * c, (b + 1) * c, device=device)])


def shard_batch(tokens: torch.Tensor, targets: torch.Tensor, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """What the train loop calls on each (tokens, targets) micro-batch of shape (B, S)."""
    cp, r = mesh.size("cp"), mesh.local_rank("cp")
    return shard_sequence(tokens, r, cp), shard_sequence(targets, r, cp)


# -- block attention and the online-softmax merge -------------------------------------------------

def _pairs(q_ids, k_ids, causal: bool):
    """(query chunk slot, key chunk slot, diagonal?) for the chunk pairs that need computing."""
    for qi, qa in enumerate(q_ids):
        for ki, kb in enumerate(k_ids):
            if causal and kb > qa:
                continue
            yield qi, ki, causal and kb == qa


def _repeat(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


KERNEL = "auto"
"""auto: the fused kernel of lse_kernel.py where one exists, else the hand-written tiles below;
manual: always the hand-written tiles (the tests check both paths)."""

TILE = 128
"""Query rows per score tile: a pair of chunks is computed in (TILE x c) pieces, so the
transient score memory is bounded by a few TILE * c per head instead of c * c."""


def _scores(q, k, scale, diag, r0):
    """Scores of query rows r0.. of a chunk against a whole key chunk; ``diag`` masks keys after
    the query (same chunk)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if diag:
        rows, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(rows, n, dtype=torch.bool, device=s.device).triu(1 + r0), float("-inf"))
    return s


def _kernel(q) -> bool:
    return KERNEL == "auto" and lse_kernel.available(q)


def _pair_forward(q, k, v, scale, diag):
    """Attention of query chunk q over key chunk (k, v): (out, lse), by the kernel or in row tiles."""
    if _kernel(q):
        return lse_kernel.forward(q, k, v, scale, diag)
    outs, lses = [], []
    for r0 in range(0, q.shape[2], TILE):
        s = _scores(q[:, :, r0:r0 + TILE], k, scale, diag, r0)
        lse = torch.logsumexp(s, -1)
        outs.append(torch.exp(s - lse[..., None]) @ v)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _pair_backward(q, k, v, do, out, lse, delta, scale, diag, dq):
    """Adds this pair's dQ into ``dq``; returns (dK, dV) of the key chunk. ``out``, ``lse``,
    ``delta``: the final values of the query rows. Kernel or row tiles, as forward."""
    if _kernel(q):
        dq_pair, dk, dv = lse_kernel.backward(do, q, k, v, out, lse, scale, diag)
        dq += dq_pair
        return dk, dv
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r0 in range(0, q.shape[2], TILE):
        rows = slice(r0, r0 + TILE)
        qt, dot = q[:, :, rows], do[:, :, rows]
        p = torch.exp(_scores(qt, k, scale, diag, r0) - lse[:, :, rows, None])
        dv += p.transpose(-1, -2) @ dot
        ds = p * (dot @ v.transpose(-1, -2) - delta[:, :, rows, None])
        dq[:, :, rows] += (ds @ k) * scale
        dk += (ds.transpose(-1, -2) @ qt) * scale
    return dk, dv


def _merge(acc, out, lse):
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    return acc_out * torch.exp(acc_lse - new)[..., None] + out * torch.exp(lse - new)[..., None], new


class _RingAttention(torch.autograd.Function):
    """q: (B, Hq, 2c, D); k, v: (B, Hkv, 2c, D) -- this rank's two chunks."""

    @staticmethod
    def forward(ctx, q, k, v, causal, comm, stats):
        cp, r = comm.size, comm.rank
        rep, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qc, q_ids = q.chunk(2, dim=2), chunk_ids(r, cp)
        acc = [None, None]
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            reqs = []
            if step < cp - 1:  # next block's transfer overlaps this block's compute
                nxt = torch.empty_like(kv)
                reqs = comm.exchange([(kv, (r + 1) % cp)], [(nxt, (r - 1) % cp)])
                _mark(stats, "fwd_posts", time.perf_counter())
            k_ids = chunk_ids((r - step) % cp, cp)
            kc, vc = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for qi, ki, diag in _pairs(q_ids, k_ids, causal):
                out, lse = _pair_forward(qc[qi], _repeat(kc[ki], rep), _repeat(vc[ki], rep), scale, diag)
                acc[qi] = _merge(acc[qi], out, lse)
            waited = _wait(reqs, stats)
            if step < cp - 1:
                _mark(stats, "fwd_waits", waited)
                kv = nxt
        out = torch.cat([acc[0][0], acc[1][0]], dim=2)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.comm, ctx.stats = causal, comm, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, stats = ctx.comm, ctx.causal, ctx.stats
        cp, r = comm.size, comm.rank
        nxt_rank, prev_rank = (r + 1) % cp, (r - 1) % cp
        rep, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)                                     # D = rowsum(dO * O)
        qc, doc, lsec, dc = q.chunk(2, 2), dout.chunk(2, 2), lse.chunk(2, 2), delta.chunk(2, 2)
        oc = out.chunk(2, 2)
        q_ids = chunk_ids(r, cp)
        dq = [torch.zeros_like(x) for x in qc]
        kv = torch.stack([k, v]).contiguous()
        # Rank r sends rank r+1 two streams: K/V blocks and partial dK/dV sums. Messages are matched
        # by issue order only (never by tag), so both sides issue them in one fixed order:
        # kv_0 | dkv_0, kv_1 | dkv_1, kv_2 | ... | dkv_cp-1 (dkv_s: the sums of block kv_s).
        passing = None  # the previous step's dK/dV, sent on together with this step's K/V
        for step in range(cp):
            sends, recvs = [], []
            if passing is not None:  # the partial dK/dV of this block from the ranks that held it before
                incoming = torch.empty_like(kv)
                sends.append((passing, nxt_rank))
                recvs.append((incoming, prev_rank))
            if step < cp - 1:
                nxt = torch.empty_like(kv)
                sends.append((kv, nxt_rank))
                recvs.append((nxt, prev_rank))
            reqs = comm.exchange(sends, recvs)
            _mark(stats, "bwd_posts", time.perf_counter())
            if passing is not None:
                _mark(stats, "bwd_dkv_posts", stats["bwd_posts"][-1])
            k_ids = chunk_ids((r - step) % cp, cp)
            kc, vc = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            dkv = torch.zeros_like(kv)
            dkc, dvc = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
            for qi, ki, diag in _pairs(q_ids, k_ids, causal):
                dk_blk, dv_blk = _pair_backward(qc[qi], _repeat(kc[ki], rep), _repeat(vc[ki], rep), doc[qi],
                                                oc[qi], lsec[qi], dc[qi], scale, diag, dq[qi])
                if rep > 1:  # sum the gradients of the repeated key/value heads
                    dk_blk = dk_blk.unflatten(1, (-1, rep)).sum(2)
                    dv_blk = dv_blk.unflatten(1, (-1, rep)).sum(2)
                dkc[ki].add_(dk_blk)
                dvc[ki].add_(dv_blk)
            _mark(stats, "bwd_waits", _wait(reqs, stats))
            if passing is not None:
                dkv += incoming
            if cp > 1:  # pass the block's gradient on, one hop behind the block itself
                passing = dkv
            if step < cp - 1:
                kv = nxt
        if cp > 1:  # after cp hops the complete dK/dV of our own block comes back to us
            dkv = torch.empty_like(kv)
            final = comm.exchange([(passing, nxt_rank)], [(dkv, prev_rank)])
            _mark(stats, "bwd_final_post", time.perf_counter())
            _mark(stats, "bwd_dkv_posts", stats["bwd_final_post"][-1])
            _mark(stats, "bwd_final_wait", _wait(final, stats))
        return torch.cat(dq, dim=2), dkv[0], dkv[1], None, None, None


def _mark(stats, key, value):
    """Timeline for the benchmark's overlap analysis (post and wait times per ring step)."""
    stats.setdefault(key, []).append(value)


def _wait(reqs, stats):
    """Wait for the ring transfers; ``stats["wait_s"]`` adds the seconds spent blocked.
    Returns (start, end) of the wait (perf_counter: one clock for all processes of a host)."""
    t0 = time.perf_counter()
    for req in reqs:
        req.wait()
    t1 = time.perf_counter()
    stats["wait_s"] = stats.get("wait_s", 0.0) + t1 - t0
    return t0, t1


@eager  # its ring's transfers run eagerly inside a compiled block (distributed/eager.py)
def ring_attention(q, k, v, comm, causal: bool = True, stats: dict | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole (load-balanced, sharded) sequence."""
    return _RingAttention.apply(q, k, v, causal, comm, {} if stats is None else stats)


class RingAttention(nn.Module):
    """Drop-in for ``layers.<i>.attention.core``. ``self.stats`` belongs to the latest call (its
    forward and, once run, its backward): ``wait_s`` = seconds blocked on the ring, plus the
    post/wait timeline the benchmark analyses."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm
        self.stats: dict = {}

    def forward(self, q, k, v, causal: bool = True):
        self.stats = {}  # a fresh record per call: nothing accumulates over a long run
        # Under autocast the ring runs in fp32 with autocast off (its hand-written backward would
        # otherwise mix bf16/fp16 matmul results with fp32 saved tensors).
        with torch.autocast(q.device.type, enabled=False):
            if q.dtype in (torch.float16, torch.bfloat16):
                return ring_attention(q.float(), k.float(), v.float(), self.comm, causal, self.stats).to(q.dtype)
            return ring_attention(q, k, v, self.comm, causal, self.stats)


def positions_hook(comm):
    """Forward pre-hook giving the model the global positions of this cp rank's tokens."""
    def hook(module, args, kwargs):
        if len(args) > 2 or kwargs.get("positions") is not None:
            return None
        tokens = args[0] if args else kwargs["tokens"]
        kwargs = dict(kwargs, positions=positions(tokens.shape[1], comm.rank, comm.size, tokens.device))
        return args, kwargs
    return hook


@register_check
def check_config(cfg) -> None:
    """Load balancing cuts every sequence into 2*cp chunks (called by ``validate``, which also
    calls ulysses.check_config: Ulysses' head constraints)."""
    from ..errors import ConfigError
    cp, seq = cfg.parallel.cp, cfg.train.seq_len
    if cp > 1 and seq % (2 * cp):
        raise ConfigError("train.seq_len", f"{seq} must be divisible by 2*cp={2 * cp} for load-balanced "
                                           "context parallel")
    u = {"ring": 1, "ulysses": cp, "unified": cfg.parallel.cp_ulysses}.get(cfg.parallel.cp_impl, 1)
    if cp // u > 1 and cfg.model.attention != "sdpa":
        raise ConfigError("model.attention", f"{cfg.model.attention!r} cannot run under ring context parallel "
                                             "(the ring has its own kernel); set parallel.cp_impl = \"ulysses\" or "
                                             "model.attention = \"sdpa\"")


def apply(model: nn.Module, mesh, cfg=None, cores=None) -> nn.Module:
    """Swap every attention core ``cores`` = [(owner, attribute)] for ring attention over ``cp``
    and make the model read its tokens as this rank's load-balanced shard (positions added by a
    forward pre-hook). ``parallel.cp_impl`` ulysses / unified: ulysses.apply instead (parallelize.py
    picks; ulysses builds on this module)."""
    comm = mesh.comm("cp")
    if comm.size == 1:
        return model
    if cfg is not None and cfg.train.seq_len % (2 * comm.size):
        raise ValueError(f"train.seq_len={cfg.train.seq_len} must be divisible by 2*cp={2 * comm.size}")
    for owner, attr in cores:  # the spec's attention cores (ModelSpec.attention)
        setattr(owner, attr, RingAttention(comm))
    model.register_forward_pre_hook(positions_hook(comm), with_kwargs=True)
    return model
