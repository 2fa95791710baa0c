"""The planner's price of Megatron-LM's backward TP overlap (``megatron_tp_overlap``,
analysis/plan_features.py ``megatron_tp_backward``): the collectives each column-parallel
linear's backward runs behind its GEMMs, computed here from the ring formulas of the model's
activation bytes, not from the planner's helpers; and of its 16-bit weights (``half_params``),
from the model's parameter counts."""
import math

import pytest

from shardlab.analysis.predict import predict


def _ring(kind: str, nbytes: float, n: int = 8, bw: float = 360e9, alpha: float = 10e-6) -> float:
    """One collective inside an H100 node (NVLink 360 GB/s bus bandwidth, 10 us per ring step)."""
    return 2 * math.log2(n) * alpha + {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[kind] \
        * nbytes * (n - 1) / n / bw


def _cfg(layout: str):
    from test_planner_features import _cfg as layout_cfg
    return layout_cfg(layout, 32, model="llama-70b")


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_overlap_hides_the_column_linears_backward_collectives(sp):
    """Llama 3 70B, TP 8 in a node, one 8k sequence per micro-batch, full recomputation: each
    block's two column-parallel linears (q/k/v, gate/up) hide their input gradient's all-reduce
    behind the weight-gradient GEMM (1.1 TFLOP per pass and block, longer than the collectives);
    with sequence parallel they hide its reduce-scatter there and re-gather their sequence-sharded
    input behind the input-gradient GEMM (one more all-gather moved, none exposed), while the
    row-parallel linears' gradient all-gathers stay exposed. Nothing else in the step moves but,
    with sequence parallel, the copies beside collectives on the sequence dim, which Megatron-LM's
    sequence-first activations do not make."""
    cfg = _cfg("fsdp4 tp8sp mb1x1 ac-full" if sp else "fsdp4 tp8 mb1x1 ac-full")
    m = cfg.model
    act = 8192 * m.d_model * 2  # bf16 activations of one sequence
    plain = predict(cfg, "h100", per_rank=False).breakdown
    meg = predict(cfg, "h100", per_rank=False, features=("megatron_tp_overlap",)).breakdown
    if sp:
        hidden, extra = 2 * _ring("reduce_scatter", act), 2 * _ring("all_gather", act)
    else:
        hidden, extra = 2 * _ring("all_reduce", act), 0.0
    assert plain["tp_exposed"] - meg["tp_exposed"] == pytest.approx(m.n_layers * hidden, rel=1e-6)
    assert meg["tp_comm"] - plain["tp_comm"] == pytest.approx(m.n_layers * extra, rel=1e-6, abs=1e-12)
    assert meg["compute"] == pytest.approx(plain["compute"] - plain["sp_copies"], rel=1e-12)
    assert meg["sp_copies"] == 0 and (plain["sp_copies"] > 0) == sp and meg["dp_comm"] == plain["dp_comm"]


def test_megatron_overlap_is_refused_without_tp(capsys):
    """Without a tpN part: one line naming the flag, exit 2; in a search only TP layouts take it."""
    from shardlab.analysis.plan_features import applicable
    from shardlab.cli import main
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", "h100", "--layout", "fsdp8 mb1x1",
                 "--megatron-tp-overlap"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: --megatron-tp-overlap") and "\n" not in err, err
    assert applicable(_cfg("fsdp32 mb1x1 ac-full"), ("megatron_tp_overlap",)) == ()
    assert applicable(_cfg("fsdp4 tp8 mb1x1 ac-full"), ("megatron_tp_overlap",)) == ("megatron_tp_overlap",)


def _llama_dims(m):
    """(elements of one block's linear weights, of the output head) of a Llama config."""
    d, hd, kv = m.d_model, m.d_model // m.n_heads, m.n_kv_heads or m.n_heads
    return 2 * d * d + 2 * d * kv * hd + 3 * d * m.ffn_hidden, m.vocab_size * m.d_model


def test_half_params_keeps_no_weight_copies_and_megatrons_model_state():
    """``half_params`` (Megatron-LM's Float16Module): Llama 3 8B, DDP 8, bf16, one micro-batch, no
    recomputation. fp32 weights under autocast save a bf16 copy of every linear weight and of the
    head per micro-batch (2 bytes an element, whatever the sequence); 16-bit weights save none,
    and their residual stream is 16-bit too (a per-token difference). The part of the saved-bytes
    difference that does not grow with the sequence is exactly the copies; the model state is
    2 + 4 + 12 bytes a parameter (weights, fp32 main gradients, fp32 main weights and moments)
    against the fp32 engine's 4 + 4 + 8; elementwise time drops by the eager 12 passes over the
    bytes no longer saved, at the H100's HBM rate; matmul and attention time do not move."""
    from shardlab.analysis.devices import HBM_EFF
    from test_planner_features import _cfg as layout_cfg
    diff = {}
    for seq in (2048, 4096):
        cfg = layout_cfg("ddp8 mb1x1 ac-none", 8, seq=seq)
        plain = predict(cfg, "h100", per_rank=False)
        half = predict(cfg, "h100", per_rank=False, features=("half_params",))
        diff[seq] = plain.peak.activations - half.peak.activations
    m = cfg.model
    block, head = _llama_dims(m)
    psi = m.n_layers * (block + 2 * m.d_model) + 2 * head + m.d_model  # untied embedding and head
    copies = 2 * diff[2048] - diff[4096]  # diff = copies + k x seq
    assert copies == 2 * (m.n_layers * block + head)
    assert diff[2048] > copies  # the 16-bit residual stream saves fewer bytes as well
    assert (plain.peak.params, plain.peak.grads, plain.peak.optim) == (4 * psi, 4 * psi, 8 * psi)
    assert (half.peak.params, half.peak.grads, half.peak.optim) == (2 * psi, 4 * psi, 12 * psi)
    a, b = plain.breakdown, half.breakdown
    assert (a["matmul"], a["attention"]) == (b["matmul"], b["attention"])
    assert a["elementwise"] - b["elementwise"] == pytest.approx(12 * diff[4096] / (3.35e12 * HBM_EFF), rel=1e-9)


def test_half_params_is_refused_on_the_cpu_and_runs_from_the_command_line(capsys, monkeypatch):
    from shardlab.analysis import devices
    from shardlab.cli import main

    def no_probe(*a, **k):  # the refusal comes before the CPU's probe (a minute on a fresh machine)
        raise AssertionError("the CPU probe ran before a GPU-only option was refused")
    monkeypatch.setattr(devices, "probe_cpu", no_probe)
    assert main(["plan", "llama-8b", "--gpus", "2", "--gpu", "cpu", "--layout", "ddp2 mb1x1", "--half-params"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: --half-params") and "\n" not in err, err
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", "a100", "--seq", "2048", "--global-batch", "8",
                 "--layout", "tp8 mb1x8 ac-full", "--half-params"]) == 0
    out = capsys.readouterr().out
    assert "tp8 mb1x8 ac-full" in out
