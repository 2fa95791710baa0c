"""DeepSpeed JSON translation: mapped keys, warnings naming unsupported keys, batch errors."""
import json

import pytest

from shardlab.config import ConfigError, load
from shardlab.config.deepspeed import translate

DS = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-7,
                                               "weight_decay": 0.05, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-3,
                                                      "total_num_steps": 100}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e5, "overlap_comm": True,
                          "offload_optimizer": {"device": "cpu"}},
    "gradient_clipping": 0.7,
    "activation_checkpointing": {"partition_activations": False},
}


def test_translate_maps_every_supported_key(recwarn):
    out = translate(DS)
    assert out["train"] == {"global_batch": 32, "lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "eps": 1e-7,
                            "weight_decay": 0.05, "warmup_steps": 10, "steps": 100, "lr_schedule": "ds_warmup_decay",
                            "warmup_type": "log", "warmup_start": 0.0, "precision": "fp16", "loss_scaler": "deepspeed", "loss_scale_init": 4096.0,
                            "loss_scale_window": 500, "grad_clip": 0.7, "weight_decay_params": "all"}
    assert out["parallel"] == {"microbatches": 2, "dp_shard": 4, "zero_stage": 3,
                               "bucket_cap_mb": 5e5 * 4 / 2**20, "overlap_comm": True, "offload": True,
                               "activation_checkpointing": "full"}


def test_unsupported_keys_are_named_in_a_warning():
    """Keys that would change the results name themselves as not supported; tuning and logging keys
    (which do not change what a step computes, in DeepSpeed either) in a warning of their own; fp16
    keys at the values shardlab's DeepSpeed loss scaler implements are not named at all."""
    ds = dict(DS, wall_clock_breakdown=True, data_efficiency={"enabled": True},
              fp16={"enabled": True, "hysteresis": 2, "min_loss_scale": 1},
              zero_optimization={"stage": 2, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
                                 "zero_hpz_partition_size": 2})
    with pytest.warns(UserWarning) as record:
        translate(ds)
    got = sorted(str(w.message) for w in record)
    assert got == ["DeepSpeed config: not supported by shardlab, ignored: zero_optimization.zero_hpz_partition_size, "
                   "data_efficiency",
                   "DeepSpeed config: tuning / logging keys that do not change what a step computes, left to "
                   "shardlab's own settings: zero_optimization.contiguous_gradients, "
                   "zero_optimization.stage3_max_live_parameters, wall_clock_breakdown"], got
    with pytest.raises(ConfigError) as e:  # another hysteresis changes the results: refused since 2026-12-08
        translate(dict(DS, fp16={"enabled": True, "hysteresis": 4, "min_loss_scale": 1}))
    assert e.value.field == "fp16.hysteresis"


@pytest.mark.parametrize("bad, field", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "train_batch_size"),
    ({"train_batch_size": 0}, "train_batch_size"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"train_batch_size": 8, "gradient_clipping": -1}, "gradient_clipping"),  # was named train.grad_clip
])
def test_batch_inconsistencies_are_errors(bad, field):
    with pytest.raises(ConfigError) as e:
        translate(bad)
    assert e.value.field == field


def test_load_recognises_a_deepspeed_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    cfg = load(path)
    assert (cfg.train.global_batch, cfg.train.precision, cfg.parallel.zero_stage) == (16, "bf16", 2)
    assert (cfg.parallel.microbatches, cfg.parallel.dp_shard) == (4, 1)
    cfg.validate(world_size=1)


def test_offload_needs_stage_3():
    from shardlab.config import Config
    cfg = Config()
    cfg.parallel.offload, cfg.parallel.zero_stage = True, 2
    with pytest.raises(ConfigError, match="parallel.offload"):
        cfg.validate()


def test_deepspeed_defaults_where_the_json_is_silent():
    """Absent keys take DeepSpeed's defaults, not shardlab's TOML defaults; "auto" keeps shardlab's."""
    t = translate({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {}}})["train"]
    assert (t["lr"], t["beta1"], t["beta2"], t["eps"], t["weight_decay"]) == (1e-3, 0.9, 0.999, 1e-8, 0.0)
    assert (t["grad_clip"], t["weight_decay_params"], t["min_lr_ratio"], t["warmup_steps"]) == (1.0, "all", 1.0, 0)
    t = translate({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})["train"]
    assert t["weight_decay"] == 0.01  # torch.optim.AdamW's default
    t = translate({"train_batch_size": 8, "gradient_clipping": "auto", "optimizer": {"params": {"lr": "auto"}},
                   "scheduler": {"type": "WarmupLR"}})["train"]
    assert "grad_clip" not in t and "lr" not in t
    assert (t["lr_schedule"], t["warmup_steps"], t["warmup_type"]) == ("ds_warmup", 1000, "log")
    t = translate({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}})
    assert t["train"]["lr"] == 1e-3  # WarmupDecayLR's warmup_max_lr default, whatever the optimizer's lr


@pytest.mark.parametrize("bad, field", [
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "scheduler.params.warmup_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "scheduler.params.warmup_type"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}}, "optimizer.params.adam_w_mode"),
])
def test_what_shardlab_cannot_mean_is_refused(bad, field):
    with pytest.raises(ConfigError) as e:
        translate({"train_batch_size": 8, **bad})
    assert e.value.field == field


def test_deepspeed_schedules_step_for_step():
    """train.lr_schedule ds_* against DeepSpeed's own scheduler classes when deepspeed is installed."""
    lrs = pytest.importorskip("deepspeed.runtime.lr_schedules")
    import torch

    from shardlab.config import from_dict
    from shardlab.train.optim import lr_at
    cases = [("WarmupLR", {"warmup_num_steps": 5, "warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3}),
             ("WarmupDecayLR", {"warmup_num_steps": 4, "total_num_steps": 12, "warmup_type": "linear"}),
             ("WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 10, "warmup_min_ratio": 0.2}),
             ("WarmupCosineLR", {"warmup_num_steps": 1, "total_num_steps": 5, "warmup_type": "linear"})]
    for kind, params in cases:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        ds = {"train_batch_size": 8, "optimizer": {"params": {"lr": 3e-3}},
              "scheduler": {"type": kind, "params": params}}
        t = from_dict(translate(ds)).train
        sch = getattr(lrs, kind)(opt, **params)
        for step in range(14):  # DeepSpeed: the lr at construction, then one scheduler step per optimizer step
            assert lr_at(step, t) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), (kind, step)
            sch.step()


def test_batch_arithmetic_with_the_world_size():
    """DeepSpeed's rule train_batch_size = micro * accumulation * ranks, any one derived."""
    from shardlab.config.deepspeed import resolve_batch
    got = resolve_batch({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 4)
    assert got["gradient_accumulation_steps"] == 2
    got = resolve_batch({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 4)
    assert got["train_micro_batch_size_per_gpu"] == 2
    got = resolve_batch({"train_batch_size": 16}, 4)
    assert (got["train_micro_batch_size_per_gpu"], got["gradient_accumulation_steps"]) == (4, 1)
    got = resolve_batch({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2)
    assert got["train_batch_size"] == 12
    for bad in ({"train_batch_size": 6, "gradient_accumulation_steps": 2}, {"train_batch_size": 6},
                {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2}):
        with pytest.raises(ConfigError) as e:
            resolve_batch(bad, 4)
        assert e.value.field == "train_batch_size"


@pytest.mark.parametrize("ds", [{"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}},
                                {"zero_optimization": {"stage": 2}}, {"gradient_accumulation_steps": 2}])
def test_a_deepspeed_file_without_a_batch_is_refused_as_deepspeed_refuses_it(tmp_path, ds):
    """Recognised by any DeepSpeed key (a file of bf16 / optimizer blocks used to read as a shardlab
    config: "bf16: unknown section"), and, as in DeepSpeed, refused without train_batch_size or
    train_micro_batch_size_per_gpu (a zero_optimization-only file used to train with shardlab's batch)."""
    from shardlab import api as shardlab
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    for read in (lambda: load(tmp_path / "ds.json"), lambda: shardlab.resolve_config(tmp_path / "ds.json", 2),
                 lambda: shardlab.resolve_config(ds, 2)):
        with pytest.raises(ConfigError, match="DeepSpeed refuses one with neither") as e:
            read()
        assert e.value.field == "train_batch_size"


def test_an_auto_micro_batch_is_a_batch(tmp_path):
    """The Hugging Face integration's "auto": shardlab's own batch, through load and initialize alike."""
    from shardlab import api as shardlab
    from shardlab.config import Config
    ds = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    assert load(tmp_path / "ds.json").train.global_batch == Config().train.global_batch
    cfg = shardlab.resolve_config(ds, 2)
    assert (cfg.parallel.zero_stage, cfg.parallel.dp_shard, cfg.train.global_batch) == (2, 2, Config().train.global_batch)


def test_a_file_with_only_a_model_section_or_unknown_keys_is_shardlab_s(tmp_path):
    """The same rule for files given to initialize as to shardlab train: no DeepSpeed key, no DeepSpeed."""
    from shardlab import api as shardlab
    (tmp_path / "m.json").write_text(json.dumps({"model": {"d_model": 64}}))
    assert load(tmp_path / "m.json").model.d_model == 64
    (tmp_path / "x.json").write_text(json.dumps({"foo": 1}))
    for read in (lambda: load(tmp_path / "x.json"), lambda: shardlab.resolve_config(tmp_path / "x.json", 1)):
        with pytest.raises(ConfigError, match="unknown section"):
            read()


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_command_line_resolves_the_batch_with_the_job_s_ranks_as_deepspeed(ranks, capsys):
    """DeepSpeed: train_batch_size = micro batch per GPU x accumulation x data-parallel ranks.
    examples/ds_config.json gives micro 32 and accumulation 2; `shardlab train ... --nproc 2` used
    to keep global_batch 64 and spread it over the ranks (16 per micro-batch per rank, half
    DeepSpeed's). And a micro batch alone used to get accumulation = ranks through initialize."""
    from shardlab import api
    from shardlab.cli import main as cli_main
    ds = json.loads(open("examples/ds_config.json").read())
    mb, ga = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    assert cli_main(["config", "show", "examples/ds_config.json", "--nproc", str(ranks)]) == 0
    shown = dict(ln.split("  #")[0].split(" = ") for ln in capsys.readouterr().out.splitlines() if " = " in ln)
    assert (int(shown["global_batch"]), int(shown["microbatches"]), int(shown["dp_shard"])) == (mb * ga * ranks, ga, ranks)
    for source in ("examples/ds_config.json", ds):
        cfg = api.resolve_config(source, ranks)
        assert (cfg.train.global_batch, cfg.parallel.microbatches) == (mb * ga * ranks, ga)
    cfg = api.resolve_config({"train_micro_batch_size_per_gpu": 4}, ranks)
    assert (cfg.train.global_batch, cfg.parallel.microbatches, cfg.parallel.dp_shard) == (4 * ranks, 1, ranks)


def test_three_batch_keys_that_do_not_fit_the_job_are_one_line(tmp_path, capsys):
    from shardlab.cli import main as cli_main
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                                                  "gradient_accumulation_steps": 2}))
    assert cli_main(["config", "show", str(tmp_path / "ds.json"), "--nproc", "4"]) == 0
    capsys.readouterr()
    assert cli_main(["train", str(tmp_path / "ds.json"), "--nproc", "2", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == ("config error: train_batch_size: 64 is not 8 (micro batch) * 2 "
                                               "(accumulation) * 2 data-parallel ranks of this job; use 32 or drop "
                                               "it (DeepSpeed derives it)")


@pytest.mark.parametrize("typo, right", [("zero_optimisation", "zero_optimization"),
                                         ("gradient_cliping", "gradient_clipping"),
                                         ("schedular", "scheduler")])
def test_a_misspelt_top_level_key_is_refused(typo, right):
    """DeepSpeed ignores unknown keys, and so did shardlab with a warning: "zero_optimisation":
    {"stage": 3} ran plain DDP. A key this close to one shardlab reads is a ConfigError."""
    with pytest.raises(ConfigError) as e:
        translate({"train_batch_size": 8, typo: {"stage": 3} if "zero" in typo else 1.0})
    assert e.value.field == typo and f"did you mean '{right}'" in str(e.value)
