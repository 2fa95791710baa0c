"""The features the planner prices beyond shardlab's engine (analysis/plan_features.py), each
checked against its mechanism computed here from the model's dimensions and the datasheet
figures, not from the planner's own helpers."""
import pytest

from shardlab.analysis.devices import HBM_EFF, get_device
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
    again backward, one amax and two casts of dY; a recomputed forward casts x and W again; at the
    datasheet HBM rate (H100: 3.35 TB/s) x the measured share an elementwise kernel moves."""
    cfg = _cfg(layout, 8, seq=4096)
    m = cfg.model
    lin = _llama_linears(m, tp)
    assert sorted(block_weights(cfg)) == lin
    tokens = 4096
    x, w, dy = (sum(tokens * i for _, i in lin), sum(o * i for o, i in lin), sum(tokens * o for o, _ in lin))
    per_block = 10 * x + 10 * w + 8 * dy + (5 * x + 5 * w if recompute else 0)
    got = predict(cfg, "h100", per_rank=False, features=("float8",)).breakdown["fp8_casts"]
    assert get_device("h100").hbm_bw == 3.35e12
    assert got == pytest.approx(per_block * m.n_layers / (3.35e12 * HBM_EFF), rel=1e-9)


def test_float8_leaves_memory_unchanged():
    """Float8Linear saves its bf16 input and weight; FSDP gathers bf16 (fp8 all-gather off)."""
    cfg = _cfg("fsdp8 mb2x1 ac-op", 8)
    a = predict(cfg, "h100", per_rank=False).peak
    b = predict(cfg, "h100", per_rank=False, features=("float8",)).peak
    assert a.total == b.total and a.activations == b.activations


def test_float8_refused_without_fp8_tensor_cores():
    with pytest.raises(ConfigError, match="no fp8 tensor cores"):
        predict(_cfg("fsdp8 mb2x1 ac-op", 8), "a100", per_rank=False, features=("float8",))


@pytest.mark.parametrize("comm, overlap, tp, exposed", [
    (8.0, 100.0, 8, 1.0),     # matmuls longer than the collectives: only the first chunk shows
    (8.0, 3.0, 8, 5.0),       # shorter: first chunk + what the matmuls cannot cover (7 - 3)
    (8.0, 0.0, 8, 8.0),       # nothing to hide behind
    (8.0, 100.0, 1, 8.0),     # no TP: nothing split
])
def test_async_tp_hides_all_but_the_first_chunk_up_to_the_matmuls(comm, overlap, tp, exposed):
    from shardlab.analysis.plan_features import async_tp_exposed
    assert async_tp_exposed(comm, overlap, tp) == pytest.approx(exposed)


def test_async_tp_in_a_step():
    """tp8sp on H100 (NVLink 360 GB/s, 10 us per ring step): per block 4 sequence-parallel sites,
    2 more per recomputed block, each an all-gather and a reduce-scatter of the micro-batch's
    activations; async TP leaves the first of 8 chunks of those exposed (the blocks' matmuls are
    longer), the embedding's pair and the cross-entropy's 3 all-reduces stay exposed."""
    import math
    cfg = _cfg("fsdp8 tp8sp mb1x1 ac-full", 64, model="llama-8b")
    m, s = cfg.model, cfg.train.seq_len

    def ring(nbytes, factor):
        return 2 * math.log2(8) * 10e-6 + factor * nbytes * 7 / 8 / 360e9
    one = 2 * ring(s * m.d_model * 2, 1.0)
    blocks = one * 6 * m.n_layers
    rest = 2 * one + 3 * ring(4 * s, 2.0)
    sync = predict(cfg, "h100", per_rank=False).breakdown
    asy = predict(cfg, "h100", per_rank=False, features=("async_tp",)).breakdown
    assert sync["tp_comm"] == pytest.approx(blocks + rest, rel=1e-9) and sync["tp_exposed"] == sync["tp_comm"]
    assert asy["tp_exposed"] == pytest.approx(blocks / 8 + rest, rel=1e-9)
    assert asy["matmul"] == sync["matmul"] and asy["step_s"] < sync["step_s"]


def test_layer_policy_checkpoints_every_second_block():
    """torchtitan: a counter over the blocks from 1, block k wrapped when k % freq == 0."""
    from shardlab.analysis.plan_features import layer_ac_blocks, layer_ac_share
    assert layer_ac_blocks(5) == [False, True, False, True, False]
    assert layer_ac_blocks(4, 1) == [True] * 4 and layer_ac_share(3) == pytest.approx(1 / 3)


def test_layer_policy_mixes_the_blocks():
    """3 blocks, the 2nd recomputed: the rank holds two blocks' saved tensors and one block's
    input, recomputes one block's forward."""
    cfg = _cfg("fsdp2 mb2x1 ac-full", 2, model="tiny", seq=64)
    cfg.model.n_layers = 3
    full = predict(cfg, "h100", per_rank=False)
    import copy
    c0 = copy.deepcopy(cfg)
    c0.parallel.activation_checkpointing = "none"
    none = predict(c0, "h100", per_rank=False)
    per_block_full = (none.peak.activations - full.peak.activations) / 3  # a block's saved bytes minus its input
    mixed = predict(cfg, "h100", per_rank=False, features=("selective_layer_ac",))
    assert mixed.peak.activations == pytest.approx(full.peak.activations + 2 * per_block_full, rel=1e-9)
    assert mixed.breakdown["recompute"] == pytest.approx(full.breakdown["recompute"] / 3, rel=1e-9)
    with pytest.raises(ConfigError, match="ac-full"):
        predict(c0, "h100", per_rank=False, features=("selective_layer_ac",))


def test_ac_layer_in_a_pinned_layout(capsys):
    """``--layout ... ac-layer`` is the per-layer policy: the config recomputes fully, the
    prediction mixes (plan_features), and the printed row says ac-layer."""
    from shardlab.analysis.plan_layout import predict_pinned
    from shardlab.cli import main
    base = load_model("llama-8b")
    base.train.precision, base.train.seq_len, base.train.global_batch = "bf16", 8192, 64
    cfg, pred = predict_pinned(base, parse_layout("fsdp64 mb1x1 ac-layer"), 64, "a100")
    ref = predict(_cfg("fsdp64 mb1x1 ac-full", 64), "a100", per_rank=False, features=("selective_layer_ac",))
    assert cfg.parallel.activation_checkpointing == "full" and pred.step_time_s == ref.step_time_s
    assert pred.breakdown["layer_ac_share"] == 0.5 and pred.peak.activations == ref.peak.activations
    assert main(["plan", "llama-8b", "--gpus", "64", "--gpu", "a100", "--seq", "8192", "--layout", "fsdp64 mb1x1 ac-layer"]) == 0
    assert "fsdp64 mb1x1 ac-layer" in capsys.readouterr().out


def test_fsdp_gathers_hide_behind_the_other_units():
    """FSDP 8 on one H100 node (NVLink 360 GB/s, 10 us per ring step), reshard after forward: per
    unit (32 blocks + the root) two bf16 all-gathers (forward, backward) and one fp32
    reduce-scatter of its bytes; all hidden behind the compute but the step's edges: the root's
    (embedding, final norm, head) and a block's gathers before the first block can run, a block's
    and the root's reduce-scatters after the backward is done."""
    import math
    cfg = _cfg("fsdp8 mb2x1 ac-op", 8)
    m = cfg.model
    d, kv = m.d_model, m.n_kv_heads * (m.d_model // m.n_heads)
    n = 2 * m.vocab_size * d + d + m.n_layers * (2 * d * d + 2 * d * kv + 3 * d * m.ffn_hidden + 2 * d)
    units = m.n_layers + 1

    def ring(nbytes):
        return 2 * math.log2(8) * 10e-6 + nbytes * 7 / 8 / 360e9
    total = units * (2 * ring(2 * n / units) + ring(4 * n / units))
    b = predict(cfg, "h100", per_rank=False).breakdown
    assert b["dp_comm"] == pytest.approx(total, rel=1e-3)  # flat buffers padded to 8 ranks
    root = 2 * m.vocab_size * d + d
    block = (n - root) / m.n_layers
    edges = ring(2 * root) + ring(2 * block) + ring(4 * block) + ring(4 * root)
    assert b["dp_comm"] < b["compute"] and b["exposed_comm"] == pytest.approx(edges, rel=1e-3)


def test_hbm_share_is_the_measured_add():
    """devices.HBM_EFF is the rate of the add that benchmarks/gpu_kernels.py measured on an H100
    (its saved JSON: bytes / seconds over the datasheet's 3.35 TB/s), and every GPU kind uses it."""
    import json
    from pathlib import Path
    from shardlab.analysis.devices import DEVICES
    data = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                       / "gpu_kernels_h100_2026-11-27.json").read_text())
    add = next(r for r in data["rows"] if r["kind"] == "elementwise")
    assert data["kind"] == "h100" and HBM_EFF == pytest.approx(add["bytes"] / add["seconds"] / 3.35e12, abs=0.005)
    assert all(d.hbm_eff == HBM_EFF for k, d in DEVICES.items() if k != "cpu")


def test_torch_cp_prices_the_eager_ring_traffic_and_its_gather():
    """``torch_cp`` on Llama-3.1-8B CP 8 at 256k tokens, one node: per micro-batch, 32 blocks x
    (two forwards, full recomputation, + one backward) x the bytes per query element
    (tests/distributed/test_torch_cp_bytes.py checks them against torch's ring) over 32k tokens x
    32 heads x 128 (K/V repeated to the query heads), at the measured HBM share; its all-gather
    of 8 x 32k x 32 x 128 x 2 x 2 bytes over NVLink (360 GB/s) hides behind 1/8 of a block's
    forward attention; the last fp32 dK/dV hop of each block's backward (32k x 32 x 128 x 2 x 4
    bytes, one send) has no kernel behind it (tests/distributed/test_torch_cp_bytes.py shows the
    order in torch's ring) and is the ring's only exposed communication here. Across nodes (405B, TP 8 in a node, CP 8 over 8 nodes at 45 GB/s per
    NIC) the gather no longer hides."""
    from shardlab.analysis.plan_features import torch_cp_bwd_bytes, torch_cp_fwd_bytes
    cfg = _cfg("fsdp1 cp8 mb1x1 ac-full", 8, seq=262144)
    plain = predict(cfg, "h100", per_rank=False).breakdown
    torch_cp = predict(cfg, "h100", per_rank=False, features=("torch_cp",)).breakdown
    elems = 262144 // 8 * 32 * 128
    traffic = 32 * (2 * torch_cp_fwd_bytes(8) + torch_cp_bwd_bytes(8)) * elems / (3.35e12 * HBM_EFF)
    assert (torch_cp_fwd_bytes(8), torch_cp_bwd_bytes(8)) == (9 * 6 + 7 * (32 + 8), 12 + 30 + 7 * (36 + 8) + 8 * 16 + 18)
    assert torch_cp["cp_traffic"] == pytest.approx(traffic, rel=1e-9) and plain["cp_traffic"] == 0
    gather = 2 * 3 * 10e-6 + 8 * elems * 4 * 7 / 8 / 360e9
    last_hop = 32 * (10e-6 + 8 * elems / 360e9)  # a block's dK + dV in fp32, once a backward
    assert gather < torch_cp["attention"] / 32 / 3.5 / 8
    assert torch_cp["cp_comm"] == pytest.approx(last_hop, rel=1e-9)
    assert torch_cp["step_s"] == pytest.approx(plain["step_s"] + traffic + last_hop, rel=1e-6)
    wide = _cfg("fsdp1 tp8sp cp8 pp8 1f1b mb1x8 ac-full", 512, model="llama-405b", seq=262144)
    assert predict(wide, "h100", per_rank=False, features=("torch_cp",)).breakdown["cp_comm"] > 0


def test_torch_cp_is_refused_where_it_cannot_apply(capsys):
    """--torch-cp without a ring CP part: one line naming the flag, exit 2; in a search it applies
    to the layouts with ring CP only."""
    from shardlab.analysis.plan_features import applicable
    from shardlab.cli import main
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", "h100", "--layout", "fsdp8 mb1x1", "--torch-cp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: --torch-cp") and "\n" not in err, err
    assert applicable(_cfg("fsdp8 mb1x1", 8), ("torch_cp",)) == ()
    assert applicable(_cfg("fsdp4 cp2 mb1x1", 8, seq=65536), ("torch_cp",)) == ("torch_cp",)
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", "h100", "--seq", "32768", "--global-batch", "4",
                 "--layout", "fsdp4 cp2 mb1x1 ac-full", "--torch-cp"]) == 0  # 16k tokens a rank: fits 80 GB


def test_single_device_benchmark_states_the_planner_beside_the_measurement():
    """benchmarks/single_device.py prints, on a GPU, the planner's tokens/s for the run's config on
    the device's kind and its error against the measured loop (here a measured figure is given)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import single_device
    from shardlab import config as C
    import shardlab.train.checks  # noqa: F401
    cfg = C.load("configs/llama-1b.toml", ["--parallel.compile=true"])
    cfg.validate(1)
    want = predict(cfg, "h100", per_rank=False).tokens_per_s
    line = single_device.planner_line(cfg, "h100", 60097.0)
    assert f"{want:,.0f} tok/s predicted" in line and "60,097 measured" in line
    assert f"({100 * (want - 60097) / 60097:+.1f}%)" in line


def _llama_params(m):
    """(all parameters, the root unit's: embedding, final norm, head) of a Llama from its dimensions."""
    hd, kv = m.d_model // m.n_heads, m.n_kv_heads or m.n_heads
    block = 2 * m.d_model * m.d_model + 2 * m.d_model * kv * hd + 3 * m.d_model * m.ffn_hidden + 2 * m.d_model
    root = 2 * m.vocab_size * m.d_model + m.d_model
    return m.n_layers * block + root, root


def test_fsdp2_copies_are_gathered_bytes_on_the_compute_stream():
    """``fsdp2`` on Llama-3.1-8B FSDP 8: per step, each block unit's bf16 bytes copied out of the
    all-gather output twice (forward, and backward after resharding), the root's once, each read
    and written, plus the reduce-scatter copy-in reading the bf16 gradients and writing fp32
    (tests/distributed/test_fsdp2_copy_bytes.py counts the same bytes in FSDP2 itself), at the
    measured HBM share, where shardlab's own engine only casts the flat gradient to fp32 (bf16 read,
    fp32 written); the step grows by exactly the difference, and the copies are not communication."""
    cfg = _cfg("fsdp8 mb2x1 ac-op", 8)
    n, root = _llama_params(cfg.model)
    want = (2 * (2 * 2 * (n - root) + 2 * root) + 2 * n + 4 * n) / (3.35e12 * HBM_EFF)
    cast = (2 * n + 4 * n) / (3.35e12 * HBM_EFF)  # shardlab's own engine: the flat gradient cast to fp32 only
    plain = predict(cfg, "h100", per_rank=False).breakdown
    fsdp2 = predict(cfg, "h100", per_rank=False, features=("fsdp2",)).breakdown
    assert fsdp2["copies"] == pytest.approx(want, rel=1e-3) and plain["copies"] == pytest.approx(cast, rel=1e-3)
    assert fsdp2["step_s"] == pytest.approx(plain["step_s"] + fsdp2["copies"] - plain["copies"], rel=1e-9)
    assert fsdp2["exposed_comm"] == pytest.approx(plain["exposed_comm"], rel=1e-9)


def test_fsdp2_is_refused_where_it_cannot_apply(capsys):
    """--fsdp2 without ZeRO-3: one line naming the flag, exit 2; in a search only ZeRO-3 layouts take it;
    on a ZeRO-3 layout the summary states the copies' seconds."""
    from shardlab.analysis.plan_features import applicable
    from shardlab.cli import main
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", "h100", "--layout", "ddp8 mb1x1", "--fsdp2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: --fsdp2") and "\n" not in err, err
    assert applicable(_cfg("ddp8 mb1x1", 8), ("fsdp2",)) == ()
    assert applicable(_cfg("fsdp8 mb1x1", 8), ("fsdp2",)) == ("fsdp2",)
    assert main(["plan", "llama-8b", "--gpus", "8", "--gpu", "h100", "--layout", "fsdp8 mb1x1 ac-full", "--fsdp2"]) == 0
    out = capsys.readouterr().out  # the step's sentence names the copies beside compute and communication
    assert "s FSDP copies and" in out and "s optimizer step." in out, out


def test_compile_blocks_leaves_the_head_and_loss_eager():
    """``compile_blocks`` (torchtitan compiles each block only): the embedding's, head's and loss's
    traced bytes take the eager passes (12) instead of the fused ones (4); what they are: at least
    the fp32 logits the loss reads (b x s x vocab x 4 bytes), at most those and the bf16 head output."""
    from shardlab.analysis.plan_activations import chunk_activations
    from shardlab.analysis.plan_time import ELEMENTWISE_PASSES as P
    cfg = _cfg("fsdp8 mb2x1 ac-op", 8)
    cfg.parallel.compile = True
    ends = sum(chunk_activations(cfg, 0, "gpu")["ends"].values())
    logits = 2 * 8192 * cfg.model.vocab_size
    assert 4 * logits <= ends <= 6 * logits, ends / logits
    fused = predict(cfg, "h100", per_rank=False).breakdown
    blocks = predict(cfg, "h100", per_rank=False, features=("compile_blocks",)).breakdown
    extra = (P["eager"] - P["fused"]) * ends / (3.35e12 * HBM_EFF)
    assert blocks["elementwise"] - fused["elementwise"] == pytest.approx(extra, rel=1e-9)
    assert blocks["recompute"] == pytest.approx(fused["recompute"], rel=1e-9)  # the op policy recomputes blocks only
    cfg.parallel.compile = False  # eager: nothing to leave out
    assert predict(cfg, "h100", per_rank=False, features=("compile_blocks",)).breakdown["elementwise"] == \
        pytest.approx(predict(cfg, "h100", per_rank=False).breakdown["elementwise"], rel=1e-12)


def test_float8_gathers_the_sequence_parallel_inputs_in_fp8():
    """Float8 with sequence-parallel TP (torchao's Float8ColwiseParallel behind
    PrepareFloat8ModuleInput: the input is cast before its all-gather): each block's two forward
    all-gathers, and their repeats in the recomputed forward, move 1 byte per element instead of
    2; the backward's collectives stay bf16. Ring formulas on NVLink (360 GB/s, 10 us per step)."""
    cfg = _cfg("fsdp32 tp8sp mb16x1 ac-full", 256, model="llama-70b")
    act = 16 * 8192 * 8192 * 2  # one micro-batch of 16 sequences x d_model, bf16

    def gather(nbytes):
        return 2 * 3 * 10e-6 + nbytes * 7 / 8 / 360e9
    plain = predict(cfg, "h100", per_rank=False).breakdown
    f8 = predict(cfg, "h100", per_rank=False, features=("float8",)).breakdown
    sites = 80 * 2 * 2  # 80 blocks x 2 gathers x (forward + recomputed forward)
    assert plain["tp_comm"] - f8["tp_comm"] == pytest.approx(sites * (gather(act) - gather(act / 2)), rel=1e-9)
    nosp = _cfg("fsdp32 tp8 mb16x1 ac-full", 256, model="llama-70b")  # no SP: all-reduces, unchanged
    assert predict(nosp, "h100", per_rank=False, features=("float8",)).breakdown["tp_comm"] == \
        pytest.approx(predict(nosp, "h100", per_rank=False).breakdown["tp_comm"], rel=1e-12)


def test_fsdp2_in_pipeline_stages_hides_the_gathers_not_the_reduce_scatters():
    """``fsdp2`` on Llama-3.1-8B FSDP 4 x PP 2 (one H100 node): torch's pipelining keeps each
    stage unsharded after its first micro-batch's forward, which the gathers run behind but for
    the stage's first two units (16 blocks + the head and final norm: 17 units), and issues every
    reduce-scatter together after the last backward (exposed, as shardlab's own stage sharding
    exposes both). The exposed communication drops by exactly the gathers less those two units."""
    import math
    cfg = _cfg("fsdp4 pp2 1f1b mb1x8 ac-full", 8)
    cfg.train.param_dtype, cfg.train.reduce_dtype = "bf16", "fp32"  # torchtitan's policy: bf16 gathers
    m = cfg.model
    d, kv = m.d_model, m.n_kv_heads * (m.d_model // m.n_heads)
    block = 2 * d * d + 2 * d * kv + 3 * d * m.ffn_hidden + 2 * d
    stage = 16 * block + m.vocab_size * d + d  # the last stage: the slower by its norm

    def ring(nbytes):
        return 2 * math.log2(4) * 10e-6 + nbytes * 3 / 4 / 360e9
    plain = predict(cfg, "h100", per_rank=False).breakdown
    fsdp2 = predict(cfg, "h100", per_rank=False, features=("fsdp2",)).breakdown
    assert fsdp2["dp_comm"] == pytest.approx(plain["dp_comm"], rel=1e-12)
    hidden = ring(2 * stage) - 2 * ring(2 * stage / 17)
    assert plain["exposed_comm"] - fsdp2["exposed_comm"] == pytest.approx(hidden, rel=1e-3)


@pytest.mark.parametrize("layout", ["fsdp2 tp2sp pp2 1f1b mb1x4 ac-full", "fsdp2 tp2 pp2 1f1b mb1x4 ac-full"])
def test_pipeline_boundary_sends_what_the_engine_sends(layout):
    """A stage boundary moves the tensor the pipeline engine sends (executor.activation_shape: with
    sequence parallel each TP rank's sequence shard), forward and its gradient backward, per
    micro-batch, on one H100 node (NVLink 360 GB/s, 10 us)."""
    import math
    from shardlab.parallel.pipeline.executor import activation_shape
    cfg = _cfg(layout, 8)
    sent = math.prod(activation_shape(cfg)) * 2  # bf16
    b = predict(cfg, "h100", per_rank=False).breakdown
    assert b["pp_p2p"] == pytest.approx(4 * 2 * (10e-6 + sent / 360e9), rel=1e-9)


def test_sequence_parallel_copies_beside_the_collectives():
    """Llama 3 8B, FSDP 2 x TP 4 with sequence parallel, 2 sequences of 8k a micro-batch, full
    recomputation, on H100s: each block's two sites (an all-gather and a reduce-scatter each) copy
    the gathered bf16 tensor, read and written once (the chunk + cat of a collective on the
    sequence dim), in the forward, the recomputed forward and the backward, and the embedding's and
    head's pair once each way; at the H100's HBM rate x the measured share. Float8 gathers fp8 in
    the (recomputed) forward; asynchronous TP, Megatron-LM's sequence-first layout
    (megatron_tp_overlap) and TP without sequence parallel copy nothing."""
    cfg = _cfg("fsdp2 tp4sp mb2x1 ac-full", 8)
    m, hbm = cfg.model, 3.35e12 * HBM_EFF
    full = 2 * 8192 * m.d_model
    collectives = m.n_layers * 2 * 2 * 3 + 2 * 2
    assert predict(cfg, "h100", per_rank=False).breakdown["sp_copies"] == pytest.approx(
        collectives * 2 * full * 2 / hbm, rel=1e-9)
    fp8 = predict(cfg, "h100", per_rank=False, features=("float8",)).breakdown["sp_copies"]
    assert fp8 == pytest.approx((collectives * 4 * full - m.n_layers * 2 * 2 * 2 * full) / hbm, rel=1e-9)
    for layout, feats in (("fsdp2 tp4sp mb2x1 ac-full", ("async_tp",)),
                          ("fsdp2 tp4sp mb2x1 ac-full", ("megatron_tp_overlap",)), ("fsdp2 tp4 mb2x1 ac-full", ())):
        assert predict(_cfg(layout, 8), "h100", per_rank=False, features=feats).breakdown["sp_copies"] == 0
