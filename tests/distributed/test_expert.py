"""Expert parallel (MoE over all-to-all) against the single-process MoE model. float64, CPU gloo."""
import os
import sys

import torch

from shardlab.config import Config, ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.placement import get_placement
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallel import expert
from shardlab.parallelize import parallelize

ATOL = 1e-10


def make_cfg(topo, top_k=2, capacity=0.0):
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=32, max_seq_len=16,
                            n_experts=4, moe_top_k=top_k, moe_capacity_factor=capacity,
                            moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
    for k, v in topo.items():
        setattr(cfg.parallel, k, v)
    cfg.train.seq_len = 16
    return cfg


def local_slice(ref_tensor, placement):
    if placement.dim is None:
        return ref_tensor
    return ref_tensor.narrow(placement.dim, placement.start, placement.length)


def _train_step(mesh, cfg):
    """Loss, gradients and one AdamW step of the parallel engine vs the plain model on the batch."""
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 64, (8, 17), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    ref = build_model(cfg.model, seed=4, dtype=torch.float64)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    ref_grads = {n: p.grad.clone() for n, p in ref_params.items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.step()

    engine = parallelize(build_model(cfg.model, seed=4, dtype=torch.float64), mesh, cfg)
    dp, dpi = mesh.size("dp"), mesh.local_rank("dp")
    b = tokens.shape[0] // dp
    x, y = tokens[dpi * b:(dpi + 1) * b], targets[dpi * b:(dpi + 1) * b]  # the engine cuts the cp shard
    snap = mesh.ledger.snapshot()
    loss = engine.global_loss(engine.forward_backward([(x, y)]))
    metrics = expert.moe_metrics(engine.model, mesh.ledger.since(snap))
    grad_err = 0.0
    for name, p in engine.named_parameters():
        pl = get_placement(p, name)
        grad_err = max(grad_err, (p.grad - local_slice(ref_grads[pl.name], pl)).abs().max().item())
    norm_err = abs(engine.grad_norm().item() - torch.cat([g.flatten() for g in ref_grads.values()]).norm().item())
    grad_err = max(grad_err, norm_err)
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    opt.step()
    param_err = max((p - local_slice(ref_params[get_placement(p, n).name], get_placement(p, n))).abs().max().item()
                    for n, p in engine.named_parameters())
    # checkpoint tensors in global coordinates: experts gathered over ep equal the reference's
    state = engine.full_state(opt, everywhere=True)
    for n, rp in ref_params.items():
        param_err = max(param_err, (state[f"model.{n}"] - rp).abs().max().item(),
                        (state[f"optim.{n}.exp_avg_sq"] - ref_opt.state[rp]["exp_avg_sq"]).abs().max().item())
    tpe = metrics["moe/0/tokens_per_expert"]
    ref_tpe = ref.layers["0"].feed_forward.last_stats["tokens_per_expert"].tolist()
    return (abs(loss - ref_loss.item()), grad_err, param_err, tpe == ref_tpe,
            metrics["moe/all_to_all_bytes"] > 0 or mesh.size("ep") == 1)


class _NoHostRead:
    """Within: ``Tensor.tolist`` / ``item`` raise, except inside the experts' kernel (on CPU it reads
    its counts, which live in host memory there) and when called from the communicators
    (shardlab/distributed: the shared-memory transport reads its own control block, host memory on
    any device, no device sync)."""

    def __init__(self, layer):
        self.layer, self.saved = layer, {"tolist": torch.Tensor.tolist, "item": torch.Tensor.item}

    def _guard(self, name):
        orig = self.saved[name]

        def read(t, *a, **k):
            caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
            if self.inside_experts or "/shardlab/distributed/" in caller:
                return orig(t, *a, **k)
            raise AssertionError(f"host read ({name}) in the expert-parallel dispatch")
        return read

    def __enter__(self):
        run, self.inside_experts = self.layer.experts.forward, False

        def experts(x, counts, capacity=0):
            self.inside_experts = True
            try:
                return run(x, counts, capacity)
            finally:
                self.inside_experts = False
        self.layer.experts.forward = experts
        torch.Tensor.tolist, torch.Tensor.item = self._guard("tolist"), self._guard("item")

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.item = self.saved["tolist"], self.saved["item"]
        del self.layer.experts.forward


def _capacity_layer(mesh, cfg, dispatch):
    """Each rank's tokens through the ep layer vs the single-process MoE on the same tokens:
    same kept/dropped assignments, same output and input/router gradients; expert gradients equal
    the reference's summed over the ep ranks; all-to-all bytes equal the rows sent away (exact)
    or the padded blocks (padded, which must not read anything on the host)."""
    ref = build_model(cfg.model, seed=4, dtype=torch.float64).layers["0"].feed_forward
    with torch.no_grad():  # a peaked router so that experts overflow
        ref.router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    layer = expert.ExpertParallelMoE(ref, mesh, cfg.model, "layers.0.feed_forward", dispatch)
    gen = torch.Generator().manual_seed(10 + mesh.rank)
    x = torch.randn(24, 32, dtype=torch.float64, generator=gen)
    w = torch.randn(24, 32, dtype=torch.float64, generator=gen)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(xr)
    (y_ref * w).sum().backward()
    snap = mesh.ledger.snapshot()
    if dispatch == "padded":
        with _NoHostRead(layer):
            y = layer(xe)
    else:
        y = layer(xe)
    sent = sum(e.bytes_sent for (op, grp), e in mesh.ledger.since(snap).items() if op == "all_to_all")
    (y * w).sum().backward()
    ep_comm = mesh.comm("ep")
    grad_err = max((xe.grad - xr.grad).abs().max().item(),
                   (layer.router.weight.grad - ref.router.weight.grad).abs().max().item())
    for name in ("w1", "w2", "w3"):
        full = ep_comm.all_reduce(getattr(ref.experts, name).grad.clone())
        grad_err = max(grad_err, (getattr(layer.experts, name).grad
                                  - full[layer.first:layer.first + layer.n_local]).abs().max().item())
    r, rr = layer.last_routing, ref.last_routing
    ep, n_local = mesh.size("ep"), layer.n_local
    me = mesh.local_rank("ep")
    rows_to = {mesh.ranks("ep")[q]: int((r.keep & (r.expert // n_local == q)).sum()) for q in range(ep) if q != me}
    if dispatch == "padded":  # every block holds C rows, whatever the routing
        rows_to = {q: n_local * layer.capacity(x.shape[0]) for q in rows_to}
    return (torch.equal(r.keep, rr.keep) and torch.equal(r.expert, rr.expert), (y - y_ref).abs().max().item(),
            int((~r.keep).sum()), sent, rows_to, n_local, ep, grad_err)


def worker(ctx, topologies):
    out = {}
    for topo in topologies:
        topo = dict(topo)
        algorithm = topo.pop("algorithm", "backend")
        mesh = Mesh.build(Topology(**topo))
        mesh.algorithm = algorithm  # "ring": shardlab's own pairwise all-to-all
        tag = "x".join(f"{k}{v}" for k, v in topo.items()) + ("" if algorithm == "backend" else f" {algorithm}")
        for k in (1, 2):
            out[f"{tag} top{k} step"] = _train_step(mesh, make_cfg(topo, top_k=k))
        for dispatch in ("padded", "exact"):
            out[f"{tag} capacity {dispatch}"] = _capacity_layer(mesh, make_cfg(topo, capacity=1.0), dispatch)
    return out


def _check(res, rank, all_res):
    for name, vals in res.items():
        if name.endswith("step"):
            loss_err, grad_err, param_err, tpe_ok, a2a_ok = vals
            assert max(loss_err, grad_err, param_err) <= ATOL, (name, vals)
            assert tpe_ok and a2a_ok, (name, vals)
        else:
            same_drops, out_err, dropped, sent, rows_to, n_local, ep, grad_err = vals
            assert same_drops and max(out_err, grad_err) <= ATOL, (name, vals)
            # dispatch sends the rows bound for other ranks, combine returns the rows they sent us,
            # plus the exchange of n_local int64 counts with each other rank
            incoming = sum(other[name][4].get(rank, 0) for other in all_res)
            row = 32 * 8
            assert sent == (sum(rows_to.values()) + incoming) * row + (ep - 1) * n_local * 8, (name, vals)


def test_expert_parallel_ep2():
    res = run(worker, 2, [dict(dp_shard=2, ep=2), dict(dp_shard=2, ep=2, algorithm="ring")])
    assert sum(v[2] for r in res for k, v in r.items() if "capacity" in k) > 0  # drops happened
    for rank, r in enumerate(res):
        _check(r, rank, res)


def test_expert_parallel_ep4_and_ep_x_dp_and_ep_over_cp():
    res = run(worker, 4, [dict(dp_shard=4, ep=4), dict(dp_replicate=2, dp_shard=2, ep=2),
                          dict(dp_shard=2, cp=2, ep=4), dict(dp_shard=2, tp=2, ep=2)])
    for rank, r in enumerate(res):
        assert len(r) == 16
        _check(r, rank, res)
