"""DeepSpeed JSON -> shardlab config: ``shardlab train ds_config.json`` runs a DeepSpeed config.

``config.load`` recognises a DeepSpeed file (``train_batch_size`` / ``zero_optimization`` keys)
and calls :func:`translate`. Keys shardlab does not implement are named in one warning;
inconsistent batch sizes raise ConfigError before any process starts.

Batch sizes follow DeepSpeed: train_batch_size = micro_batch_per_gpu * gradient_accumulation
* data-parallel ranks, so the three numbers fix the data-parallel degree (``parallel.dp_shard``;
run it with ``--nproc`` equal to it).
"""
from __future__ import annotations

import warnings

from .errors import ConfigError

_ZERO_KEYS = {"stage", "reduce_bucket_size", "overlap_comm", "offload_optimizer", "offload_param"}
_TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "gradient_clipping",
             "activation_checkpointing", "steps_per_print"}


def _positive_int(ds: dict, key: str):
    v = ds.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(key, f"must be a positive integer, got {v!r}")
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


def _optimizer(ds: dict, out: dict, unsupported: list):
    opt = ds.get("optimizer")
    if not opt:
        return
    kind = str(opt.get("type", "AdamW"))
    params = dict(opt.get("params", {}))
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError("optimizer.type", f"{kind!r} is not supported; use Adam or AdamW (shardlab's "
                                            "optimizer is AdamW), or pass optimizer= to shardlab.initialize")
    if kind.lower() == "adam" and params.pop("adam_w_mode", True) is False:
        unsupported.append("optimizer.params.adam_w_mode=false (shardlab's Adam is always AdamW)")
    params.pop("adam_w_mode", None)
    params.pop("torch_adam", None)  # a DeepSpeed implementation choice, not a setting
    t = out["train"]
    if "lr" in params:
        t["lr"] = float(params.pop("lr"))
    if "betas" in params:
        t["beta1"], t["beta2"] = (float(b) for b in params.pop("betas"))
    if "eps" in params:
        t["eps"] = float(params.pop("eps"))
    if "weight_decay" in params:
        t["weight_decay"] = float(params.pop("weight_decay"))
    unsupported += [f"optimizer.params.{k}" for k in params]


_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _scheduler(ds: dict, out: dict, unsupported: list):
    sch = ds.get("scheduler")
    if not sch:  # DeepSpeed without a scheduler: the optimizer's constant learning rate
        out["train"].update(warmup_steps=0, min_lr_ratio=1.0)
        return
    kind, params = sch.get("type"), dict(sch.get("params", {}))
    t = out["train"]
    if kind not in _SCHEDULERS:
        raise ConfigError("scheduler.type", f"{kind!r} is not supported; use one of {', '.join(_SCHEDULERS)} "
                                            "or drop the scheduler block (constant learning rate)")
    if kind == "WarmupCosineLR":  # warm-up to the optimizer's lr, cosine to lr * cos_min_ratio
        t["warmup_steps"] = int(params.pop("warmup_num_steps", 0))
        t["steps"] = int(params.pop("total_num_steps", t.get("steps", 1)))
        t["min_lr_ratio"] = float(params.pop("cos_min_ratio", 0.0001))
        if float(params.pop("warmup_min_ratio", 0.0)):
            unsupported.append("scheduler.params.warmup_min_ratio (warm-up starts from 0)")
        if params.pop("warmup_type", "linear") != "linear":
            unsupported.append("scheduler.params.warmup_type (shardlab warms up linearly)")
        unsupported += [f"scheduler.params.{k}" for k in params]
        return
    if "warmup_num_steps" in params:
        t["warmup_steps"] = int(params.pop("warmup_num_steps"))
    if "warmup_max_lr" in params:
        t["lr"] = float(params.pop("warmup_max_lr"))
    if params.pop("warmup_type", "linear") != "linear":
        unsupported.append("scheduler.params.warmup_type (shardlab warms up linearly)")
    min_lr = float(params.pop("warmup_min_lr", 0.0))
    if min_lr:
        unsupported.append("scheduler.params.warmup_min_lr (warm-up starts from 0)")
    if kind == "WarmupLR":
        t["min_lr_ratio"] = 1.0  # constant after warm-up
    else:
        if "total_num_steps" in params:
            t["steps"] = int(params.pop("total_num_steps"))
        t["min_lr_ratio"] = 0.0
        unsupported.append("scheduler WarmupDecayLR's linear decay (shardlab decays with a cosine to 0)")
    unsupported += [f"scheduler.params.{k}" for k in params]


def _precision(ds: dict, out: dict, unsupported: list):
    fp16, bf16 = ds.get("fp16", {}) or {}, ds.get("bf16", {}) or {}
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ConfigError("fp16.enabled", "fp16 and bf16 are both enabled; enable one")
    t = out["train"]
    if bf16.get("enabled"):
        t["precision"] = "bf16"
    unsupported += [f"bf16.{k}" for k in bf16 if k != "enabled"]
    if fp16.get("enabled"):
        t["precision"] = "fp16"
        if fp16.get("loss_scale", 0):
            unsupported.append("fp16.loss_scale (static loss scale; shardlab scales dynamically)")
        if "initial_scale_power" in fp16:
            t["loss_scale_init"] = float(2 ** int(fp16["initial_scale_power"]))
        if "loss_scale_window" in fp16:
            t["loss_scale_window"] = int(fp16["loss_scale_window"])
    unsupported += [f"fp16.{k}" for k in fp16
                    if k not in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window")]


def _zero(ds: dict, out: dict, unsupported: list):
    z = ds.get("zero_optimization")
    if not z:
        return
    p = out["parallel"]
    stage = z.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage!r}")
    p["zero_stage"] = stage
    if "reduce_bucket_size" in z:  # DeepSpeed counts elements; shardlab MiB (of fp32 gradients)
        p["bucket_cap_mb"] = float(z["reduce_bucket_size"]) * 4 / 2**20
    if "overlap_comm" in z:
        p["overlap_comm"] = bool(z["overlap_comm"])
    offload = [k for k in ("offload_optimizer", "offload_param")
               if (z.get(k) or {}).get("device", "none") not in ("none", None)]
    if offload and stage == 3:
        p["offload"] = True
    elif offload:
        unsupported += [f"zero_optimization.{k} with stage {stage} (shardlab offloads at stage 3)" for k in offload]
    unsupported += [f"zero_optimization.{k}" for k in z if k not in _ZERO_KEYS]


def resolve_batch(ds: dict, world_size: int) -> dict:
    """DeepSpeed's rule when ``gradient_accumulation_steps`` is absent: train_batch_size /
    (train_micro_batch_size_per_gpu * world size). Returns a copy with the three numbers consistent
    with ``world_size`` (for ``shardlab.initialize``, where the world size is known)."""
    ds = dict(ds)
    tbs = _positive_int(ds, "train_batch_size")
    mb = _positive_int(ds, "train_micro_batch_size_per_gpu")
    ga = _positive_int(ds, "gradient_accumulation_steps")
    if tbs is not None and mb is not None and ga is None:
        if tbs % (mb * world_size):
            raise ConfigError("train_batch_size", f"{tbs} is not train_micro_batch_size_per_gpu * ranks * k = "
                              f"{mb} * {world_size} * k; use a multiple of {mb * world_size}")
        ds["gradient_accumulation_steps"] = tbs // (mb * world_size)
    elif tbs is None and mb is not None:
        ds["train_batch_size"] = mb * (ga or 1) * world_size
    return ds


def translate(ds: dict) -> dict:
    """A DeepSpeed config dict -> shardlab config sections (``config.from_dict`` input)."""
    out: dict = {"train": {}, "parallel": {}, "logging": {}}
    unsupported: list[str] = []
    _batch(ds, out)
    _optimizer(ds, out, unsupported)
    _scheduler(ds, out, unsupported)
    _precision(ds, out, unsupported)
    _zero(ds, out, unsupported)
    if "gradient_clipping" in ds:
        out["train"]["grad_clip"] = float(ds["gradient_clipping"])
    ac = ds.get("activation_checkpointing")
    if ac:
        out["parallel"]["activation_checkpointing"] = "full"
        unsupported += [f"activation_checkpointing.{k}" for k in ac if ac[k] not in (False, None)]
    if "steps_per_print" in ds:
        out["logging"]["log_every"] = int(ds["steps_per_print"])
    unsupported += [k for k in ds if k not in _TOP_KEYS]
    if unsupported:
        warnings.warn("DeepSpeed config: not supported by shardlab, ignored: " + ", ".join(unsupported),
                      stacklevel=2)
    return {k: v for k, v in out.items() if v}
