"""ZeRO-1/2 and FSDP over expert-parallel weights (expert-data-parallel sharding) against an
independent single-process MoE model on the global batch: loss, gradient norm, and after one
AdamW step every parameter and Adam moment in global coordinates. float64, CPU gloo, N = 4."""
import torch

from shardlab.config import Config, ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model, meta_model
from shardlab.parallelize import parallelize

ATOL = 1e-10
LAYOUTS = {
    "fsdp x ep2": dict(dp_shard=4, ep=2, zero_stage=3),
    "hsdp x ep2": dict(dp_replicate=2, dp_shard=2, ep=2, zero_stage=3),
    "zero2 x ep2": dict(dp_shard=4, ep=2, zero_stage=2),
    "zero1 x ep4": dict(dp_shard=4, ep=4, zero_stage=1),
}


def make_cfg(topo):
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=32, max_seq_len=16,
                            n_experts=4, moe_top_k=2, moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
    for k, v in topo.items():
        setattr(cfg.parallel, k, v)
    cfg.train.seq_len, cfg.train.weight_decay = 16, 0.1
    return cfg


def reference(cfg, tokens, targets):
    """The plain model on the whole batch, AdamW with the engines' decay rule (no decay for
    vectors and norms)."""
    ref = build_model(cfg.model, seed=cfg.train.seed, dtype=torch.float64)
    loss = ref(tokens, targets)
    loss.backward()
    named = list(ref.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "norm" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    norm = torch.cat([p.grad.flatten() for _, p in named]).norm().item()
    opt.step()
    return loss.item(), norm, {n: (p.detach(), opt.state[p]) for n, p in named}


def step(mesh, cfg, meta: bool):
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(5))
    tokens, targets = data[:, :-1], data[:, 1:]
    ref_loss, ref_norm, ref = reference(cfg, tokens, targets)
    model = meta_model(cfg.model, torch.float64) if meta else build_model(cfg.model, seed=cfg.train.seed,
                                                                           dtype=torch.float64)
    engine = parallelize(model, mesh, cfg)
    expert_flats = [f for f in engine.flats if f.group == "edp"]
    sharded = bool(expert_flats) and all(f.n == mesh.size("edp") for f in expert_flats)
    dp, dpi = mesh.size("dp"), mesh.local_rank("dp")
    b = tokens.shape[0] // dp
    opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    loss = engine.global_loss(engine.forward_backward([(tokens[dpi * b:(dpi + 1) * b],
                                                        targets[dpi * b:(dpi + 1) * b])]))
    norm = engine.grad_norm().item()
    opt.step()
    state = engine.full_state(opt, everywhere=True)
    err = 0.0
    for n, (p, st) in ref.items():
        err = max(err, (state[f"model.{n}"] - p).abs().max().item(),
                  (state[f"optim.{n}.exp_avg"] - st["exp_avg"]).abs().max().item(),  # = 0.1 * gradient
                  (state[f"optim.{n}.exp_avg_sq"] - st["exp_avg_sq"]).abs().max().item())
    return abs(loss - ref_loss), abs(norm - ref_norm), err, sharded


def worker(ctx, layouts):
    out = {}
    for name, topo in layouts.items():
        mesh = Mesh.build(Topology(**{k: v for k, v in topo.items() if k != "zero_stage"}))
        out[name] = step(mesh, make_cfg(topo), meta=topo["zero_stage"] == 3)
    return out


def test_zero_and_fsdp_over_expert_parallel_weights_n4():
    for rank_res in run(worker, 4, LAYOUTS):
        assert set(rank_res) == set(LAYOUTS)
        for name, (loss_err, norm_err, state_err, sharded) in rank_res.items():
            assert max(loss_err, norm_err, state_err) <= ATOL, (name, loss_err, norm_err, state_err)
            assert sharded, name  # expert weights live in flat buffers sharded over edp
