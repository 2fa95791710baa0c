"""The features the planner prices beyond shardlab's engine (analysis/plan_features.py), each
checked against its mechanism computed here from the model's dimensions and the datasheet
figures, not from the planner's own helpers."""
import pytest

from shardlab.analysis.devices import get_device
from shardlab.analysis.plan_features import block_weights
from shardlab.analysis.plan_layout import apply_layout, parse_layout
from shardlab.analysis.predict import predict
from shardlab.commands.plan_cmd import load_model
from shardlab.errors import ConfigError


def _cfg(layout, gpus, model="llama-8b", seq=8192):
    base = load_model(model)
    base.train.precision, base.train.seq_len = "bf16", seq
    base.model.max_seq_len = max(base.model.max_seq_len, seq)
    return apply_layout(base, parse_layout(layout), gpus)


def _llama_linears(m, tp):
    """(out, in) of one Llama block's linears on a TP rank: q, k, v, o, gate, up, down."""
    d, hd = m.d_model, m.d_model // m.n_heads
    kv = m.n_kv_heads or m.n_heads
    return sorted([(d // tp, d), (kv * hd // tp, d), (kv * hd // tp, d), (d, d // tp),
                   (m.ffn_hidden // tp, d), (m.ffn_hidden // tp, d), (d, m.ffn_hidden // tp)])


def test_float8_runs_the_block_gemms_at_the_fp8_peak():
    """The blocks' matmul FLOPs move from the bf16 to the fp8 dense peak (H100: 989 -> 1,979
    TFLOP/s, datasheet); the output head's stay: matmul seconds x ((1 - s) + s x 989 / 1979), s
    the blocks' share of the matmul parameters."""
    cfg = _cfg("fsdp8 mb2x1 ac-op", 8)
    m = cfg.model
    block = m.n_layers * sum(o * i for o, i in _llama_linears(m, 1))
    share = block / (block + m.d_model * m.vocab_size)
    bf16 = predict(cfg, "h100", per_rank=False).breakdown
    fp8 = predict(cfg, "h100", per_rank=False, features=("float8",)).breakdown
    assert (get_device("h100").peak_flops, get_device("h100").peak_fp8) == (989e12, 1979e12)
    assert fp8["matmul"] / bf16["matmul"] == pytest.approx((1 - share) + share * 989 / 1979, rel=1e-9)
    assert fp8["step_s"] < bf16["step_s"] and bf16["fp8_casts"] == 0


@pytest.mark.parametrize("layout, tp, recompute", [("fsdp4 tp2sp mb1x1", 2, False), ("fsdp8 mb1x1 ac-full", 1, True)])
def test_float8_scaling_casts_are_passes_over_the_linears_operands(layout, tp, recompute):
    """Per block and micro-batch: amax (read 2 B) + cast (read 2, write 1) of x and W forward and
    again backward, one amax and two casts of dY; a recomputed forward casts x and W again."""
    cfg = _cfg(layout, 8, seq=4096)
    m = cfg.model
    lin = _llama_linears(m, tp)
    assert sorted(block_weights(cfg)) == lin
    tokens = 4096
    x, w, dy = (sum(tokens * i for _, i in lin), sum(o * i for o, i in lin), sum(tokens * o for o, _ in lin))
    per_block = 10 * x + 10 * w + 8 * dy + (5 * x + 5 * w if recompute else 0)
    got = predict(cfg, "h100", per_rank=False, features=("float8",)).breakdown["fp8_casts"]
    assert got == pytest.approx(per_block * m.n_layers / 3.35e12, rel=1e-9)


def test_float8_leaves_memory_unchanged():
    """Float8Linear saves its bf16 input and weight; FSDP gathers bf16 (fp8 all-gather off)."""
    cfg = _cfg("fsdp8 mb2x1 ac-op", 8)
    a = predict(cfg, "h100", per_rank=False).peak
    b = predict(cfg, "h100", per_rank=False, features=("float8",)).peak
    assert a.total == b.total and a.activations == b.activations


def test_float8_refused_without_fp8_tensor_cores():
    with pytest.raises(ConfigError, match="no fp8 tensor cores"):
        predict(_cfg("fsdp8 mb2x1 ac-op", 8), "a100", per_rank=False, features=("float8",))
