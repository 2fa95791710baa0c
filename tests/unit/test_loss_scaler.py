"""LossScaler: unscaling, inf/nan detection, back-off and growth, against torch.amp.GradScaler."""
import pytest
import torch

from shardlab.train.optim import LossScaler


def test_unscale_divides_every_tensor_once_whatever_its_dtype():
    s = LossScaler(True, init_scale=8.0)
    a, b = torch.full((3,), 8.0), torch.full((2, 2), 16.0, dtype=torch.bfloat16)
    assert s.unscale_and_check([a, b, None]) is False
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((2, 2), 2.0, dtype=torch.bfloat16))


def test_inf_or_nan_anywhere_is_an_overflow():
    for bad in (float("inf"), float("-inf"), float("nan")):
        s = LossScaler(True, init_scale=4.0)
        g = [torch.ones(4), torch.tensor([1.0, bad], dtype=torch.float16)]
        assert s.unscale_and_check(g) is True


def test_disabled_scaler_touches_nothing():
    s = LossScaler(False, init_scale=1024.0)
    g = torch.tensor([float("inf"), 2.0])
    assert s.scale == 1.0 and s.unscale_and_check([g]) is False and g[1] == 2.0
    s.update(True)
    assert s.scale == 1.0 and s.skipped == 0


def test_scale_sequence_matches_torch_gradscaler():
    """The same overflow pattern through torch.amp.GradScaler and LossScaler: same scales."""
    pattern = [False, False, True, False, False, False, True, True] + [False] * 7
    ours = LossScaler(True, init_scale=2.0**10, window=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for overflow in pattern:
        loss = (p * (float("inf") if overflow else 1.0)).sum()
        ref.scale(loss).backward()
        ref.step(opt)
        ref.update()
        opt.zero_grad()
        g = torch.full((2,), float("inf") if overflow else ours.scale)
        found = ours.unscale_and_check([g])
        assert found is overflow
        ours.update(found)
        assert ours.scale == ref.get_scale(), (ours.scale, ref.get_scale())
    assert ours.skipped == sum(pattern)
    back = LossScaler(True)
    back.load_state_dict(ours.state_dict())
    assert (back.scale, back.clean_steps, back.skipped) == (ours.scale, ours.clean_steps, ours.skipped)


def test_deepspeed_rule_equals_deepspeeds_own_scaler(monkeypatch):
    """train.loss_scaler = deepspeed (set by a DeepSpeed JSON with fp16): the scale after every
    step equals DeepSpeed's DynamicLossScaler over a random overflow sequence (hysteresis 2,
    min scale 1, its window count), down to the min scale and back up."""
    import random

    L = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    from shardlab.train.optim import LossScaler
    monkeypatch.setattr(L.dist, "get_rank", lambda *a, **k: 0)  # it logs from rank 0 only
    theirs = L.DynamicLossScaler(init_scale=2.0**8, scale_window=5, min_scale=1, delayed_shift=2,
                                 consecutive_hysteresis=False, raise_error_at_min_scale=False)
    ours = LossScaler(True, 2.0**8, 5, rule="deepspeed")
    rng = random.Random(0)
    scales = set()
    for i in range(400):
        overflow = rng.random() < (0.6 if i < 100 else 0.1)
        theirs.update_scale(overflow)
        ours.update(overflow)
        assert ours.scale == theirs.cur_scale, i
        scales.add(ours.scale)
    assert 1.0 in scales and max(scales) > 2  # reached the floor and grew again
    torch_rule = LossScaler(True, 2.0**8, 5)
    torch_rule.update(True)
    assert torch_rule.scale == 2.0**7  # GradScaler's rule: halves at the first overflow
