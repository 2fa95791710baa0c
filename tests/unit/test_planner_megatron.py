"""The planner's price of Megatron-LM's backward TP overlap (``megatron_tp_overlap``,
analysis/plan_features.py ``megatron_tp_backward``): the collectives each column-parallel
linear's backward runs behind its GEMMs, computed here from the ring formulas of the model's
activation bytes, not from the planner's helpers."""
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
    row-parallel linears' gradient all-gathers stay exposed. Nothing else in the step moves."""
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
    assert meg["compute"] == plain["compute"] and meg["dp_comm"] == plain["dp_comm"]


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
