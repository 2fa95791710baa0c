"""Tensor and sequence parallel: losses, gradients and the gradient norm equal a single-process
reference (the plain ``build_model`` model on the whole global batch, float64); the collective
bytes in the ledger equal the Megatron theory. Two spawns (2 and 4 ranks) run every case."""
import math

import pytest
import torch
import torch.nn.functional as F

from shardlab import launch
from shardlab.config import Config, ModelConfig
from shardlab.distributed.ledger import ring_bytes
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.placement import get_placement
from shardlab.distributed.topology import Topology
from shardlab.models import build_model
from shardlab.models.llama.model import Llama
from shardlab.parallel import tensor as tpmod
from shardlab.parallelize import parallelize
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

TOL = 1e-10
SEED, B, S, V, H = 7, 4, 16, 67, 32     # vocab 67: not divisible by 2 nor 4 (padding)


def make_cfg(tp, dp=1, sp=False, tie=False, layers=2, kv=2, pp=1, cp=1):
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=V, d_model=H, n_layers=layers, n_heads=4, n_kv_heads=kv,
                            max_seq_len=S, tie_embeddings=tie)
    cfg.parallel.tp, cfg.parallel.dp_replicate, cfg.parallel.sequence_parallel = tp, dp, sp
    cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.microbatches = pp, cp, max(1, pp)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed = S, B, SEED
    return cfg.validate(tp * dp * pp * cp)


def batch():
    g = torch.Generator().manual_seed(SEED + 1)
    t = torch.randint(0, V, (B, S + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def parity_case(cfg, meta):
    """One layout vs the reference: max errors of loss, params, grads, padding and grad norm."""
    dp = cfg.parallel.dp_replicate
    mesh = Mesh.build(Topology(dp_replicate=dp, tp=cfg.parallel.tp))
    x, y = batch()
    ref = build_model(cfg.model, SEED, dtype=torch.float64)
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_p = dict(ref.named_parameters())
    ref_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref_p.values()))

    if meta:  # shards materialised from init_tensor, never holding the full model
        with torch.device("meta"):
            model = Llama(cfg.model).to(torch.float64)
    else:     # shards sliced from the initialised full model
        model = build_model(cfg.model, SEED, dtype=torch.float64)
    engine = parallelize(model, mesh, cfg)
    d, b = mesh.coords["dp_replicate"], B // dp
    loss = engine.forward_backward([(x[d * b:(d + 1) * b], y[d * b:(d + 1) * b])])
    err = {"loss": abs(engine.global_loss(loss) - float(ref_loss.detach())), "param": 0.0, "grad": 0.0, "pad": 0.0}
    n_sharded = 0
    for name, p in engine.named_parameters():
        pl = get_placement(p, name)
        rp = ref_p[pl.name]
        if pl.dim is None:
            want_p, want_g, got_p, got_g = rp.detach(), rp.grad, p.detach(), p.grad
        else:
            n_sharded += 1
            want_p, want_g = rp.detach().narrow(pl.dim, pl.start, pl.length), rp.grad.narrow(pl.dim, pl.start, pl.length)
            got_p, got_g = pl.valid(p.detach()), pl.valid(p.grad)
            pad = p.grad.narrow(pl.dim, pl.length, p.shape[pl.dim] - pl.length)
            err["pad"] = max(err["pad"], float(pad.abs().max()) if pad.numel() else 0.0)
        err["param"] = max(err["param"], float((got_p - want_p).abs().max()))
        err["grad"] = max(err["grad"], float((got_g - want_g).abs().max()))
    err["norm"] = abs(float(engine.grad_norm()) - ref_norm)
    err["n_sharded"] = n_sharded
    return err


def ce_embedding_case(tp, vocab):
    """Vocab-parallel embedding and cross-entropy alone, vocab not divisible by tp."""
    mesh = Mesh.build(Topology(tp=tp))
    comm, r = mesh.comm("tp"), mesh.local_rank("tp")
    rows = -(-vocab // tp)
    start, valid = r * rows, max(0, min(rows, vocab - r * rows))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(24, vocab, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (24,), generator=g)
    table = torch.randn(vocab, 8, generator=g, dtype=torch.float64)
    upstream = torch.randn(24, 8, generator=g, dtype=torch.float64)

    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full, targets)
    ref.backward()
    local = torch.cat([logits[:, start:start + valid], torch.full((24, rows - valid), 7.0, dtype=torch.float64)], 1)
    local.requires_grad_(True)  # padding columns hold garbage (7.0): they must be ignored
    loss = tpmod.VocabParallelCrossEntropy(start, valid, comm)(local, targets)
    loss.backward()
    err_ce = max(abs(float(loss - ref)), float((local.grad[:, :valid] - full.grad[:, start:start + valid]).abs().max()
                                               if valid else 0.0), float(local.grad[:, valid:].abs().max()
                                                                           if rows > valid else 0.0))
    tref = table.clone().requires_grad_(True)
    (F.embedding(targets, tref) * upstream).sum().backward()
    w = torch.cat([table[start:start + valid], torch.zeros(rows - valid, 8, dtype=torch.float64)])
    emb = tpmod.VocabParallelEmbedding(w, start, valid, comm)
    out = emb(targets)
    (out * upstream).sum().backward()
    err_emb = max(float((out - F.embedding(targets, table)).abs().max()),
                  float((emb.weight.grad[:valid] - tref.grad[start:start + valid]).abs().max()) if valid else 0.0,
                  float(emb.weight.grad[valid:].abs().max()) if rows > valid else 0.0)
    return {"ce": err_ce, "emb": err_emb}


def checkpoint_case(cfg):
    """full_state after one AdamW step equals the reference model's and optimizer's tensors;
    load_full_state puts the same slices back into a differently initialised TP model."""
    cfg.train.weight_decay = 0.0
    mesh = Mesh.build(Topology(tp=cfg.parallel.tp))
    x, y = batch()
    ref = build_model(cfg.model, SEED, dtype=torch.float64)
    ref(x, y).backward()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    ref_opt.step()
    engine = parallelize(build_model(cfg.model, SEED, dtype=torch.float64), mesh, cfg)
    engine.forward_backward([(x, y)])
    opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    opt.step()
    state = engine.full_state(opt, everywhere=True)
    err = 0.0
    for name, p in ref.named_parameters():
        err = max(err, float((state[f"model.{name}"] - p.detach()).abs().max()))
        err = max(err, float((state[f"optim.{name}.exp_avg_sq"] - ref_opt.state[p]["exp_avg_sq"]).abs().max()))
    other = parallelize(build_model(cfg.model, SEED + 5, dtype=torch.float64), mesh, cfg)
    other.forward_backward([(x, y)])
    opt2 = other.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    other.load_full_state(state, opt2)
    mine = dict(engine.named_parameters())
    for name, p in other.named_parameters():
        err = max(err, float((p.detach() - mine[name].detach()).abs().max()))
        err = max(err, float((opt2.state[p]["exp_avg"] - opt.state[mine[name]]["exp_avg"]).abs().max()))
    return {"ckpt": err, "keys": len(state)}


def composed_case(cfg):
    """TP inside pipeline or context parallel (both applied after TP by parallelize): the
    global loss and every local gradient slice equal the reference."""
    p = cfg.parallel
    mesh = Mesh.build(Topology(tp=p.tp, pp=p.pp, cp=p.cp))
    x, y = batch()
    ref = build_model(cfg.model, SEED, dtype=torch.float64)
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_p = dict(ref.named_parameters())
    engine = parallelize(build_model(cfg.model, SEED, dtype=torch.float64), mesh, cfg)
    m = p.microbatches
    loss = engine.forward_backward([(x[i * B // m:(i + 1) * B // m], y[i * B // m:(i + 1) * B // m])
                                    for i in range(m)])
    err = {"loss": abs(engine.global_loss(loss) - float(ref_loss.detach())), "grad": 0.0}
    for name, prm in engine.named_parameters():
        pl = get_placement(prm, name)
        want = ref_p[pl.name].grad
        want = want if pl.dim is None else want.narrow(pl.dim, pl.start, pl.length)
        err["grad"] = max(err["grad"], float((pl.valid(prm.grad) - want).abs().max()))
    return err


def ledger_case(cfg):
    mesh = Mesh.build(Topology(tp=cfg.parallel.tp))
    engine = parallelize(build_model(cfg.model, SEED, dtype=torch.float64), mesh, cfg)
    x, y = batch()
    snap = mesh.ledger.snapshot()
    engine.forward_backward([(x, y)])
    return {f"{op}/{grp}": (e.calls, e.bytes_sent) for (op, grp), e in mesh.ledger.since(snap).items()}


def _world2(ctx):
    out = {}
    for sp in (False, True):
        out[f"tp2 sp={sp}"] = parity_case(make_cfg(2, sp=sp), meta=sp)
    out["tp2 sp tied kv=4"] = parity_case(make_cfg(2, sp=True, tie=True, kv=4), meta=False)
    out["ce/emb tp2 V=67"] = ce_embedding_case(2, 67)
    for sp in (False, True):
        for layers in (1, 2):
            out[f"ledger sp={sp} L={layers}"] = ledger_case(make_cfg(2, sp=sp, layers=layers))
    return out


def _world4(ctx):
    out = {}
    for sp in (False, True):
        out[f"tp4 sp={sp}"] = parity_case(make_cfg(4, sp=sp), meta=not sp)   # kv=2 < tp: replicated
    out["dp2 x tp2 sp=False"] = parity_case(make_cfg(2, dp=2), meta=False)
    out["dp2 x tp2 sp=True"] = parity_case(make_cfg(2, dp=2, sp=True), meta=True)
    out["tp2 x pp2"] = composed_case(make_cfg(2, pp=2))
    out["tp2 x cp2 sp=True"] = composed_case(make_cfg(2, cp=2, sp=True))
    out["ckpt tp4"] = checkpoint_case(make_cfg(4, sp=True))          # kv copies + vocab padding
    out["ce/emb tp4 V=67"] = ce_embedding_case(4, 67)
    out["ce/emb tp4 V=5"] = ce_embedding_case(4, 5)       # the last rank holds padding only
    return out


@pytest.fixture(scope="module")
def results():
    r2 = launch.run(_world2, 2, timeout_s=120)
    r4 = launch.run(_world4, 4, timeout_s=120)
    return {"2": r2, "4": r4}


PARITY = [("2", "tp2 sp=False"), ("2", "tp2 sp=True"), ("2", "tp2 sp tied kv=4"), ("4", "tp4 sp=False"),
          ("4", "tp4 sp=True"), ("4", "dp2 x tp2 sp=False"), ("4", "dp2 x tp2 sp=True")]


@pytest.mark.parametrize("world,case", PARITY)
def test_parity_with_single_process(results, world, case):
    for rank, res in enumerate(results[world]):
        err = res[case]
        assert err["n_sharded"] > 0
        for key in ("loss", "param", "grad", "pad", "norm"):
            assert err[key] <= TOL, f"rank {rank} {case}: {key} error {err[key]}"


@pytest.mark.parametrize("world,case", [("2", "ce/emb tp2 V=67"), ("4", "ce/emb tp4 V=67"), ("4", "ce/emb tp4 V=5")])
def test_vocab_parallel_embedding_and_cross_entropy_with_padding(results, world, case):
    for res in results[world]:
        assert res[case]["ce"] <= TOL and res[case]["emb"] <= TOL, res[case]


def expected_bytes(sp, layers, tp=2, dtype_bytes=8):
    """Megatron's communication per step on the tp group, written from the theory.
    M = one (B, S, H) activation. Without SP, each block all-reduces M twice forward (after wo
    and w2) and twice backward (f before wq/wk/wv and before w1/w3); the embedding adds one
    forward, the output head one backward, and the vocab-parallel loss three all-reduces of
    B*S numbers. With SP, each of those all-reduces of M becomes an all-gather or a
    reduce-scatter of M, and the norm weights (2 per block + the final one) have their H-sized
    gradients all-reduced."""
    m = B * S * H * dtype_bytes
    tokens = B * S * dtype_bytes
    exp = {}
    ce = 3 * ring_bytes("all_reduce", tokens, tp)
    if not sp:
        n_ar = 4 * layers + 2
        exp["all_reduce/tp"] = (n_ar + 3, n_ar * ring_bytes("all_reduce", m, tp) + ce)
    else:
        n_ag = 4 * layers + 2  # fwd: attn, mlp per block + output head; bwd: 2 per block + embedding
        exp["all_gather/tp"] = (n_ag, n_ag * ring_bytes("all_gather", m, tp))
        exp["reduce_scatter/tp"] = (n_ag, n_ag * ring_bytes("reduce_scatter", m, tp))
        n_norms = 2 * layers + 1
        exp["all_reduce/tp"] = (3 + n_norms, ce + n_norms * ring_bytes("all_reduce", H * dtype_bytes, tp))
    return exp


@pytest.mark.parametrize("sp", [False, True])
def test_ledger_modelled_ring_bytes_equal_megatron_theory(results, sp):
    for res in results["2"]:
        for layers in (1, 2):
            got = res[f"ledger sp={sp} L={layers}"]
            assert got == expected_bytes(sp, layers), (layers, got)
        # per layer: the difference between 2 layers and 1 layer is one block's traffic
        one, two = res[f"ledger sp={sp} L=1"], res[f"ledger sp={sp} L=2"]
        m = B * S * H * 8
        per_layer = {k: two[k][1] - one[k][1] for k in two}
        if not sp:
            assert per_layer["all_reduce/tp"] == 4 * ring_bytes("all_reduce", m, 2)
        else:
            assert per_layer["all_gather/tp"] == 4 * ring_bytes("all_gather", m, 2)
            assert per_layer["reduce_scatter/tp"] == 4 * ring_bytes("reduce_scatter", m, 2)


def test_checkpoint_state_is_global_and_reloads(results):
    for res in results["4"]:
        assert res["ckpt tp4"]["ckpt"] <= TOL, res["ckpt tp4"]


@pytest.mark.parametrize("case", ["tp2 x pp2", "tp2 x cp2 sp=True"])
def test_tp_composes_with_pipeline_and_context_parallel(results, case):
    for res in results["4"]:
        assert res[case]["loss"] <= TOL and res[case]["grad"] <= TOL, res[case]
