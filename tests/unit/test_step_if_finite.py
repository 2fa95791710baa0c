"""train/optim.step_if_finite: the fused optimizer's own ``found_inf`` skip (no host read of the
gradient norm). Checked on the CPU's fused AdamW against torch's fused AdamW stepped by hand: a
finite norm steps exactly as ``step()``; a non-finite one leaves parameters, both moments and the
step count untouched, and the next finite step equals a run that never saw the bad one."""
import math

import torch

from shardlab.train import optim


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(40, 30), (30,), (7, 5)]]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in [(40, 30), (30,), (7, 5)]]


def _run(norms, skip_api: bool):
    params = _params(0)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    assert optim.skips_on_device(opt)
    flags = []
    for k, norm in enumerate(norms):
        for p, g in zip(params, _grads(k)):
            p.grad = g.clone()
        if skip_api:
            flags.append(bool(optim.step_if_finite(opt, torch.tensor(norm, dtype=torch.float64))))
        elif math.isfinite(norm):  # the host-read path: decide here, step only when finite
            opt.step()
        opt.zero_grad(set_to_none=True)
    return params, opt, flags


def test_finite_norm_steps_as_step_and_nonfinite_skips_on_device():
    norms = [1.0, float("inf"), 2.0, float("nan"), 0.5]
    mine, opt_a, flags = _run(norms, skip_api=True)
    ref, opt_b, _ = _run(norms, skip_api=False)
    assert flags == [False, True, False, True, False]
    for p, q in zip(mine, ref):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert float(sa["step"]) == float(sb["step"]) == 3  # the two skipped steps were not counted
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_foreach_and_chunked_optimizers_keep_the_host_read():
    p = _params(1)
    assert not optim.skips_on_device(optim.ChunkedAdamW(p, lr=1e-3, foreach=True))
    assert not optim.skips_on_device(torch.optim.AdamW(p, lr=1e-3, foreach=True))
