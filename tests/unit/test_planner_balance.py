"""A synchronous pipeline runs its steady state at the busiest rank's pace
(plan_time.busiest_share): each rank's blocks over the engine's own stage split, and the head's
matrix product on the rank owning the last stage. Checked from the model's dimensions."""
import pytest

from shardlab.analysis.plan_layout import apply_layout, parse_layout
from shardlab.analysis.plan_time import busiest_share
from shardlab.analysis.predict import predict
from shardlab.analysis.shadow import stage_ranges
from shardlab.commands.plan_cmd import load_model


def _cfg(layout, gpus, seq=8192):
    base = load_model("llama-405b")
    base.train.precision, base.train.seq_len = "bf16", seq
    return apply_layout(base, parse_layout(layout), gpus)


def _flops(m, seq):
    """(one block's, the head's) FLOPs a token, forward + backward: 6 x the block's matrix
    parameters (q, o: d x d; k, v: d x kv heads x head_dim; gate, up, down: d x ffn) plus the full
    score and weighted-sum count 12 d S; the head 6 x vocab x d."""
    d, hd = m.d_model, m.d_model // m.n_heads
    block = 6 * (2 * d * d + 2 * d * m.n_kv_heads * hd + 3 * d * m.ffn_hidden) + 12 * d * seq
    return block, 6 * m.vocab_size * d


@pytest.mark.parametrize("layout,stages", [("fsdp8 tp8sp pp8 1f1b mb4x8 ac-full", 8),
                                           ("fsdp8 tp8sp pp8 interleaved:2 mb4x8 ac-full", 16)])
def test_busiest_rank_of_the_405b_pipelines(layout, stages):
    """126 layers: the engine's split gives the first and last stages one layer fewer (they hold the
    embedding and the head, balanced by parameters); a middle rank's 16 layers bound the pipeline."""
    cfg = _cfg(layout, 512)
    sizes = [len(r) for r in stage_ranges(cfg)]
    assert len(sizes) == stages and sum(sizes) == 126
    assert sizes[0] == sizes[-1] == 126 // stages and max(sizes) == 126 // stages + 1
    block, head = _flops(cfg.model, 8192)
    mean = (126 * block + head) / 8
    assert busiest_share(cfg) == pytest.approx(16 * block / mean, rel=1e-9)
    assert 1.01 < busiest_share(cfg) < 1.02


def test_a_heavy_head_bounds_the_pipeline():
    """Two stages of one layer each with a 128k-vocabulary head on the second: that rank carries the
    block and the head, the average rank half of both blocks and the head."""
    base = load_model("llama-405b")
    base.model.n_layers, base.train.precision = 2, "bf16"
    cfg = apply_layout(base, parse_layout("ddp1 pp2 1f1b mb1x4 ac-none"), 2)
    block, head = _flops(cfg.model, 8192)
    assert [len(r) for r in stage_ranges(cfg)] == [1, 1]
    assert busiest_share(cfg) == pytest.approx((block + head) / ((2 * block + head) / 2), rel=1e-9)


def test_the_step_runs_at_the_busiest_rank(monkeypatch):
    """1F1B with p = m = 8: the schedule's own bubble is (p - 1) / m of the average rank's span S,
    and the busiest rank adds (share - 1) x S to the steady part; fill and drain stay the average's."""
    import shardlab.analysis.plan_time as pl
    cfg = _cfg("fsdp8 tp8sp pp8 1f1b mb4x8 ac-full", 512)
    share = busiest_share(cfg)
    real = predict(cfg, "h100-gt", per_rank=False).breakdown
    monkeypatch.setattr(pl, "busiest_share", lambda c: 1.0)
    even = predict(cfg, "h100-gt", per_rank=False).breakdown
    span = even["bubble"] / (7 / 8)  # S: the average rank's micro-batches with their exposed communication
    assert real["bubble"] == pytest.approx(even["bubble"] + (share - 1) * span, rel=1e-9)
    assert real["step_s"] - even["step_s"] == pytest.approx((share - 1) * span, rel=1e-9)
    assert span > even["compute"]  # its exposed TP communication and stage-boundary sends count too


def test_llama3_split_gives_the_ends_stages_of_their_own():
    """Llama 3's split (split-ends) on 16 ranks x 8 virtual stages: the 126 layers one a chunk, the
    first chunk only the embedding, the last only the head; rank 15 carries 7 blocks and the head,
    ranks 1-14 eight blocks, which bound the pipeline."""
    cfg = _cfg("fsdp64 tp8sp pp16 interleaved:8 split-ends mb1x32", 8192)
    ranges = stage_ranges(cfg)
    assert len(ranges) == 128 and (ranges[0].start, ranges[0].stop) == (0, 0)
    assert (ranges[-1].start, ranges[-1].stop) == (126, 126) and all(len(r) == 1 for r in ranges[1:-1])
    block, head = _flops(cfg.model, 8192)
    mean = (126 * block + head) / 16
    assert busiest_share(cfg) == pytest.approx(8 * block / mean, rel=1e-9)
    from shardlab.analysis.predict import _stages
    st = _stages(cfg, "h100", [0, 7, 15])  # the embedding's rank, a middle one, the head's
    m = cfg.model
    layer = 2 * m.d_model ** 2 + 2 * m.d_model * m.n_kv_heads * (m.d_model // m.n_heads) + 3 * m.d_model * m.ffn_hidden
    emb = m.vocab_size * m.d_model  # the head's matrix is as large; the norms are d_model each
    per = st[7]["params"] / (8 * layer + 8 * 2 * m.d_model)  # bytes of model state a parameter, from rank 7
    assert st[0]["params"] == pytest.approx(per * (7 * layer + 7 * 2 * m.d_model + emb), rel=1e-4)  # shard rounding
    assert st[15]["params"] == pytest.approx(per * (7 * layer + 7 * 2 * m.d_model + emb + m.d_model), rel=1e-4)
