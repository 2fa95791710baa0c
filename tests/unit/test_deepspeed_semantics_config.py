"""DeepSpeed JSON keys that change what a step computes are refused by name unless shardlab
implements them (they were accepted with an "ignored" warning before 2026-12-08), checked against
DeepSpeed's own classes where it has them; DeepSpeed's ``checkpoint`` section is DeepSpeed's."""
import inspect
import json
import warnings

import pytest

from shardlab.cli import main as cli_main
from shardlab.config import load
from shardlab.config.deepspeed import _DS_CHECKPOINT, _SCHEDULER_PARAMS, is_deepspeed, translate
from shardlab.config import SECTIONS
from shardlab.errors import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 2}


@pytest.mark.parametrize("extra, field", [
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm"),
    ({"fp16": {"enabled": True, "hysteresis": 1}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True, "min_loss_scale": 1024}}, "fp16.min_loss_scale"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale"),  # shardlab.initialize implements it
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast.enabled"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
    ({"communication_data_type": "fp16"}, "communication_data_type"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
    ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 1e-3}}},
     "scheduler.params.warmup_max_lr"),
    ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}}, "scheduler.params.last_batch_iteration"),
])
def test_keys_that_change_the_results_are_refused_by_name(extra, field):
    with pytest.raises(ConfigError) as e:
        translate({**BASE, **extra})
    assert e.value.field == field and "\n" not in str(e.value)


def test_the_same_keys_at_what_shardlab_does_pass_without_a_word():
    """DeepSpeed's defaults (what shardlab implements) are neither refused nor named as ignored."""
    ds = {**BASE, "optimizer": {"type": "AdamW", "params": {"amsgrad": False, "bias_correction": True}},
          "fp16": {"enabled": True, "hysteresis": 2, "min_loss_scale": 1, "consecutive_hysteresis": False,
                   "loss_scale": 0},
          "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32",
          "torch_autocast": {"enabled": False}, "amp": {"enabled": False},
          "zero_optimization": {"stage": 3, "zero_quantized_weights": False},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "last_batch_iteration": -1}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = translate(ds)
    assert out["train"]["precision"] == "fp16" and out["train"]["lr_schedule"] == "ds_warmup"


def test_scheduler_parameters_are_exactly_deepspeed_s():
    """The parameters each scheduler accepts are its DeepSpeed class's keywords (DeepSpeed raises
    a TypeError for any other): a key outside them is refused, naming the key and the class's."""
    schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    for kind, accepted in _SCHEDULER_PARAMS.items():
        theirs = set(inspect.signature(getattr(schedules, kind).__init__).parameters) - {"self", "optimizer"}
        assert accepted == theirs, (kind, accepted ^ theirs)
        other = sorted(set().union(*_SCHEDULER_PARAMS.values()) - accepted)
        for key in other:
            with pytest.raises(ConfigError, match="is not a parameter of DeepSpeed's " + kind) as e:
                total = {"total_num_steps": 10} if "total_num_steps" in accepted else {}
                translate({**BASE, "scheduler": {"type": kind, "params": {**total, key: 0.1}}})
            assert e.value.field == f"scheduler.params.{key}"


def test_deepspeed_s_checkpoint_section_is_deepspeed_s(tmp_path):
    """A DeepSpeed JSON with DeepSpeed's ``checkpoint`` section (tag_validation, ...) was read as a
    shardlab config ("train_micro_batch_size_per_gpu: unknown section"); a shardlab checkpoint
    section keeps a file shardlab's."""
    constants = pytest.importorskip("deepspeed.runtime.constants")
    assert {constants.CHECKPOINT_TAG_VALIDATION, constants.LOAD_UNIVERSAL_CHECKPOINT,
            constants.USE_NODE_LOCAL_STORAGE_CHECKPOINT, constants.CHECKPOINT_PARALLEL_WRITE} <= _DS_CHECKPOINT
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2},
          "checkpoint": {"tag_validation": "Warn", "use_node_local_storage": True}}
    assert is_deepspeed(ds, SECTIONS) and not is_deepspeed({**ds, "checkpoint": {"keep": 2}}, SECTIONS)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.warns(UserWarning, match="do not change what a step computes.*checkpoint"):
        cfg = load(path)
    assert (cfg.parallel.microbatches, cfg.parallel.zero_stage, cfg.train.global_batch) == (4, 2, 8)
    from shardlab.api import resolve_config
    with pytest.warns(UserWarning):
        assert resolve_config(ds, 2).parallel.dp_shard == 2


def test_shardlab_train_refuses_a_static_loss_scale_in_one_line(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "fp16": {"enabled": True, "loss_scale": 128}}))
    assert cli_main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: fp16.loss_scale: = 128") and "shardlab.initialize" in err and "\n" not in err
