"""LoRA under data parallel, ZeRO-1/2/3, the pipeline and tensor (+ sequence) parallel equals one
process (float64): the base weights stay frozen (bit-equal to their initial values), only adapters
train and hold optimizer state, checkpoints under ZeRO/FSDP keep the frozen base."""
import pytest
import torch

from shardlab import config as C
from shardlab.analysis import verify
from shardlab.errors import ConfigError
from shardlab.models import lora
from shardlab.train.data import prepare

LORA = {"train": {"lora_rank": 4, "lora_alpha": 8.0,
                  "lora_targets": ["layers.*.attention.wq", "layers.*.attention.wo", "layers.*.feed_forward.*"]}}
LAYOUTS = ["dp", "zero1", "zero2", "fsdp", "pp2-1f1b", "tp2", "tp2-sp"]  # TP: column and row adapters


def test_lora_layouts_match_one_process():
    cfg = verify.layout_config("dp", 2, 2, extra=LORA)
    data_dir = str(prepare(cfg.data))
    rows = verify.run_layouts(LAYOUTS, 2, data_dir, 2, {}, extra=LORA)
    for r in rows:
        assert r["ok"], r  # every parameter, frozen base included, equals the reference
    # the reference itself: base bit-equal to its initial values, adapters moved
    start = verify.reference_model(cfg)
    _, end = verify.reference(cfg, data_dir, 2)
    for name, p in start.named_parameters():
        if lora.is_adapter(name):
            assert not torch.equal(p.detach(), end[f"model.{name}"]), name
        else:
            assert torch.equal(p.detach(), end[f"model.{name}"]), name
    assert any(lora.is_adapter(n) for n, _ in start.named_parameters())


def test_only_adapters_take_gradients_and_optimizer_state():
    cfg = verify.layout_config("dp", 1, 1, extra=LORA)
    model = verify.reference_model(cfg)
    loss = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    loss.backward()
    opt = verify.reference_adamw(model, cfg.train)
    opt.step()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    assert {id(p) for p in opt.state} == {id(p) for n, p in model.named_parameters() if n in trainable}


@pytest.mark.parametrize("override,field", [({"lora_targets": ["nothing.*"]}, "train.lora_targets"),
                                             ({"lora_rank": -1}, "train.lora_rank")])
def test_bad_lora_settings_name_the_field(override, field):
    cfg = C.from_dict({"train": {"lora_rank": 4, **override}})
    with pytest.raises(ConfigError) as e:
        cfg.validate(1)
        verify.reference_model(cfg)
    assert e.value.field == field


def test_adapter_dropout_with_tensor_parallel_is_refused():
    cfg = C.from_dict({"train": {"lora_rank": 4, "lora_dropout": 0.1}, "parallel": {"tp": 2}})
    with pytest.raises(ConfigError) as e:
        cfg.validate(2)
    assert e.value.field == "train.lora_dropout"
