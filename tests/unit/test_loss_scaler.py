"""LossScaler: unscaling, inf/nan detection, back-off and growth, against torch.amp.GradScaler."""
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
