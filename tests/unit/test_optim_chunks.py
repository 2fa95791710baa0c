"""ChunkedAdamW (train/optim.py) against torch's own foreach AdamW over the same parameters: the
update is elementwise, so stepping in chunks must give the same bits; hooks run once per step."""
import torch

from shardlab.train import optim


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(300, 200), (50,), (1000, 30), (7, 7, 7), (64,), (2000,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in shapes]


def _groups(params):
    return [dict(params=params[:4], weight_decay=0.1), dict(params=params[4:], weight_decay=0.0, lr=3e-3)]


def test_chunked_adamw_equals_foreach_adamw_bit_for_bit(monkeypatch):
    monkeypatch.setattr(optim, "STEP_CHUNK", 40_000)  # a few parameters per call, one alone (480 KB)
    mine, ref = _params(0), _params(0)
    a = optim.ChunkedAdamW(_groups(mine), lr=1e-2, foreach=True)
    b = torch.optim.AdamW(_groups(ref), lr=1e-2, foreach=True)
    assert len(list(optim._chunks(mine[:4], optim.STEP_CHUNK))) >= 3  # really stepped in chunks
    calls = []
    a.register_step_post_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(mine, ref):
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    assert calls == [1, 1, 1]
    assert [len(g["params"]) for g in a.param_groups] == [4, 2]  # the groups are given back whole
    for p, q in zip(mine, ref):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][k], b.state[q][k])


def test_chunks_keep_order_and_bound():
    ps = [torch.empty(n) for n in (10, 10, 30, 5, 5)]
    runs = list(optim._chunks(ps, 80))  # float32: 40, 40, 120, 20, 20 bytes
    assert [[p.numel() for p in r] for r in runs] == [[10, 10], [30], [5, 5]]
