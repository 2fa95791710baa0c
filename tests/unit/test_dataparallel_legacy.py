"""Single-process DataParallel over several 'cpu devices': loss and gradients equal one model
on the whole batch (float64)."""
import torch

from shardlab.config import ModelConfig
from shardlab.models import build_model
from shardlab.parallel import DataParallel


def test_legacy_dataparallel_matches_whole_batch():
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    ref, dp_model = build_model(cfg, 3, dtype=torch.float64), build_model(cfg, 3, dtype=torch.float64)
    tok = torch.randint(0, 64, (6, 17), generator=torch.Generator().manual_seed(1))
    x, y = tok[:, :-1], tok[:, 1:]
    ref(x, y).backward()
    dp = DataParallel(dp_model, device_ids=["cpu", "cpu", "cpu"])
    losses = dp(x, y)
    assert losses.shape == (3,)
    losses.mean().backward()
    assert abs(float(losses.mean()) - float(ref(x, y))) <= 1e-10
    for (n, p), q in zip(ref.named_parameters(), dp.module.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-10, rtol=0), n
