"""The planner (docs/planner.md): model-state bytes per rank equal hand formulas (padding
included), tensor and pipeline parallel divide what a rank holds, the enumeration covers a 405B
model on 16k GPUs, and bad input is refused or answered (no fit: the smallest cluster)."""
import math

import pytest

from shardlab.analysis.plan_memory import model_state
from shardlab.config import Config
from shardlab.models import count_params, meta_model


def _tiny(**par) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 96, 64, 4, 4, 2
    m.max_seq_len = cfg.train.seq_len = 16
    cfg.train.global_batch = 12
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg.validate(cfg.parallel.world_size)


def _groups(cfg):
    """(decay, no-decay) parameter counts, by hand: matrices decay, norms (vectors) do not."""
    model = meta_model(cfg.model)
    decay = sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n)
    return decay, count_params(model) - decay


@pytest.mark.parametrize("n", [2, 3])
def test_model_state_bytes_equal_hand_formulas(n):
    """fp32 AdamW: DDP 4+4+8 bytes/param; ZeRO-1 4+4+8/N and ZeRO-2 4+4/N+8/N on flat buffers
    padded to a multiple of N (one bucket per weight-decay group here), ZeRO-3 the same 1/N of
    all three. N = 3 does not divide the groups: the padding is counted."""
    psi = count_params(meta_model(_tiny().model))
    decay, rest = _groups(_tiny())
    shard = sum(math.ceil(g / n) for g in (decay, rest))  # elements of a rank's slices
    padded = shard * n
    ddp = model_state(_tiny(dp_shard=n))
    assert (ddp["params"], ddp["grads"], ddp["optim"]) == (4 * psi, 4 * psi, 8 * psi)
    z1 = model_state(_tiny(dp_shard=n, zero_stage=1, bucket_cap_mb=1024))
    assert (z1["params"], z1["grads"], z1["optim"]) == (4 * padded, 4 * padded, 8 * shard)
    z2 = model_state(_tiny(dp_shard=n, zero_stage=2, bucket_cap_mb=1024))
    assert (z2["params"], z2["grads"], z2["optim"]) == (4 * padded, 4 * shard, 8 * shard)
    z3 = model_state(_tiny(dp_shard=n, zero_stage=3))  # one flat buffer per block and group, + the root
    model = meta_model(_tiny().model)
    units = [list(b.parameters()) for b in model.layers.values()]
    units.append([p for name, p in model.named_parameters() if not name.startswith("layers.")])
    shard3 = sum(math.ceil(g / n) for ps in units for g in (sum(p.numel() for p in ps if p.ndim >= 2),
                                                               sum(p.numel() for p in ps if p.ndim < 2)) if g)
    assert (z3["params"], z3["grads"], z3["optim"]) == (4 * shard3, 4 * shard3, 8 * shard3)


@pytest.mark.parametrize("transport", ["auto", "shared", "process_group"])
def test_zero3_gpu_prediction_holds_the_prefetched_unit_whatever_the_planning_host(transport):
    """On a GPU every FSDP all-gather is asynchronous (NCCL, or the same-GPU transport on its comm
    stream), so a prefetching rank holds the unit computing and the next one: the largest two
    blocks' gathered bytes (4 bytes x N x the rank's padded shard each) plus the root. Only CPU
    ranks on the inline shared-memory transport hold one. Before the fix the GPU figure followed
    the planning machine's CPU (x86 + comm_transport auto = inline = one unit): the H100 lease of
    2026-11-27 measured three gathered blocks at the ZeRO-3 peak against the planner's one."""
    from shardlab.analysis.predict import stage_memory
    n = 2
    cfg = _tiny(dp_shard=n, zero_stage=3, comm_transport=transport)
    model = meta_model(cfg.model)
    blocks = [4 * n * sum(math.ceil(g / n) for g in (sum(p.numel() for p in b.parameters() if p.ndim >= 2),
                                                     sum(p.numel() for p in b.parameters() if p.ndim < 2)) if g)
              for b in model.layers.values()]
    root = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    root_bytes = 4 * n * sum(math.ceil(g / n) for g in (sum(p.numel() for p in root if p.ndim >= 2),
                                                        sum(p.numel() for p in root if p.ndim < 2)) if g)
    gpu = stage_memory(cfg, 0, "h100")
    assert gpu["buffers"] == root_bytes + sum(sorted(blocks)[-2:])
    from shardlab.analysis.plan_memory import inline_transport, transport_bytes
    cpu = stage_memory(cfg, 0, "cpu")
    if inline_transport(cfg):  # CPU ranks on the shared-memory transport: one unit and its pages
        assert cpu["buffers"] == root_bytes + max(blocks) + transport_bytes(cfg, 0)
    else:  # gloo: asynchronous, as on a GPU
        assert cpu["buffers"] == gpu["buffers"]


def test_tensor_parallel_shrinks_llama_8b_per_rank_params():
    """The issue's bug: llama-8b at tp=8 must hold about 1/8 of tp=1's parameters per rank."""
    from shardlab.config import load
    one = model_state(load("configs/llama-8b.toml", {"train": {"global_batch": 8}}).validate(1))
    cfg = load("configs/llama-8b.toml", {"train": {"global_batch": 8}, "parallel": {"tp": 8}}).validate(8)
    eight = model_state(cfg)
    assert one["params"] / 8 <= eight["params"] < one["params"] / 7.5


def test_pipeline_ranks_split_the_layers():
    """pp=4 over 8 layers: every rank holds part of the model and together each parameter once."""
    cfg = _tiny(pp=4, microbatches=4)
    cfg.model.n_layers = 8
    cfg.validate(4)
    parts = [model_state(cfg, r)["params"] for r in range(4)]
    assert all(p > 0 for p in parts)
    assert sum(parts) == 4 * count_params(meta_model(cfg.model))


def test_enumeration_of_405b_on_16k_gpus_returns_layouts():
    from shardlab.analysis.plan_search import HEADROOM, enumerate_layouts, evaluate
    from shardlab.commands.plan_cmd import load_model
    base = load_model("llama-405b")
    found = []
    for cfg in enumerate_layouts(base, 16384, 8, {"tp": 8, "ac": "full", "mb": 1}):
        assert cfg.parallel.world_size == 16384
        found.append(cfg)
    assert found and all(c.parallel.tp == 8 for c in found)
    fits = [c for c in (evaluate(cfg, "h100", 8, HEADROOM * 80e9) for cfg in found[-3:]) if c is not None]
    assert all(c.tokens_per_gpu > 0 and c.peak_bytes <= HEADROOM * 80e9 for c in fits)


def test_search_reports_progress_after_every_valid_layout():
    """The CLI's status line (a terminal only) is fed by ``search``'s callback: one call per valid
    layout (also those skipped because the same layout without recomputation fits), counts rising
    to the totals the search returns."""
    from shardlab.analysis.plan_search import search
    from shardlab.commands.plan_cmd import load_model
    base = load_model("llama-8b")
    calls = []
    fits, valid, dropped = search(base, 8, "h100", 8, {"tp": 2}, progress=lambda v, f: calls.append((v, f)))
    assert valid > 1 and len(calls) == valid
    assert [v for v, _ in calls] == list(range(1, valid + 1))
    assert all(a <= b for (_, a), (_, b) in zip(calls, calls[1:])) and calls[-1][1] == len(fits)


def test_plan_no_fit_names_the_smallest_cluster(capsys):
    from shardlab.cli import main
    rc = main(["plan", "llama-8b", "--gpus", "1", "--gpu", "h100", "--global-batch", "8", "--seq", "2048",
               "--ac", "full"])
    out = capsys.readouterr().out
    assert rc == 1 and "no layout fits" in out and "smallest cluster that fits is" in out, out


def test_plan_refuses_an_impossible_degree_naming_the_field(capsys):
    from shardlab.cli import main
    assert main(["plan", "llama-8b", "--gpus", "24", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp" in err and "Traceback" not in err, err


def _stage_groups(cfg, rank):
    """(decay, no-decay) parameter counts of pipeline rank ``rank``'s stages, from the engine's own
    split (pipeline.stage.split_model on a meta model), by hand: matrices decay, norms do not."""
    from shardlab.models.spec import get_spec
    from shardlab.parallel.pipeline.stage import split_model
    p = cfg.parallel
    model, _, _ = split_model(meta_model(cfg.model), get_spec(cfg.model), rank, p.pp, p.pp_virtual)
    decay = sum(q.numel() for n, q in model.named_parameters() if q.ndim >= 2 and "norm" not in n)
    return decay, sum(q.numel() for q in model.parameters()) - decay


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_inside_pipeline_stages(zero):
    """pp=2 x dp_shard=3, fp32: a stage's flat buffers (one per weight-decay group) padded to a
    multiple of 3; after the step ZeRO-1 keeps the full buffer, ZeRO-3 only its slice; gradient,
    m and v are slices (pipeline/sharded.py)."""
    cfg = _tiny(pp=2, dp_shard=3, zero_stage=zero, microbatches=2)
    cfg.model.tie_embeddings = False
    cfg.validate(6)
    for r in range(2):
        shard = sum(math.ceil(g / 3) for g in _stage_groups(cfg, r))
        st = model_state(cfg, r)
        assert (st["params"], st["grads"], st["optim"]) == (4 * shard * (3 if zero == 1 else 1), 4 * shard, 8 * shard)


def test_dualpipe_holds_two_parameter_copies():
    """DualPipe at pp=2: each rank holds parts r and p-1-r, i.e. the whole model; DualPipeV one copy
    split over the ranks."""
    def cfg_of(name):
        cfg = _tiny(pp=2, pp_schedule=name, microbatches=4, dp_replicate=1)
        cfg.model.tie_embeddings = False
        return cfg.validate(2)
    psi = count_params(meta_model(cfg_of("dualpipe").model))
    assert [model_state(cfg_of("dualpipe"), r)["params"] for r in range(2)] == [4 * psi, 4 * psi]
    assert sum(model_state(cfg_of("dualpipev"), r)["params"] for r in range(2)) == 4 * psi


def test_zb_h1_frees_the_graph_at_b_and_holds_the_w_stash():
    """Every weight of the tiny Llama has a direct W (pipeline/wgrad.py), so ZB-H1's B frees the
    graph: its saved activations equal 1F1B's on every rank, and the W stash is a separate term."""
    from shardlab.analysis.predict import memory_per_rank

    def ranks(name):
        cfg = _tiny(pp=2, pp_schedule=name, microbatches=4)
        cfg.model.tie_embeddings = False
        return memory_per_rank(cfg.validate(2))
    zb, one = ranks("zb-h1"), ranks("1f1b")
    assert [r.activations for r in zb] == [r.activations for r in one]
    assert all(r.wgrad > 0 for r in zb) and all(r.wgrad == 0 for r in one)


def test_expert_weights_shard_over_edp():
    """ZeRO-3 with ep=2 over dp_shard=4: expert weights (the rank's E/ep experts) shard over the
    edp = 2 ranks holding the same experts, everything else over all 4 (zero.flat_groups)."""
    cfg = _tiny(dp_shard=4, zero_stage=3)
    m = cfg.model
    m.n_experts, m.moe_top_k = 4, 2
    cfg.parallel.ep = 2
    cfg.validate(4)
    st = model_state(cfg)
    model = meta_model(m)
    units = [list(b.named_parameters()) for b in model.layers.values()]
    units.append([(n, p) for n, p in model.named_parameters() if not n.startswith("layers.")])
    shard = 0
    for named in units:
        experts = [p.numel() // 2 for n, p in named if ".experts." in n]  # this rank's half of the experts
        dense = [p for n, p in named if ".experts." not in n]
        for g in (sum(p.numel() for p in dense if p.ndim >= 2), sum(p.numel() for p in dense if p.ndim < 2)):
            shard += math.ceil(g / 4) if g else 0
        shard += math.ceil(sum(experts) / 2) if experts else 0
    assert (st["params"], st["grads"], st["optim"]) == (4 * shard, 4 * shard, 8 * shard)


def test_cpu_collectives_read_the_probed_curve():
    """On the CPU a collective costs what the probe measured for an all-reduce between compute at
    the layout's world size and group size: linear in bytes between probed sizes, the slope of the
    last two beyond, other kinds as the all-reduce putting as many bytes on the wire (M / 2)."""
    from types import SimpleNamespace

    from shardlab.analysis.plan_time import Curve, collective, link
    from shardlab.distributed.topology import Topology
    pts = ((4, 1e-3), (1000, 2e-3), (2000, 5e-3))
    dev = SimpleNamespace(comm_curve=((2, 2, ((4, 9.0), (8, 9.0))), (4, 2, pts), (4, 4, ((4, 7.0), (8, 7.0)))))
    bw, al = link(Topology(tp=2, dp_shard=2), "tp", dev)  # world 4, a group of 2
    assert isinstance(bw, Curve) and al == 0.0
    assert collective("all_reduce", 1500, 2, bw, al) == pytest.approx(3.5e-3)
    assert collective("all_reduce", 3000, 2, bw, al) == pytest.approx(8e-3)
    assert collective("all_gather", 2000, 2, bw, al) == pytest.approx(2e-3)
    assert collective("all_reduce", 1, 2, bw, al) == pytest.approx(1e-3)
    assert collective("all_reduce", 1000, 1, bw, al) == 0.0  # a group of one moves nothing
    bw4, _ = link(Topology(tp=2, dp_shard=2), "world", dev)
    assert bw4.seconds("all_reduce", 6) == 7.0


def test_cpu_curve_follows_the_layouts_transport():
    """The probe keeps a curve per CPU transport; a layout is costed with its own transport's
    (auto: the shared-memory one on x86-64, as the mesh picks), and a probe without per-transport
    curves (older cache) keeps its single curve."""
    from shardlab.analysis.devices import for_transport, get_device
    from shardlab.distributed.shm_host import X86
    gloo, shm = [[2, 2, [[4, 3e-3], [8, 3e-3]]]], [[2, 2, [[4, 1e-3], [8, 1e-3]]]]
    probe = {"flops": 1e10, "bw": 1e9, "alpha": 1e-4, "comm_curve": shm if X86 else gloo,
             "comm_curves": {"process_group": gloo, **({"shared": shm} if X86 else {})}}
    dev = get_device("cpu", probe)
    first = {t: for_transport(dev, t).comm_curve[0][2][0][1] for t in ("auto", "process_group", "shared")}
    assert first["process_group"] == 3e-3
    assert first["auto"] == (1e-3 if X86 else 3e-3)
    assert first["shared"] == (1e-3 if X86 else dev.comm_curve[0][2][0][1])  # not probed: unchanged
    old = get_device("cpu", {k: v for k, v in probe.items() if k != "comm_curves"})
    assert for_transport(old, "process_group") is old


def test_fitted_efficiency_divides_only_the_compute_bound_time():
    """--efficiency fitted: (step - exposed communication - optimizer - ZeRO-3's copies) / eta +
    those, and nothing else moves; eta = 1 is the stated model."""
    from shardlab.analysis.predict import predict
    cfg = _tiny(dp_shard=2, zero_stage=3)
    cfg.train.precision = "bf16"
    a, b = predict(cfg, "h100"), predict(cfg, "h100", efficiency=0.5)
    fixed = a.breakdown["exposed_comm"] + a.breakdown["optimizer"] + a.breakdown["copies"]
    assert a.breakdown["copies"] > 0  # bf16 ZeRO-3 casts its gradients to the fp32 reduce dtype
    assert b.step_time_s == pytest.approx((a.step_time_s - fixed) / 0.5 + fixed)
    assert b.tokens_per_s == pytest.approx(a.tokens_per_s * a.step_time_s / b.step_time_s)
    assert [r.total for r in a.ranks] == [r.total for r in b.ranks]


def test_cpu_compute_slows_by_the_probed_busy_factor_when_ranks_fill_the_cores():
    """The probe's ``busy`` (a block's time with one process per core at once over alone)
    multiplies the compute of layouts whose ranks fill the cores, in proportion up to that, and
    leaves one rank, the collectives and the optimizer alone."""
    from shardlab.analysis.predict import predict
    probe = {"flops": 1e10, "mm_eff": 0.8, "alpha": 1e-4, "bw": 1e9, "mem_bw": 1e10, "cores": 4,
             "op_s": 4e-6, "ew_bw": 3e9}

    def parts(busy, n):
        cfg = _tiny(dp_shard=n)
        cfg.train.precision = "fp32"
        return predict(cfg, "cpu", probe={**probe, "busy": busy}).breakdown
    for n, share in ((1, 0.0), (2, 1 / 3), (4, 1.0)):
        plain, slow = parts(1.0, n), parts(1.3, n)
        assert slow["compute"] == pytest.approx(plain["compute"] * (1 + 0.3 * share))
        assert slow["optimizer"] == plain["optimizer"] and slow["exposed_comm"] == pytest.approx(plain["exposed_comm"])


def test_a_group_across_nodes_runs_a_ring_per_nic():
    """Across nodes each GPU has its own NIC: a group with g ranks on each node runs g rings side by
    side, so its bus bandwidth is g NICs' (at most NVLink's); a group with one rank per node gets
    one NIC; a group inside a node NVLink."""
    from shardlab.analysis.devices import get_device, with_nodes
    from shardlab.analysis.plan_time import link
    from shardlab.distributed.topology import Topology
    dev = with_nodes(get_device("a100"), 8)
    nic, nvlink = 22e9, 230e9  # 200 Gb/s HDR at ~90%, NVLink 3 at ~80% (docs/planner.md)
    assert link(Topology(dp_shard=64), "dp_shard", dev)[0] == pytest.approx(min(nvlink, 8 * nic))
    assert link(Topology(dp_shard=8, tp=2), "dp_shard", dev)[0] == pytest.approx(4 * nic)  # 4 per node
    assert link(Topology(dp_shard=32, tp=8), "dp_shard", dev)[0] == pytest.approx(nic)  # one per node
    assert link(Topology(dp_shard=32, tp=8), "tp", dev)[0] == pytest.approx(nvlink)


def test_a_power_limited_part_computes_at_its_share_of_the_datasheet_peak(monkeypatch):
    """h100-gt (500 W) is credited with the bf16 peak interpolated in watts between H100 NVL (835.5
    TFLOP/s at 400 W) and H100 SXM (989.4 at 700 W): its compute takes 989.4 / 886.7 of the
    same step on an H100 SXM with its memory bandwidth; MFU stays against the datasheet peak."""
    from dataclasses import replace

    from shardlab.analysis import devices
    from shardlab.analysis.predict import predict
    cfg = _tiny(dp_shard=2)
    cfg.train.precision = "bf16"
    gt = devices.DEVICES["h100-gt"]
    capped = predict(cfg, "h100-gt").breakdown
    monkeypatch.setitem(devices.DEVICES, "h100-gt", replace(gt, sustain=1.0))
    full = predict(cfg, "h100-gt").breakdown
    share = (835.5 + (989.4 - 835.5) * (500 - 400) / (700 - 400)) / 989.4
    for part in ("matmul", "attention"):
        assert capped[part] == pytest.approx(full[part] / share)
    assert capped["elementwise"] == pytest.approx(full["elementwise"])  # HBM-bound: not the clock
    assert gt.peak_flops == 989e12


def test_flash_attention_runs_at_its_published_rate_for_the_kernels_length():
    """attn_eff by sequence length: FlashAttention-2's published forward + backward rates (causal,
    head dimension 128; H100 328 TFLOP/s at 16k, 294 at 4k; A100 182 at 4k), read in log2 of the
    length between them, flat beyond; a ring CP layout's kernels run on its shard of the sequence."""
    from shardlab.analysis.devices import get_device
    from shardlab.analysis.plan_time import attention_eff
    h100, a100 = get_device("h100"), get_device("a100")
    assert attention_eff(h100, 16384) == pytest.approx(328 / 989)
    assert attention_eff(h100, 1 << 20) == pytest.approx(328 / 989)
    assert attention_eff(h100, 4096) == pytest.approx(294 / 989)
    assert attention_eff(h100, 5793) == pytest.approx((294 + 0.5 * (308 - 294)) / 989, rel=1e-3)  # 2^12.5
    assert attention_eff(h100, 128) == pytest.approx(163 / 989)
    assert attention_eff(a100, 4096) == pytest.approx(182 / 312)
    from shardlab.analysis.predict import predict
    times = {}
    for cp in (1, 4):
        cfg = _tiny(cp=cp)
        cfg.train.precision = "bf16"
        cfg.model.max_seq_len = cfg.train.seq_len = 16384
        cfg = cfg.validate(cfg.parallel.world_size)
        times[cp] = predict(cfg, "h100").breakdown["attention"]
    # the same attention FLOPs per rank over cp, on 4,096-token kernels instead of 16,384-token ones
    assert times[4] * 4 == pytest.approx(times[1] * (328 / 294), rel=1e-6)
