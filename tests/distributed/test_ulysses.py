"""Ulysses and unified (Ulysses x ring) context parallel against full attention and the plain model
on one process. float64, CPU gloo."""
import torch

from shardlab.config import Config, ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.placement import get_placement
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.models.decoder import SDPA
from shardlab.parallel import context, ulysses
from shardlab.parallelize import parallelize
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

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


def _cfg(cp_impl="ring", **par):
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_hidden=64, max_seq_len=32)
    cfg.train.seq_len = 32
    cfg.parallel.cp_impl = cp_impl
    for key, value in par.items():
        setattr(cfg.parallel, key, value)
    cfg.parallel.microbatches = cfg.parallel.pp
    cfg.train.global_batch = 4
    return cfg.validate(cfg.parallel.world_size)


def _attention_check(mesh, cfg, hkv, results, tag):
    """The Ulysses core (around the model's SDPA, or ring attention under unified) on this rank's
    load-balanced shard vs full attention of the whole sequence: output and q/k/v gradients, and
    the all-to-all bytes (q, k, v, out forward; their gradients backward)."""
    cp = mesh.size("cp")
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.core = SDPA()
    ulysses.apply(model, mesh, cfg, [(model.attn, "core")])
    core = model.attn.core
    g = torch.Generator().manual_seed(7)
    B, Hq, S, D = 2, 4, 8 * cp, 8
    q, k, v, dout = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (Hq, hkv, hkv, Hq))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = full_attention(*ref_in, True)
    ref.backward(dout)
    r = mesh.local_rank("cp")
    loc = [context.shard_sequence(t, r, cp, dim=2).requires_grad_() for t in (q, k, v)]
    name = core.comm.name
    before = mesh.ledger.total_sent(name)
    out = core(*loc, causal=True)
    fwd = mesh.ledger.total_sent(name) - before
    out.backward(context.shard_sequence(dout, r, cp, dim=2))
    err = (out - context.shard_sequence(ref, r, cp, dim=2)).abs().max().item()
    for a, b in zip(loc, ref_in):
        err = max(err, (a.grad - context.shard_sequence(b.grad, r, cp, dim=2)).abs().max().item())
    u = core.comm.size
    kv_heads = max(hkv, u)  # fewer kv heads than the degree: repeated to one per rank
    local = B * (S // cp) * D * 8
    want = (2 * Hq + 2 * kv_heads) * local * (u - 1) // u  # q, k, v, out (bytes; fwd only here)
    results[f"{tag} attn hkv={hkv}"] = (err, fwd == want)


def _train_step_check(mesh, cfg, results, tag):
    """One AdamW step of the plain model on the whole batch vs the parallel run."""
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, 64, (4, 33), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    ref = build_model(cfg.model, seed=2, dtype=torch.float64)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    ref_opt.step()

    engine = parallelize(build_model(cfg.model, seed=2, dtype=torch.float64), mesh, cfg)
    dp, dpi = mesh.size("dp"), mesh.local_rank("dp")
    b = tokens.shape[0] // dp
    x, y = tokens[dpi * b:(dpi + 1) * b], targets[dpi * b:(dpi + 1) * b]  # the engine cuts the cp shard
    m = cfg.parallel.microbatches  # pp stages need >= pp micro-batches
    loss = engine.global_loss(engine.forward_backward(list(zip(x.chunk(m), y.chunk(m)))))
    opt = torch.optim.AdamW([p for _, p in engine.named_parameters()], lr=1e-2)
    opt.step()
    ref_params = dict(ref.named_parameters())
    grad_err = param_err = 0.0
    for name, p in engine.named_parameters():  # tp shards against the same slice of the reference
        pl = get_placement(p, name)
        full = ref_params[pl.name]
        want_p, want_g = full.detach(), full.grad
        if pl.dim is not None:
            want_p, want_g = (t.narrow(pl.dim, pl.start, pl.length) for t in (want_p, want_g))
        grad_err = max(grad_err, (pl.valid(p.grad) - want_g).abs().max().item())
        param_err = max(param_err, (pl.valid(p.detach()) - want_p).abs().max().item())
    results[f"{tag} train step"] = (abs(loss - ref_loss.item()), grad_err, param_err)


def worker(ctx, cases):
    results = {}
    for par, impl, hkvs in cases:
        cfg = _cfg(impl, **par)
        mesh = Mesh.build(Topology.from_config(cfg.parallel))
        tag = impl + " " + "x".join(f"{k}{v}" for k, v in par.items())
        for hkv in hkvs:
            _attention_check(mesh, cfg, hkv, results, tag)
        _train_step_check(mesh, cfg, results, tag)
    return results


def _check(results, count):
    assert len(results) == count, sorted(results)
    for name, vals in results.items():
        if name.endswith("train step"):
            assert max(vals) <= ATOL, (name, vals)
        else:
            err, bytes_ok = vals
            assert err <= ATOL, (name, err)
            assert bytes_ok, (name, "all-to-all bytes differ from (2Hq + 2Hkv) * local * (u-1)/u")


def test_ulysses_cp2_attention_gqa_and_train_step():
    # hkv 2 = degree (split), 1 < degree (repeated), 4 (two per rank)
    for res in run(worker, 2, [(dict(cp=2), "ulysses", (1, 2, 4))]):
        _check(res, 4)


def test_ulysses_cp4_unified_2x2_with_tp_dp_and_pp():
    cases = [(dict(cp=4), "ulysses", (2,)), (dict(cp=4, cp_ulysses=2), "unified", (2, 1)),
             (dict(cp=2, tp=2), "ulysses", ()), (dict(cp=2, dp_shard=2), "ulysses", ()),
             (dict(cp=2, pp=2), "ulysses", ())]
    for res in run(worker, 4, cases):
        _check(res, 8)
