"""Single-process MoE: routing, capacity drop order, losses, against naive per-token loops."""
import math

import pytest
import torch
import torch.nn.functional as F

from shardlab.config import ModelConfig
from shardlab.models import build_model


def make_moe(**kw):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, n_experts=4,
                      moe_top_k=2, **kw)
    model = build_model(cfg, seed=3, dtype=torch.float64)
    moe = model.layers["0"].feed_forward
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return cfg, moe


def naive(moe, x):
    """Per-token loop: y_t = sum_j gate_j * expert_j(x_t), no capacity."""
    probs = (x @ moe.router.weight.t()).softmax(-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        g, idx = probs[t].topk(moe.top_k)
        if moe.top_k > 1:
            g = g / g.sum()
        for gj, e in zip(g, idx):
            w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
            out[t] += gj * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_equals_per_token_loop(k):
    cfg, moe = make_moe(moe_capacity_factor=0.0)
    moe.top_k = k
    x = torch.randn(2, 12, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    assert torch.allclose(y.view(-1, 32), naive(moe, x.view(-1, 32)), atol=1e-12)
    assert moe.last_stats["dropped_fraction"] == 0.0
    assert int(moe.last_stats["tokens_per_expert"].sum()) == 24 * k


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_layer_gradients_equal_per_token_loop(impl):
    """Backward through routing, spread to the experts and collect back (permutation gathers,
    hand-written expert backward) against autograd through the naive per-token loop."""
    cfg, moe = make_moe(moe_capacity_factor=0.0)
    moe.experts.impl = impl
    x = torch.randn(20, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    c = torch.randn(20, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    params = [x, moe.router.weight, moe.experts.w1, moe.experts.w3, moe.experts.w2]
    got = torch.autograd.grad((moe(x) * c).sum(), params)
    want = torch.autograd.grad((naive(moe, x) * c).sum(), params)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-10 * b.abs().max().item()


def test_capacity_drops_in_priority_order():
    cfg, moe = make_moe(moe_capacity_factor=0.5)
    x = torch.randn(40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    moe(x)
    r = moe.last_routing
    cap = math.ceil(0.5 * 40 * 2 / 4)
    assert moe.capacity(40) == cap == 10
    seen = {}
    for i in range(r.expert.numel()):  # priority order: all first choices, then second choices
        e = int(r.expert[i])
        seen[e] = seen.get(e, 0) + 1
        assert bool(r.keep[i]) == (seen[e] <= cap)
    assert r.keep.sum() < r.keep.numel()  # something was dropped
    assert moe.last_stats["dropped_fraction"] == pytest.approx(float((~r.keep).sum()) / 80)
    # dropped assignments contribute nothing: output equals the per-token loop over kept ones
    probs = (x @ moe.router.weight.t()).softmax(-1)
    g, idx = probs.topk(2, -1)
    g = g / g.sum(-1, keepdim=True)
    expect = torch.zeros_like(x)
    for i in range(r.expert.numel()):
        if r.keep[i]:
            t, j = i % 40, i // 40
            e = idx[t, j]
            w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
            expect[t] += g[t, j] * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
    assert torch.allclose(moe(x), expect, atol=1e-12)


def test_aux_losses_match_formulas():
    cfg, moe = make_moe(moe_aux_loss_coef=1.0, moe_z_loss_coef=1.0)
    x = torch.randn(30, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    moe(x)
    logits = x @ moe.router.weight.t()
    probs = logits.softmax(-1)
    idx = probs.topk(2, -1).indices
    f = torch.bincount(idx.flatten(), minlength=4).double() / (30 * 2)
    balance = 4 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    assert moe.last_aux_loss.item() == pytest.approx((balance + z).item(), rel=1e-12)


def test_moe_llama_trains_and_is_layout_independent():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, n_experts=4,
                      moe_top_k=2, max_seq_len=16)
    m1 = build_model(cfg, seed=5, dtype=torch.float64)
    m2 = build_model(cfg, seed=5, dtype=torch.float64)
    assert torch.equal(m1.layers["1"].feed_forward.experts.w2, m2.layers["1"].feed_forward.experts.w2)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = m1(tokens[:, :-1], tokens[:, 1:])
    ce = F.cross_entropy(m1(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() > ce.item()  # aux losses are included
    loss.backward()
    assert m1.layers["0"].feed_forward.router.weight.grad.abs().sum() > 0
    assert m1.layers["0"].feed_forward.experts.w1.grad.abs().sum() > 0


@pytest.mark.parametrize("overrides, field", [
    ({"parallel": {"pp": 2, "microbatches": 2, "dp_shard": 2, "ep": 2, "zero_stage": 1},
      "model": {"n_experts": 4, "tie_embeddings": False}}, "parallel.ep"),
    ({"parallel": {"pp": 2, "microbatches": 2, "zero_stage": 3, "offload": True},
      "model": {"n_experts": 4, "tie_embeddings": False}}, "parallel.offload"),
])
def test_unsupported_combinations_fail_before_start(overrides, field):
    from shardlab.config import ConfigError, from_dict
    cfg = from_dict(overrides)
    with pytest.raises(ConfigError) as err:
        cfg.validate(cfg.parallel.world_size)
    assert err.value.field == field


def _expert_case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, D, H = 4, 32, 48
    w = [torch.randn(E, H, D, dtype=dtype, generator=g), torch.randn(E, H, D, dtype=dtype, generator=g),
         torch.randn(E, D, H, dtype=dtype, generator=g)]
    counts = torch.tensor([5, 0, 9, 3])                       # an expert without rows
    x = torch.randn(20, D, dtype=dtype, generator=g)          # 3 rows past the groups (dropped)
    return x, counts, [t.requires_grad_() for t in w]


@pytest.mark.parametrize("dtype, tol, kernel, capacity", [
    (torch.float64, 1e-12, "segments", 0), (torch.float64, 1e-12, "padded", 0), (torch.float64, 1e-12, "padded", 12),
    (torch.float32, 1e-4, "segments", 0), (torch.float32, 1e-4, "padded", 0), (torch.float32, 1e-4, "grouped_mm", 0)])
@pytest.mark.parametrize("x_grad", [True, False])
def test_grouped_experts_equal_the_loop(dtype, tol, kernel, capacity, x_grad):
    """Every grouped kernel (hand-written backward) against the per-expert loop under autograd:
    outputs, zeros for rows past the groups, and every gradient (with and without dx); the
    padded kernel also padded to a capacity above the largest count."""
    from shardlab.models import moe_gemm
    outs = {}
    for impl in ("loop", "grouped"):
        x, counts, (w1, w3, w2) = _expert_case(dtype)
        x.requires_grad_(x_grad)
        y = moe_gemm.expert_ffn(x, counts, w1, w3, w2, impl, kernel, capacity)
        y.square().sum().backward()
        outs[impl] = [y.detach(), w1.grad, w3.grad, w2.grad] + ([x.grad] if x_grad else [])
    assert torch.equal(outs["grouped"][0][17:], torch.zeros(3, 32, dtype=dtype))
    assert torch.equal(outs["grouped"][1][1], torch.zeros(48, 32, dtype=dtype))      # the expert without rows
    if x_grad:
        assert torch.equal(outs["grouped"][4][17:], torch.zeros(3, 32, dtype=dtype))
    for a, b in zip(outs["loop"], outs["grouped"]):
        assert (a - b).abs().max().item() <= tol * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("kernel", ["segments", "padded"])
def test_grouped_experts_under_cpu_bf16_autocast_equal_the_loop(kernel):
    """Under CPU bf16 autocast the kernels compute in bf16 from the fp32 weights, as the loop's
    ``F.linear`` does: outputs in bf16, gradients in fp32, equal to the loop's to bf16 rounding
    (the kernel's own ``auto`` choice for these sizes is padded)."""
    from shardlab.models import moe_gemm
    outs = {}
    for impl in ("loop", "grouped"):
        x, counts, w = _expert_case(torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe_gemm.expert_ffn(x, counts, *w, impl, kernel)
        assert impl == "loop" or y.dtype == torch.bfloat16   # (the loop's zero rows make it fp32)
        y.float().square().sum().backward()
        assert all(t.grad.dtype == torch.float32 for t in w)
        outs[impl] = [y.float()] + [t.grad for t in w]
    for a, b in zip(outs["loop"], outs["grouped"]):
        assert (a - b).abs().max().item() <= 2e-2 * a.abs().max().item()


def test_cpu_auto_kernel_by_expert_size():
    """Off CUDA, with a capacity, ``auto`` runs the padded batched kernel where an expert's
    product is small (its per-expert calls would cost more than the padding), in bf16 up to a
    larger size while the padding stays small, and one mm per expert otherwise; dropless always
    one mm per expert (memory that does not follow the routing). The padded kernel pads to a
    capacity only if no count exceeds it."""
    from shardlab.models import moe_gemm
    pick = moe_gemm._cpu_kernel
    small, large = torch.empty(8, 96, 64), torch.empty(8, 512, 256)
    x32, x16 = torch.empty(1, 1), torch.empty(1, 1, dtype=torch.bfloat16)
    assert pick(x32, small, [64] * 8, 80) == "padded"                  # 64 x 96 x 64 = 0.4M
    assert pick(x32, small, [64] * 8, 0) == "segments"                 # dropless
    assert pick(x32, large, [64] * 8, 80) == "segments"                # 64 x 512 x 256 = 8.4M
    assert pick(x16, large, [64] * 8, 80) == "padded"                  # bf16, padding 1.25x
    assert pick(x16, large, [16, 112] + [64] * 6, 112) == "segments"   # bf16, padding 1.75x
    assert pick(x32, small, [0] * 8, 80) == "segments"                 # nothing routed
    x, counts, w = _expert_case(torch.float64)
    with pytest.raises(ValueError, match="capacity 8"):
        moe_gemm.expert_ffn(x, counts, *w, "grouped", "auto", capacity=8)   # an expert has 9 rows


def test_grouped_mm_kernel_refused_where_unsupported():
    from shardlab.models import moe_gemm
    x, counts, (w1, w3, w2) = _expert_case(torch.float64)
    with pytest.raises(ValueError):
        moe_gemm.expert_ffn(x, counts, w1, w3, w2, "grouped", "grouped_mm")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs CUDA sm90+ (torch._grouped_mm)")
@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_cuda_layer_has_no_host_sync(capacity):
    """On CUDA under bf16 autocast the grouped layer (routing, capacity, grouping, torch._grouped_mm
    experts, combine) runs forward and backward with ``torch.cuda.set_sync_debug_mode("error")``:
    no host read; and equals the per-expert loop (bf16: 2e-2). In fp32 (TF32 off) the experts
    take the padded kernel (one host read when dropless) and equal the loop to 1e-4."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, n_experts=8,
                      moe_top_k=2, moe_capacity_factor=capacity)
    moe = build_model(cfg, seed=3).layers["0"].feed_forward.cuda()
    x = torch.randn(256, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def run(impl, bf16, no_sync=False):
        moe.zero_grad()
        moe.experts.impl = impl
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
            moe(x).sum().backward()  # warm-up: lazy initialisation may synchronise once
            moe.zero_grad()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if no_sync else 0)
            try:
                y = moe(x)
                y.float().square().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return y.float(), [p.grad.clone() for p in moe.parameters()]

    for bf16, tol in ((True, 2e-2), (False, 1e-4)):
        y, grads = run("grouped", bf16, no_sync=bf16)
        y_loop, grads_loop = run("loop", bf16)
        assert torch.allclose(y, y_loop, rtol=tol, atol=tol), bf16
        for g, want in zip(grads, grads_loop):
            assert torch.allclose(g, want, rtol=tol, atol=tol * want.abs().max().item()), bf16


def test_chunk_bounds_halve_the_end_chunks_and_cover_every_token():
    from shardlab.models.moe import chunk_bounds, chunk_of
    assert chunk_bounds(24, 2) == [0, 12, 24] and chunk_bounds(24, 3) == [0, 6, 18, 24]
    assert chunk_bounds(24, 4) == [0, 4, 12, 20, 24]
    for T, n in ((24, 4), (7, 4), (100, 8), (3, 5)):
        b = chunk_bounds(T, n)
        assert b[0] == 0 and b[-1] == T and b == sorted(b)
        sizes = torch.bincount(chunk_of(torch.arange(T), T, n), minlength=n).tolist()
        assert sizes == [b[c + 1] - b[c] for c in range(n)]
