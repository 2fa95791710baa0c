"""analysis/plan_images.py: the live-bytes count on meta, and the CNN's step and evaluation
activations against a count made by hand from the model's layers (models/cnn/model.py)."""
import pytest
import torch

from shardlab.analysis.plan_images import LiveBytes, eval_activations, step_activations
from shardlab.config import from_dict

F32 = 4


def test_live_bytes_counts_storages_while_referenced():
    a = torch.empty(1000, device="meta")  # made before: never counted
    with LiveBytes([a]) as live:
        b = a * 2            # 4,000 B
        c = b + 1            # 8,000 B alive
        del b
        d = c * 3            # b freed: c and d, 8,000 B
        v = c[:10]           # a view: no new storage
        w = a.t() if a.dim() == 2 else a.view(10, 100)  # a view of a given storage: not counted
        assert live.now == 8_000
        del c                # v keeps c's storage alive
        assert live.settle() == 8_000
        del v
        assert live.settle() == 4_000
    assert live.peak == 8_000
    assert d.shape == (1000,) and w.shape == (10, 100)


def _cnn(batch: int, ranks: int = 2):
    return from_dict({"model": {"arch": "cnn", "d_model": 128, "n_classes": 10, "dropout": 0.25},
                      "data": {"dataset": "fashion-mnist"},
                      "train": {"global_batch": batch * ranks, "precision": "fp32"},
                      "parallel": {"dp_replicate": ranks}})


def test_cnn_step_activations_match_a_hand_count():
    B = 64
    c1, c2, pooled, fc1, classes = 32 * 26 * 26, 64 * 24 * 24, 64 * 12 * 12, 128, 10
    # saved by autograd after the forward, per image (fp32 unless noted): relu1's output (conv2's
    # input), relu2's output (the pool's input), the pool's int64 indices, dropout1's mask (CPU
    # dropout: a float mask, input * mask) and output (fc1's input), relu3's output, dropout2's
    # mask and output (fc2's input), log_softmax's output; plus the loss and nll's total weight
    saved = B * F32 * (c1 + c2 + 2 * pooled + 3 * fc1 + classes) + B * 8 * pooled + 2 * F32
    # the backward's peak is at relu2's backward: relu1's output still saved, relu2's output, the
    # gradient into it (from the pool) and the gradient out of it, beside the loss and its gradient
    peak = B * F32 * (c1 + 3 * c2) + 2 * F32
    got_saved, got_extra = step_activations(_cnn(B))
    assert got_saved == saved
    assert abs(got_saved + got_extra - peak) <= 0.002 * peak, (got_saved + got_extra, peak)


def test_cnn_eval_activations_match_a_hand_count():
    # one batch of 500 test images (each of 2 ranks holds 5,000), no gradients: at relu2 the
    # batch, conv1's relu (conv2's input, still bound), conv2's output and relu2's output
    n = 500
    want = n * F32 * (28 * 28 + 32 * 26 * 26 + 2 * 64 * 24 * 24)
    assert eval_activations(_cnn(64)) == want
    small = _cnn(64)
    small.data.limit_test = 600  # 300 images a rank: one batch of 300
    assert eval_activations(small) == want * 300 // 500


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_meta_trace_equals_a_real_cpu_step(precision):
    """The meta trace (meta kernels, the trace's autocast rules, the backward outside autocast)
    against the same step on real CPU tensors under torch.autocast, counted the same way (the
    counter itself is checked by hand above)."""
    from shardlab.models.spec import get_spec
    cfg = _cnn(64)
    cfg.train.precision = precision
    spec = get_spec(cfg.model)
    torch.manual_seed(0)
    model = spec.build(cfg.model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = spec.sample_batch(cfg, 64, torch.Generator().manual_seed(0))
    with LiveBytes([*model.parameters(), *(p.grad for p in model.parameters()), *x]) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(*x)
        saved = live.settle()
        loss.backward()
    got = step_activations(cfg)
    # real autocast casts a linear's bias before its weight, the trace the weight first, so their
    # gradients' fp32 copies come in the other order: the peak may differ by a bias (256 bytes)
    assert got[0] == saved and abs(got[1] - (live.peak - saved)) <= 1024, (got, saved, live.peak - saved)
