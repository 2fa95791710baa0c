"""Calibration of the planner (docs/planner_calibration.md): the measurement side against
closed forms, and the planner's memory prediction against the measurement on a CI subset.

* ``SavedActivations`` on a hand-built graph: the bytes autograd saves, counted by storage, and
  their release after backward (peak vs held now).
* A real run of 2 ranks (tiny Llama, fp32): DDP model state equals 4/4/8 bytes per parameter
  exactly; pipeline stages hold the schedule's in-flight micro-batches (GPipe m, 1F1B p - stage)
  of saved activations at their peak.
* ``predict()`` on dp, zero2, fsdp, tp2, pp2-1f1b, pp2-zb, pp2-dualpipev, moe-dp, tp2-sp-ac-op (the
  ``op`` recomputation policy: its kept outputs measured through recompute.observe_kept) at N = 2 and
  zero2, fsdp, pp2-tp2, pp2-fsdp, ep2-zero2 at N = 4: per-rank model-state bytes exactly the
  measured ones, activations within 5% of the measured peak, and the split backward's W stash
  within 5% of the engine's ``wgrad_peak_bytes``.
"""
import pytest
import torch

from shardlab.analysis import calibrate as cal
from shardlab.analysis.predict import predict
from shardlab.analysis.verify import layout_config
from shardlab.models import build_model, count_params

N = 2
FP32 = {"train": {"precision": "fp32"}}
PROBE = {"flops": 1e10, "alpha": 1e-4, "bw": 1e9, "mem_bw": 1e10}  # time constants: memory does not use them
NAMES = ["dp", "zero2", "fsdp", "tp2", "pp2-1f1b", "pp2-gpipe", "pp2-zb", "pp2-dualpipev", "moe-dp", "tp2-sp-ac-op"]


def test_saved_activations_peak_and_release():
    """y = relu(x @ W) twice before backward: mm saves x (W is a parameter, excluded), relu its
    output; each forward holds x + out, two at once, nothing after both backwards."""
    b, d = 8, 16
    w = torch.nn.Parameter(torch.randn(d, d, dtype=torch.float64))
    xs = [torch.randn(b, d, dtype=torch.float64) for _ in range(2)]
    with cal.SavedActivations([w]) as acts:
        losses = [torch.relu(x @ w).sum() for x in xs]
        assert acts.current == 2 * (b * d * 8 + b * d * 8)
        losses[0].backward()
        assert acts.current == b * d * 8 + b * d * 8
        losses[1].backward()
    assert acts.current == 0
    assert acts.peak == acts.total == 4 * b * d * 8
    assert w.grad is not None


NAMES4 = ["zero2", "fsdp", "pp2-tp2", "pp2-fsdp", "ep2-zero2"]  # N = 4: other shard padding, pipeline x
# tensor parallel ranks, ZeRO-3 inside pipeline stages, expert weights sharded over edp


def _measure(names, n):
    cfgs = [layout_config(name, n, extra=FP32) for name in names]
    return dict(zip(names, zip(cfgs, cal.measure_layouts(cfgs, n, warmup=1, steps=0))))


@pytest.fixture(scope="module")
def measured():
    return _measure(NAMES, N)


def test_measured_state_and_schedule_in_flight(measured):
    cfg, ranks = measured["dp"]
    psi = count_params(build_model(cfg.model, 0))
    for m in ranks:
        assert (m.params, m.grads, m.optim) == (4 * psi, 4 * psi, 8 * psi)
        assert m.act_peak == m.act_micro > 0  # one micro-batch: everything saved is held at once
    for name in ("pp2-gpipe", "pp2-1f1b"):
        cfg, ranks = measured[name]
        mb, p = cfg.parallel.microbatches, cfg.parallel.pp
        for m in ranks:
            in_flight = mb if name == "pp2-gpipe" else min(mb, p - m.stage)
            assert m.act_peak == pytest.approx(in_flight * m.act_micro, rel=1e-9), (name, m.stage)


@pytest.mark.parametrize("n", [2, 4])
def test_predicted_memory_matches_measured(measured, n):
    runs = measured if n == 2 else _measure(NAMES4, 4)
    names = ["dp", "zero2", "fsdp", "tp2", "pp2-1f1b", "pp2-zb", "pp2-dualpipev", "moe-dp", "tp2-sp-ac-op"] \
        if n == 2 else NAMES4
    for name in names:
        cfg, ranks = runs[name]
        pred = predict(cfg, device="cpu", probe=PROBE)
        for m in ranks:
            p = pred.ranks[m.rank]
            assert (p.params, p.grads, p.optim) == (m.params, m.grads, m.optim), (name, m.rank)
            assert abs(p.activations - m.act_peak) <= 0.05 * m.act_peak, (name, m.rank, p.activations, m.act_peak)
            # split backward: the W stash (inputs and output gradients held from B to W) as the engine counts it
            assert abs(p.wgrad - m.wgrad_peak) <= 0.05 * max(m.wgrad_peak, 1.0), (name, m.rank, p.wgrad, m.wgrad_peak)


def test_predicted_memory_math_attention():
    """``model.attention = "math"`` (gpt2 with attention dropout, tp2): the materialised scores,
    the softmax output and the dropout masks are saved tensors; the planner's trace counts them as
    the run saves them (model state exact, activations within 5%)."""
    cfg = layout_config("tp2", N, arch="gpt2", extra={**FP32, "model": {"attention": "math", "dropout": 0.1}})
    ranks = cal.measure_layouts([cfg], N, warmup=1, steps=0)[0]
    pred = predict(cfg, device="cpu", probe=PROBE)
    sdpa = predict(layout_config("tp2", N, arch="gpt2", extra={**FP32, "model": {"dropout": 0.1}}),
                   device="cpu", probe=PROBE)
    s, b = cfg.train.seq_len, cfg.train.global_batch // cfg.parallel.dp // cfg.parallel.microbatches
    heads = cfg.model.n_heads // cfg.parallel.tp
    for m in ranks:
        p = pred.ranks[m.rank]
        assert (p.params, p.grads, p.optim) == (m.params, m.grads, m.optim), m.rank
        assert abs(p.activations - m.act_peak) <= 0.05 * m.act_peak, (m.rank, p.activations, m.act_peak)
        # at least the fp32 probabilities of every layer beyond what the fused kernel saves
        extra = p.activations - sdpa.ranks[m.rank].activations
        assert extra >= cfg.model.n_layers * b * heads * s * s * 4, (m.rank, extra)



def test_predicted_memory_expert_parallel_dispatch():
    """Expert parallel with a capacity: the padded dispatch's shapes are set by the capacity, so
    the prediction is the measurement (to 0.01%: the measured peak sits 16 bytes below all the
    bytes saved over the step, which the prediction equals) whatever the router does; the exact dispatch
    moves only the kept rows and holds at most that (the padded prediction bounds it)."""
    extra = {**FP32, "model": {"moe_capacity_factor": 1.25}}
    padded = layout_config("ep2", N, extra=extra)
    exact = layout_config("ep2", N, extra={**extra, "parallel": {"ep_dispatch": "exact"}})
    meas_padded, meas_exact = cal.measure_layouts([padded, exact], N, warmup=1, steps=0)
    pred = predict(padded, device="cpu", probe=PROBE)
    for m in meas_padded:
        p = pred.ranks[m.rank]
        assert (p.params, p.grads, p.optim) == (m.params, m.grads, m.optim), m.rank
        assert abs(p.activations - m.act_peak) <= 1e-4 * m.act_peak, (m.rank, p.activations, m.act_peak)
    for m in meas_exact:
        assert 0 < m.act_peak <= pred.ranks[m.rank].activations, (m.rank, m.act_peak)
    assert predict(exact, device="cpu", probe=PROBE).ranks[0].activations < pred.ranks[0].activations


def test_predicted_memory_under_bf16_autocast():
    """bf16 autocast (on CPU: torch.autocast's CPU rules, which the trace's AutocastTrace follows
    there): fp32 weights are cast per product and the casts saved, the residual stream stays fp32
    (dp, zero2, tp2, pp2-1f1b); FSDP gathers in bf16, so nothing is cast (fsdp). MoE: the expert
    kernels take their autocast branch in the trace as in the run (bf16 rows and weight casts
    saved; dropless segments, and with a capacity the padded kernel). The measured saved bytes
    equal the prediction (0.1%)."""
    bf16 = {"train": {"precision": "bf16"}}
    names = ["dp", "zero2", "fsdp", "tp2", "pp2-1f1b", "moe-dp", "ep2 capacity"]
    cfgs = [layout_config(name, N, extra=bf16) for name in names[:-1]]
    cfgs.append(layout_config("ep2", N, extra={**bf16, "model": {"moe_capacity_factor": 1.25}}))
    runs = cal.measure_layouts(cfgs, N, warmup=1, steps=0)
    for name, cfg, ranks in zip(names, cfgs, runs):
        pred = predict(cfg, device="cpu", probe=PROBE)
        for m in ranks:
            p = pred.ranks[m.rank]
            assert abs(p.activations - m.act_peak) <= 1e-3 * m.act_peak, (name, m.rank, p.activations, m.act_peak)
