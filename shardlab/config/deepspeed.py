"""DeepSpeed JSON -> shardlab config (``translate``, called by ``load`` for a DeepSpeed file):
DeepSpeed's defaults and batch rule, ``"auto"`` as the Hugging Face integration, keys that would
change the results and are not implemented refused by name, other unsupported keys named in one
warning (docs/deepspeed.md, DeepSpeed JSON semantics; docs/configuration.md)."""
from __future__ import annotations

import difflib
import json
import math
import warnings

from ..errors import ConfigError

_ZERO_KEYS = {"stage", "reduce_bucket_size", "overlap_comm", "offload_optimizer", "offload_param"}
_TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "gradient_clipping",
             "activation_checkpointing", "steps_per_print", "autotp_size", "model"}
AUTO = "auto"
_NO_EFFECT_ZERO = {"contiguous_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
                   "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                   "allgather_bucket_size", "allgather_partitions", "reduce_scatter", "round_robin_gradients",
                   "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                   "elastic_checkpoint", "memory_efficient_linear"}
_NO_EFFECT_TOP = {"wall_clock_breakdown", "memory_breakdown", "flops_profiler", "comms_logger", "tensorboard",
                  "csv_monitor", "wandb", "dump_state", "prescale_gradients", "zero_allow_untested_optimizer",
                  "checkpoint"}
"""Keys that tune how DeepSpeed runs (buffer sizes, prefetching, gathering for ``save_16bit_model``,
which shardlab always does), what it logs or what it allows (``zero_allow_untested_optimizer``:
shardlab's ZeRO takes any torch optimizer), not what a step computes: named in a warning of their
own, apart from the keys that would change the results and are not supported."""
_FP16_AS_SHARDLAB = {"hysteresis": 2, "min_loss_scale": 1, "consecutive_hysteresis": False}
"""fp16 keys at the values shardlab's ``loss_scaler = deepspeed`` implements (DeepSpeed's defaults)."""
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DS_CHECKPOINT = {"tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer"}
"""DeepSpeed's own ``checkpoint`` section (where and how it writes files, not what a step computes)."""
_CHECKED_TOP = {"torch_autocast", "amp", "data_types", "communication_data_type"}
"""Top-level keys :func:`_refusals` reads: refused where they would change the results."""


def is_deepspeed(data: dict, sections) -> bool:
    """Whether a JSON object is a DeepSpeed config: some DeepSpeed key (``bf16``, ``optimizer``,
    ``zero_optimization``, a batch key, ...; ``model`` alone is both) and no shardlab section other
    than ``model`` among ``sections`` (a ``checkpoint`` section of DeepSpeed's keys only,
    ``tag_validation`` ..., is DeepSpeed's). One rule for ``shardlab train`` / ``config`` /
    ``memory`` and ``shardlab.initialize``."""
    keys = set(data)
    if isinstance(data.get("checkpoint"), dict) and set(data["checkpoint"]) <= _DS_CHECKPOINT:
        keys.discard("checkpoint")
    return bool(keys & (_TOP_KEYS - {"model"})) and not keys & (set(sections) - {"model"})


def _positive_int(ds: dict, key: str, name: str | None = None):
    """A positive int, None when absent or "auto"."""
    v = ds.get(key)
    if v is None or v == AUTO:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(name or key, f"must be a positive integer or \"auto\", got {json.dumps(v)[:40]}")
    return v


def _dict(ds: dict, key: str, example: str) -> dict:
    """A section that must be a JSON object ({} when absent or null)."""
    v = ds.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(key, f"must be a JSON object, got {json.dumps(v)[:40]}; write e.g. \"{key}\": {example}")
    return v


def _num(v, name: str, auto_ok: bool = True):
    """A finite number, None for "auto"."""
    if auto_ok and v == AUTO:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        alt = ' or "auto"' if auto_ok else ""
        raise ConfigError(name, f"must be a finite number{alt}, got {json.dumps(v)[:40]}")
    return float(v)


def _flag(section: dict, key: str, name: str):
    """A JSON bool, None for "auto" (or absent)."""
    v = section.get(key)
    if v is None or v == AUTO:
        return None
    if not isinstance(v, bool):
        raise ConfigError(name, f"must be true, false or \"auto\", got {json.dumps(v)[:40]}")
    return v


def _batch(ds: dict, out: dict):
    tbs = _positive_int(ds, "train_batch_size")
    mb = _positive_int(ds, "train_micro_batch_size_per_gpu")
    ga = _positive_int(ds, "gradient_accumulation_steps")
    if tbs is None and mb is None:
        return
    if tbs is None:  # no world size is known here: one data-parallel rank unless overridden
        tbs = mb * (ga or 1)
    if mb is not None and ga is not None:
        if tbs % (mb * ga):
            raise ConfigError("train_batch_size", f"{tbs} is not train_micro_batch_size_per_gpu * "
                              f"gradient_accumulation_steps * ranks = {mb} * {ga} * k for any integer k; "
                              f"use a multiple of {mb * ga}")
        dp = tbs // (mb * ga)
    elif mb is not None:
        if tbs % mb:
            raise ConfigError("train_batch_size", f"{tbs} is not divisible by train_micro_batch_size_per_gpu={mb}")
        ga, dp = tbs // mb, 1
    else:
        dp = None
        if tbs % (ga or 1):
            raise ConfigError("train_batch_size", f"{tbs} is not divisible by gradient_accumulation_steps={ga}")
    out["train"]["global_batch"] = tbs
    out["parallel"]["microbatches"] = ga or 1
    if dp is not None:
        out["parallel"]["dp_shard"] = dp


# DeepSpeed's optimizer defaults for keys the JSON leaves out (its fused / CPU Adam; torch_adam:
# torch.optim.AdamW, whose weight decay defaults to 0.01). "auto" keeps shardlab's own value.
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def _optimizer(ds: dict, out: dict, unsupported: list):
    opt = _dict(ds, "optimizer", '{"type": "AdamW", "params": {"lr": 1e-3}}')
    if not opt:
        return
    kind = opt.get("type", "AdamW")
    if not isinstance(kind, str):
        raise ConfigError("optimizer.type", f"must be a string (Adam or AdamW), got {json.dumps(kind)[:40]}")
    params = dict(_dict(opt, "params", '{"lr": 1e-3}') and opt["params"])
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError("optimizer.type", f"{kind!r} is not supported; use Adam or AdamW (shardlab's "
                                            "optimizer is AdamW), or pass optimizer= to shardlab.initialize")
    adamw = kind.lower() == "adamw" or params.pop("adam_w_mode", True) is not False
    params.pop("adam_w_mode", None)
    torch_adam = params.pop("torch_adam", False) is True  # which implementation: the defaults differ
    params = {**_ADAM_DEFAULTS, "weight_decay": 0.01 if torch_adam and adamw else 0.0, **params}
    t = out["train"]
    for key in ("lr", "eps", "weight_decay"):  # checked even where a scheduler's warmup_max_lr sets the lr
        if (v := _num(params.pop(key), f"optimizer.params.{key}")) is not None:
            if v < 0 or (v == 0 and key != "weight_decay"):
                raise ConfigError(f"optimizer.params.{key}", f"got {v:g}; must be {'>= 0' if key == 'weight_decay' else '> 0'}")
            t[key] = v
    if not adamw and t.get("weight_decay", 0.0) > 0:
        raise ConfigError("optimizer.params.adam_w_mode", "false means Adam with L2 weight decay in the gradient, which "
                          "shardlab does not implement; drop adam_w_mode (AdamW's decoupled decay), set weight_decay "
                          "to 0, or pass optimizer=torch.optim.Adam to shardlab.initialize")
    betas = params.pop("betas")
    if betas != AUTO:
        if not isinstance(betas, list) or len(betas) != 2:
            raise ConfigError("optimizer.params.betas", f"must be a list of two numbers, e.g. [0.9, 0.999], "
                                                        f"got {json.dumps(betas)[:40]}")
        t["beta1"], t["beta2"] = (_num(b, "optimizer.params.betas", False) for b in betas)
    for key, same, fix in (("amsgrad", False, "shardlab's AdamW has no AMSGrad; drop it, or pass optimizer=lambda ps: "
                                              "torch.optim.AdamW(ps, amsgrad=True) to shardlab.initialize"),
                           ("bias_correction", True, "shardlab's AdamW always corrects the moments' bias (torch's "
                                                     "AdamW); drop it")):
        if params.get(key, same) not in (same, AUTO):
            raise ConfigError(f"optimizer.params.{key}", f"= {json.dumps(params[key])[:40]} is not implemented: {fix}")
        params.pop(key, None)
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm", "DeepSpeed refuses it too; clip with the top-level "
                                                            "\"gradient_clipping\" instead")
    unsupported += [f"optimizer.params.{k}" for k in params]


# DeepSpeed's scheduler -> train.lr_schedule; its defaults (warm-up: 1000 steps, log) where the JSON is silent
_SCHEDULERS = {"WarmupLR": "ds_warmup", "WarmupDecayLR": "ds_warmup_decay", "WarmupCosineLR": "ds_warmup_cosine"}
_WARMUP = {"warmup_num_steps", "warmup_type", "last_batch_iteration"}
_SCHEDULER_PARAMS = {"WarmupLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr"},
                     "WarmupDecayLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr", "total_num_steps"},
                     "WarmupCosineLR": _WARMUP | {"warmup_min_ratio", "cos_min_ratio", "total_num_steps"}}


def _scheduler(ds: dict, out: dict, unsupported: list):
    sch = _dict(ds, "scheduler", '{"type": "WarmupLR", "params": {"warmup_num_steps": 10}}')
    t = out["train"]
    if not sch:  # DeepSpeed without a scheduler: the optimizer's constant learning rate
        t.update(lr_schedule="cosine", warmup_steps=0, min_lr_ratio=1.0)
        return
    kind = sch.get("type")
    if kind not in _SCHEDULERS:
        raise ConfigError("scheduler.type", f"{kind!r} is not supported; use one of {', '.join(_SCHEDULERS)} "
                                            "or drop the scheduler block (constant learning rate)")
    raw = _dict(sch, "params", '{"warmup_num_steps": 10}')
    for k in raw:  # DeepSpeed's class raises a TypeError for any other keyword
        if k not in _SCHEDULER_PARAMS[kind]:
            raise ConfigError(f"scheduler.params.{k}", f"is not a parameter of DeepSpeed's {kind} (DeepSpeed raises a "
                              f"TypeError); its parameters: {', '.join(sorted(_SCHEDULER_PARAMS[kind]))}")
    if raw.get("last_batch_iteration", -1) not in (-1, AUTO):
        raise ConfigError("scheduler.params.last_batch_iteration", "a schedule that starts part-way is not "
                          "implemented; drop it (a resumed run takes its step from the checkpoint)")
    params = {k: v for k, v in raw.items() if v != AUTO and k != "last_batch_iteration"}  # "auto": shardlab's own
    for k, v in params.items():
        if k != "warmup_type":
            _num(v, f"scheduler.params.{k}")
    t["lr_schedule"] = _SCHEDULERS[kind]
    if "warmup_num_steps" not in raw or "warmup_num_steps" in params:
        w = params.pop("warmup_num_steps", 1000)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError("scheduler.params.warmup_num_steps", f"must be a positive integer (DeepSpeed), got {w!r}")
        t["warmup_steps"] = w
    if "warmup_type" not in raw or "warmup_type" in params:
        wt = params.pop("warmup_type", "log")
        if wt not in ("log", "linear"):
            raise ConfigError("scheduler.params.warmup_type", f"must be log or linear, got {json.dumps(wt)[:40]}")
        t["warmup_type"] = wt
    if kind != "WarmupLR":
        if "total_num_steps" not in raw:
            raise ConfigError("scheduler.params.total_num_steps", f"{kind} needs it (DeepSpeed has no default); "
                                                                  "e.g. \"total_num_steps\": 1000")
        if "total_num_steps" in params:
            t["steps"] = _positive_int(params, "total_num_steps", "scheduler.params.total_num_steps")
            params.pop("total_num_steps")
    if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
        t["min_lr_ratio"] = float(params.pop("cos_min_ratio", 0.0001))
        t["warmup_start"] = float(params.pop("warmup_min_ratio", 0.0))
    else:  # absolute lrs; WarmupLR's max defaults to the optimizer's lr, WarmupDecayLR's to 0.001
        t["warmup_start"] = float(params.pop("warmup_min_lr", 0.0))
        if "warmup_max_lr" in params or (kind == "WarmupDecayLR" and "warmup_max_lr" not in raw):
            t["lr"] = float(params.pop("warmup_max_lr", 0.001))
    unsupported += [f"scheduler.params.{k}" for k in params]


def uniform_peak(ds: dict) -> bool:
    """True when DeepSpeed's scheduler gives every param group the same peak lr (WarmupLR with
    warmup_max_lr, WarmupDecayLR); False when each group warms up to its own lr."""
    sch = ds.get("scheduler") or {}
    params = sch.get("params") or {}
    return sch.get("type") == "WarmupDecayLR" or (sch.get("type") == "WarmupLR" and "warmup_max_lr" in params)


def _precision(ds: dict, out: dict, unsupported: list):
    for key in ("fp16", "bf16"):
        if isinstance(ds.get(key), bool):
            raise ConfigError(key, f"must be a JSON object, got {json.dumps(ds[key])}; write "
                                   f"\"{key}\": {{\"enabled\": {json.dumps(ds[key])}}}")
    fp16, bf16 = _dict(ds, "fp16", '{"enabled": true}'), _dict(ds, "bf16", '{"enabled": true}')
    fp16_on, bf16_on = _flag(fp16, "enabled", "fp16.enabled"), _flag(bf16, "enabled", "bf16.enabled")
    if fp16_on and bf16_on:
        raise ConfigError("fp16.enabled", "fp16 and bf16 are both enabled; enable one")
    for k in ("initial_scale_power", "loss_scale_window", "loss_scale"):
        if k in fp16 and fp16[k] != AUTO:
            _num(fp16[k], f"fp16.{k}")
    t = out["train"]
    if bf16_on:
        t["precision"] = "bf16"
    unsupported += [f"bf16.{k}" for k in bf16 if k != "enabled"]
    if fp16_on:
        t["precision"], t["loss_scaler"] = "fp16", "deepspeed"  # DeepSpeed's hysteresis and window count
        if fp16.get("loss_scale", 0) not in (0, AUTO):
            raise ConfigError("fp16.loss_scale", f"= {fp16['loss_scale']}: a static loss scale is implemented by "
                              "shardlab.initialize only; shardlab train scales dynamically: set it to 0")
        for k, v in _FP16_AS_SHARDLAB.items():
            if fp16.get(k, v) not in (v, AUTO):
                raise ConfigError(f"fp16.{k}", f"= {json.dumps(fp16[k])[:40]} is not implemented: shardlab's DeepSpeed "
                                  f"loss scaler has {k} {json.dumps(v)} (DeepSpeed's default); drop it")
        if fp16.get("initial_scale_power", AUTO) != AUTO:
            power = fp16["initial_scale_power"]
            if not isinstance(power, int) or isinstance(power, bool) or not 0 <= power <= 64:
                raise ConfigError("fp16.initial_scale_power", f"must be an integer in 0..64, got {json.dumps(power)}")
            t["loss_scale_init"] = float(2 ** power)
        if fp16.get("loss_scale_window", AUTO) != AUTO:
            t["loss_scale_window"] = fp16["loss_scale_window"]
    unsupported += [f"fp16.{k}" for k in fp16 if k not in ("enabled", "loss_scale", "initial_scale_power",
                                                           "loss_scale_window") and k not in _FP16_AS_SHARDLAB]


def _zero(ds: dict, out: dict, unsupported: list):
    z = _dict(ds, "zero_optimization", '{"stage": 2}')
    if not z:
        return
    p = out["parallel"]
    stage = z.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage!r}")
    p["zero_stage"] = stage
    if z.get("reduce_bucket_size", AUTO) != AUTO:  # DeepSpeed counts elements; shardlab MiB (of fp32 gradients)
        p["bucket_cap_mb"] = _num(z["reduce_bucket_size"], "zero_optimization.reduce_bucket_size") * 4 / 2**20
    if (overlap := _flag(z, "overlap_comm", "zero_optimization.overlap_comm")) is not None:
        p["overlap_comm"] = overlap
    offload = [k for k in ("offload_optimizer", "offload_param")
               if _dict(z, k, '{"device": "cpu"}').get("device", "none") not in ("none", None)]
    if offload and stage == 3:
        p["offload"] = True
    elif offload:
        unsupported += [f"zero_optimization.{k} with stage {stage} (shardlab offloads at stage 3)" for k in offload]
    for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if _flag(z, k, f"zero_optimization.{k}"):
            raise ConfigError(f"zero_optimization.{k}", "is not implemented (shardlab communicates full-precision "
                                                        "weights and gradients); set it to false")
    unsupported += [f"zero_optimization.{k}" for k in z if k not in _ZERO_KEYS | _NO_EFFECT_ZERO and
                    not (k.startswith("zero_quantized") and z[k] is False)]
    out["_no_effect"] = [f"zero_optimization.{k}" for k in z if k in _NO_EFFECT_ZERO]


def _refusals(ds: dict) -> None:
    """Top-level keys that would change what a step computes and are not implemented."""
    for key, fix in (("torch_autocast", "use \"bf16\" or \"fp16\": {\"enabled\": true} (shardlab's autocast over "
                                        "fp32 master weights)"), ("amp", "use \"fp16\" or \"bf16\" instead")):
        if _flag(_dict(ds, key, '{"enabled": false}'), "enabled", f"{key}.enabled"):
            raise ConfigError(f"{key}.enabled", f"DeepSpeed's {key} mode is not implemented; {fix}, or set it false")
    for name, value in (("data_types.grad_accum_dtype", _dict(ds, "data_types", "{}").get("grad_accum_dtype")),
                        ("communication_data_type", ds.get("communication_data_type"))):
        if value not in (None, "fp32", AUTO):
            raise ConfigError(name, f"= {json.dumps(value)[:40]} is not implemented: shardlab accumulates and reduces "
                                    "gradients in fp32; set it to \"fp32\" or drop it")


def resolve_batch(ds: dict, world_size: int) -> dict:
    """DeepSpeed's batch rule with the job's ``world_size``: train_batch_size =
    train_micro_batch_size_per_gpu * gradient_accumulation_steps * data-parallel ranks, a missing
    one derived (accumulation 1 when only the micro batch is given), three inconsistent ones a
    ConfigError. Returns a copy with the three numbers (``shardlab.initialize``; ``config.load``
    when the command knows its ranks)."""
    raw, ds = ds, _top(ds)
    world_size = world_size // (_positive_int(ds, "autotp_size") or 1)  # the data-parallel ranks
    tbs = _positive_int(ds, "train_batch_size")
    mb = _positive_int(ds, "train_micro_batch_size_per_gpu")
    ga = _positive_int(ds, "gradient_accumulation_steps")
    if None not in (tbs, mb, ga) and tbs != mb * ga * world_size:
        raise ConfigError("train_batch_size", f"{tbs} is not {mb} (micro batch) * {ga} (accumulation) * "
                          f"{world_size} data-parallel ranks of this job; use {mb * ga * world_size} or drop it "
                          "(DeepSpeed derives it)")
    if tbs is not None and mb is not None and ga is None:
        if tbs % (mb * world_size):
            raise ConfigError("train_batch_size", f"{tbs} is not train_micro_batch_size_per_gpu * ranks * k = "
                              f"{mb} * {world_size} * k; use a multiple of {mb * world_size}")
        ds["gradient_accumulation_steps"] = tbs // (mb * world_size)
    elif tbs is None and mb is not None:  # DeepSpeed: no accumulation unless given
        ds["train_batch_size"], ds["gradient_accumulation_steps"] = mb * (ga or 1) * world_size, ga or 1
    elif tbs is not None and mb is None:  # DeepSpeed derives the micro batch: it must be whole
        if tbs % ((ga or 1) * world_size):
            raise ConfigError("train_batch_size", f"{tbs} is not gradient_accumulation_steps * ranks * micro batch = "
                              f"{ga or 1} * {world_size} * k; use a multiple of {(ga or 1) * world_size}")
        ds["train_micro_batch_size_per_gpu"] = tbs // ((ga or 1) * world_size)
        ds["gradient_accumulation_steps"] = ga or 1
    return {**{k: AUTO for k in _BATCH if raw.get(k) == AUTO}, **ds}  # "auto" left where not derived


def _top(ds) -> dict:
    """The top-level object with its "auto" batch keys dropped (derived as if absent)."""
    if not isinstance(ds, dict):
        raise ConfigError("DeepSpeed config", f"the top level must be a JSON object, got {json.dumps(ds)[:40]}")
    return {k: v for k, v in ds.items() if not (k in _BATCH and v == AUTO)}


def translate(ds: dict) -> dict:
    """A DeepSpeed config dict -> shardlab config sections (``config.from_dict`` input). As in
    DeepSpeed, it must give ``train_batch_size`` or ``train_micro_batch_size_per_gpu`` (``"auto"``
    counts: shardlab's own value)."""
    if isinstance(ds, dict) and not set(ds) & set(_BATCH[:2]):
        raise ConfigError("train_batch_size", "a DeepSpeed config gives train_batch_size or "
                          "train_micro_batch_size_per_gpu (DeepSpeed refuses one with neither); add e.g. "
                          "\"train_micro_batch_size_per_gpu\": 8, or \"auto\" for shardlab's own batch")
    ds = _top(ds)
    out: dict = {"train": {}, "parallel": {}, "logging": {}}
    unsupported: list[str] = []
    if "model" in ds:
        out["model"] = _dict(ds, "model", '{"d_model": 128}')
    if (tp := _positive_int(ds, "autotp_size")) is not None:
        out["parallel"]["tp"] = tp
    _batch(ds, out)
    _optimizer(ds, out, unsupported)
    _scheduler(ds, out, unsupported)
    _precision(ds, out, unsupported)
    _zero(ds, out, unsupported)
    _refusals(ds)
    if ds.get("gradient_clipping", 1.0) != AUTO:  # DeepSpeed's default is 1.0 (runtime/constants.py); 0 = off
        clip = _num(ds.get("gradient_clipping", 1.0), "gradient_clipping")
        if clip < 0:
            raise ConfigError("gradient_clipping", f"got {clip:g}; must be >= 0 (0 = no clipping)")
        out["train"]["grad_clip"] = clip
    out["train"]["weight_decay_params"] = "all"  # DeepSpeed decays every parameter it is given
    ac = _dict(ds, "activation_checkpointing", '{"partition_activations": false}')
    if ac:
        out["parallel"]["activation_checkpointing"] = "full"
        unsupported += [f"activation_checkpointing.{k}" for k in ac if ac[k] not in (False, None)]
    if "steps_per_print" in ds:
        out["logging"]["log_every"] = _positive_int(ds, "steps_per_print") or 10
    for k in ds:  # DeepSpeed ignores unknown keys; a misspelt one ("zero_optimisation") would run DDP
        if k not in _TOP_KEYS | _NO_EFFECT_TOP | _CHECKED_TOP and (close := difflib.get_close_matches(
                k, sorted(_TOP_KEYS | _CHECKED_TOP), n=1, cutoff=0.85)):  # strict: DeepSpeed has many keys
            raise ConfigError(k, f"unknown DeepSpeed key (did you mean '{close[0]}'?); fix its spelling")
    unsupported += [k for k in ds if k not in _TOP_KEYS | _NO_EFFECT_TOP | _CHECKED_TOP]
    unsupported += [f"data_types.{k}" for k in _dict(ds, "data_types", "{}") if k != "grad_accum_dtype"]
    no_effect = out.pop("_no_effect", []) + [k for k in ds if k in _NO_EFFECT_TOP]
    if unsupported:
        warnings.warn("DeepSpeed config: not supported by shardlab, ignored: " + ", ".join(unsupported),
                      stacklevel=2)
    if no_effect:
        warnings.warn("DeepSpeed config: tuning / logging keys that do not change what a step computes, left to "
                      "shardlab's own settings: " + ", ".join(no_effect), stacklevel=2)
    return {k: v for k, v in out.items() if v}
