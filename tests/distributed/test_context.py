"""Context parallel (ring attention, load-balanced causal split) against full attention and the
plain model on one process. float64, CPU gloo."""
import contextlib

import torch
import torch.distributed as dist

from shardlab.config import Config, ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel import context
from shardlab.parallelize import parallelize

ATOL = 1e-10


def full_attention(q, k, v, causal):
    """Independent reference: softmax(q k^T / sqrt(d)) v with repeated kv heads, one process."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


@contextlib.contextmanager
def equal_tags(seen: set):
    """NCCL's matching on gloo: every point-to-point message of this process goes out and is
    received with tag 0, whatever tag its caller passed (``seen`` collects the tags asked for).
    Then only the issue order can pair a send with its receive, as under NCCL."""
    pg = dist.ProcessGroup
    send, recv = pg.send, pg.recv

    def forced(fn):
        def call(self, tensors, peer, tag):
            seen.add(tag)
            return fn(self, tensors, peer, 0)
        return call
    pg.send, pg.recv = forced(send), forced(recv)
    try:
        yield seen
    finally:
        pg.send, pg.recv = send, recv


def _attention_checks(mesh, results):
    comm = mesh.comm("cp")
    cp, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, S, D = 2, 4, 2, 8 * cp, 8
    q, k, v, dout = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq))
    # auto: the fused lse kernel (lse_kernel.py); manual, tile 3: hand-written chunk pairs in row tiles
    for causal, tile, kernel in ((True, 128, "auto"), (False, 128, "auto"), (True, 3, "manual")):
        context.TILE, context.KERNEL = tile, kernel
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = full_attention(*ref_in, causal)
        ref.backward(dout)
        loc = [context.shard_sequence(t, r, cp, dim=2).requires_grad_() for t in (q, k, v)]
        before = mesh.ledger.total_sent("cp")
        out = context.ring_attention(*loc, comm, causal)
        fwd_bytes = mesh.ledger.total_sent("cp") - before
        out.backward(context.shard_sequence(dout, r, cp, dim=2))
        bwd_bytes = mesh.ledger.total_sent("cp") - before - fwd_bytes
        err = (out - context.shard_sequence(ref, r, cp, dim=2)).abs().max().item()
        for name, a, b in zip("qkv", loc, ref_in):
            err = max(err, (a.grad - context.shard_sequence(b.grad, r, cp, dim=2)).abs().max().item())
        block = 2 * B * Hkv * (S // cp) * D * 8  # one K/V block in bytes
        results[f"attn causal={causal} tile={tile} {kernel}"] = (err, fwd_bytes == (cp - 1) * block,
                                                        bwd_bytes == (cp - 1) * block + cp * block)
    context.TILE, context.KERNEL = 128, "auto"


def _train_step_check(mesh, name, results):
    """One AdamW step of the plain model on the whole batch vs the cp x dp run."""
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_hidden=64, max_seq_len=32)
    cfg.train.seq_len = 32
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, 64, (4, 33), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    ref = build_model(cfg.model, seed=2, dtype=torch.float64)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    ref_opt.step()

    for key, value in mesh.topology.__dict__.items():
        setattr(cfg.parallel, key, value)
    engine = parallelize(build_model(cfg.model, seed=2, dtype=torch.float64), mesh, cfg)
    model = engine.model
    dp, dpi = mesh.size("dp"), mesh.local_rank("dp")
    b = tokens.shape[0] // dp
    x, y = tokens[dpi * b:(dpi + 1) * b], targets[dpi * b:(dpi + 1) * b]  # the engine cuts the cp shard
    loss = engine.global_loss(engine.forward_backward([(x, y)]))
    grad_err = max((p.grad - rp.grad).abs().max().item()
                   for p, rp in zip(model.parameters(), ref.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    param_err = max((p - rp).abs().max().item() for p, rp in zip(model.parameters(), ref.parameters()))
    results[name] = (abs(loss - ref_loss.item()), grad_err, param_err)


def worker(ctx, topologies):
    results = {}
    for topo in topologies:
        mesh = Mesh.build(Topology(**topo))
        tag = "x".join(f"{k}{v}" for k, v in topo.items())
        if mesh.size("dp") == 1:
            sub = {}
            _attention_checks(mesh, sub)
            results.update({f"{tag} {k}": v for k, v in sub.items()})
        _train_step_check(mesh, f"{tag} train step", results)
    return results


def _check(results):
    for name, vals in results.items():
        if name.endswith("train step"):
            assert max(vals) <= ATOL, (name, vals)
        else:
            err, fwd_ok, bwd_ok = vals
            assert err <= ATOL, (name, err)
            assert fwd_ok and bwd_ok, (name, "ring bytes differ from (cp-1) blocks fwd, (2cp-1) bwd")


def test_ring_attention_and_train_step_cp2():
    for res in run(worker, 2, [dict(cp=2)]):
        _check(res)


def test_ring_attention_cp4_and_cp2_dp2():
    res = run(worker, 4, [dict(cp=4), dict(dp_shard=2, cp=2)])
    for r in res:
        assert len(r) == 5
        _check(r)


def _equal_tags_worker(ctx):
    mesh = Mesh.build(Topology(cp=4))
    results, seen = {}, set()
    with equal_tags(seen):
        _attention_checks(mesh, results)
    return results, seen


def test_ring_attention_cp4_backward_parity_with_all_tags_equal():
    """The cp=4 forward and backward (K/V and dK/dV both flowing r -> r+1) against full attention
    in float64, with every p2p tag forced to 0 (NCCL's matching by issue order). The tagged
    backward that posted the next K/V receive before the dK/dV one passed with tags and gave
    errors of order 1 here (2.05), with no error raised."""
    for results, seen in run(_equal_tags_worker, 4):
        assert len(results) == 3
        _check(results)
        assert seen == {0}, f"p2p tags asked for: {sorted(seen)} (shardlab's p2p API has no tags)"
