"""DeepSpeed engine behaviour shardlab implements without DeepSpeed to run beside it (one process,
a world of one; docs/api.md): a static ``fp16.loss_scale`` against a plain torch loop with that
scale, the ``steps_per_print`` line, and the calls refused by name as DeepSpeed refuses them."""
import copy
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import shardlab
from shardlab.errors import ConfigError

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}  # torch's AdamW: weight decay 0.01


def test_a_static_fp16_loss_scale_is_static():
    """``"fp16": {"loss_scale": 1024}`` (DeepSpeed's static scale; shardlab scaled dynamically and
    said so in a warning before 2026-12-08): the loss is scaled by 1024 and the gradients unscaled
    by it, an overflowed step is skipped and the scale stays (DeepSpeed's dynamic scaler would halve
    it at the second overflow); the parameters equal a plain torch fp16-autocast loop that skips
    the two overflowed steps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref, init = copy.deepcopy(net), copy.deepcopy(net.state_dict())
    ds = {"train_batch_size": 4, "gradient_clipping": 0, "optimizer": ADAMW, "fp16": {"enabled": True, "loss_scale": 1024}}
    engine, *_ = shardlab.initialize(model=net, config=ds)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    applied = []
    for step in range(5):
        x = torch.randn(4, 4, generator=g) * (1e30 if step in (1, 2) else 1.0)  # inf in fp16: an overflow
        y = x[:, :1].cos()
        engine.backward(F.mse_loss(engine(x).float(), y))
        engine.step()
        applied.append(engine.was_step_applied())
        if step not in (1, 2):
            with torch.autocast("cpu", dtype=torch.float16):
                out = ref(x)
            (F.mse_loss(out.float(), y) * 1024).backward()
            for p in ref.parameters():
                p.grad /= 1024
            opt.step()
            opt.zero_grad()
    assert applied == [True, False, False, True, True] and engine.skipped_steps == 2 and engine.global_steps == 5
    assert engine.scaler.scale == 1024.0 and engine.loss_scale() == 1024
    got = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-7), k
    assert (got["0.weight"] - init["0.weight"]).abs().max() > 1e-3  # three applied steps moved it


def test_steps_per_print_prints_deepspeed_s_progress_line(capsys):
    """Rank 0, every ``steps_per_print`` optimizer steps: DeepSpeed's ``step=, skipped=, lr=, mom=``
    and the last micro-batch's loss; nothing without the key (DeepSpeed 0.19.8's default: None)."""
    for every in (2, None):
        torch.manual_seed(0)
        ds = {"train_batch_size": 2, "optimizer": ADAMW, **({"steps_per_print": every} if every else {})}
        engine, *_ = shardlab.initialize(model=nn.Linear(4, 1), config=ds)
        capsys.readouterr()
        losses = []
        for _ in range(5):
            loss = engine(torch.randn(2, 4)).pow(2).mean()
            losses.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[shardlab] step=")]
        assert engine.steps_per_print() == every
        if every is None:
            assert lines == []
            continue
        assert len(lines) == 2, lines
        for line, step in zip(lines, (2, 4)):
            m = re.fullmatch(r"\[shardlab\] step=(\d+), skipped=0, lr=\[0\.01\], mom=\[\(0\.9, 0\.999\)\], loss=(\S+)", line)
            assert m and int(m[1]) == step and float(m[2]) == pytest.approx(losses[step - 1], rel=1e-5), line


def test_what_deepspeed_refuses_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    ds = {"train_batch_size": 2, "optimizer": ADAMW}
    engine, *_ = shardlab.initialize(model=nn.Linear(4, 1), config=ds)
    x = torch.randn(2, 4)
    with engine.no_sync():
        with pytest.raises(ConfigError, match="re-entry"):
            with engine.no_sync():
                pass
        engine.backward(engine(x).sum())
        with pytest.raises(ConfigError) as e:
            engine.step()  # DeepSpeed: "It is illegal to call Engine.step() inside no_sync context manager"
        assert e.value.field == "step"
    engine.backward(engine(x).sum())
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    engine.save_checkpoint(tmp_path)
    data = TensorDataset(torch.randn(5, 4))
    for call, field in [(lambda: engine.set_train_batch_size(3), "train_batch_size"),
                        (lambda: engine.set_train_micro_batch_size(0), "micro_batch_size"),
                        (lambda: engine.deepspeed_io(data, route="valid"), "route"),
                        (lambda: engine.deepspeed_io(data, num_local_io_workers=-1), "num_local_io_workers"),
                        (lambda: engine.load_checkpoint(tmp_path, custom_load_fn=print), "custom_load_fn"),
                        (lambda: shardlab.initialize(nn.Linear(4, 1), ds, optimizer=lambda ps: "sgd"), "optimizer")]:
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == field and "\n" not in str(e.value)
    assert engine.train_batch_size() == 2 and engine.load_checkpoint(tmp_path)[0] is not None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_left_out_of_a_save_at_every_stage(tmp_path, stage):
    """``save_checkpoint(exclude_frozen_parameters=True)`` then a load: strict refused by name, and
    ``load_module_strict=False`` keeps this engine's frozen weight and loads every other parameter
    (tests/distributed/test_deepspeed_semantics.py checks ZeRO-0 against DeepSpeed's)."""
    def engine(fill=None):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        if fill is not None:
            with torch.no_grad():
                net[1].weight.fill_(fill)
        net[1].requires_grad_(False)
        return shardlab.initialize(net, {"train_batch_size": 2, "optimizer": ADAMW, "zero_optimization": {"stage": stage}})
    saved = engine()
    saved.backward(saved(torch.randn(2, 4)).pow(2).mean())
    saved.step()
    saved.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    fresh = engine(fill=3.0)
    with pytest.raises(ConfigError, match="has no 1.weight, 1.bias") as e:
        fresh.load_checkpoint(tmp_path)
    assert e.value.field == "load_module_strict"
    assert fresh.load_checkpoint(tmp_path, load_module_strict=False)[0] is not None and fresh.global_steps == 1
    got, want = fresh.full_state_dict(), saved.full_state_dict()
    assert torch.equal(got["1.weight"], torch.full((8,), 3.0)) and not torch.equal(want["1.weight"], got["1.weight"])
    assert all(torch.equal(got[k], want[k]) for k in ("0.weight", "0.bias", "2.weight", "2.bias", "1.bias"))
