"""AdamW, the warm-up + cosine schedule, mixed-precision autocast and the fp16 loss scaler."""
from __future__ import annotations

import math

import torch

from ..config import TrainConfig
from ..parallel.engine import by_device_and_dtype


def decay_rule(groups, cfg: TrainConfig):
    """The engines' groups (decay = matrices, no decay = norms and vectors) under
    ``train.weight_decay_params``: ``all`` gives every group ``train.weight_decay``."""
    if cfg.weight_decay_params != "all":
        return groups
    return [dict(g, weight_decay=cfg.weight_decay) for g in groups]


STEP_CHUNK = 32 << 20  # bytes of parameters one foreach AdamW call steps (ChunkedAdamW)


class ChunkedAdamW(torch.optim.AdamW):
    """foreach AdamW that steps at most :data:`STEP_CHUNK` bytes of parameters per call. foreach
    AdamW makes temporaries the size of every parameter it is handed (the square root of the
    second moment), so over a whole replicated model they are one more model-sized tensor at the
    step, the peak of a DDP rank (docs/data-parallel.md, Where the memory goes). The update is
    elementwise, so stepping in chunks gives the same values bit for bit; the groups (and
    ``param_groups``, the lr schedule's handle) are untouched. A flat ZeRO shard is one tensor, so
    it is one chunk whatever its size."""

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # AdamW's own step without the optimizer's hooks (torch wraps ``step`` to run them): they
        # belong to this step, which runs them once (ZeRO's post-step all-gather is one of them)
        inner = torch.optim.AdamW.step
        inner = inner.__wrapped__ if getattr(inner, "hooked", False) else inner
        kept = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = []
            for g, params in zip(self.param_groups, kept):
                for chunk in _chunks(params, STEP_CHUNK):
                    g["params"] = chunk
                    inner(self)
                g["params"] = []
        finally:
            for g, params in zip(self.param_groups, kept):
                g["params"] = params
        return loss


def _chunks(params, limit: int):
    """Consecutive runs of ``params`` of at most ``limit`` bytes (a larger tensor: a run of its own)."""
    run, size = [], 0
    for p in params:
        n = p.numel() * p.element_size()
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(p)
        size += n
    if run:
        yield run


def skips_on_device(optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device (:func:`step_if_finite`): torch's fused
    Adam/AdamW (what :func:`build_adamw` builds on CUDA) take a ``found_inf`` flag and leave
    parameters, moments and step counts untouched where it is set."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def step_if_finite(optimizer, norm: torch.Tensor) -> torch.Tensor:
    """Step ``optimizer`` unless ``norm`` (the global gradient norm, a device tensor) is inf/nan,
    decided on the device: no host read, so the host queues the next step's work while this one
    runs (a host read of the norm cost GPT-2 124M 2% of its step on an H100; docs/gpu.md). Returns
    the flag (a bool tensor: True = not finite, the step was not applied). Needs
    :func:`skips_on_device`."""
    bad = ~torch.isfinite(norm)
    optimizer.found_inf = bad.float().reshape(())
    optimizer.step()
    return bad


def optimizer_step(engine, optimizer, scaler, grad_clip: float, world, device, anomaly=None) -> dict:
    """The end of every training step, shared by the train loop and ``api.ModelEngine``: fp16
    unscale of exactly the gradient tensors this rank owns and one world all-reduce of the
    overflow flag; clipping; the non-finite check (a non-finite global norm, the same on every
    rank, means the loss or the gradients are inf/nan: never step on it); the optimizer step;
    the loss scale's update; zeroed gradients. With a fused optimizer and no anomaly detector the
    check runs on the device (:func:`step_if_finite`): ``grad_norm`` and ``nonfinite`` are then
    device tensors, read once the step is done (train/loop.resolve). Returns ``{overflow,
    grad_norm, nonfinite, anomaly}`` (``anomaly``: the detector's note, or None)."""
    overflow = scaler.unscale_and_check(engine.grads(), world, device)
    gnorm, nonfinite, found = float("nan"), False, None
    if not overflow and anomaly is None and skips_on_device(optimizer):
        gnorm = engine.clip_grads(grad_clip, read=False)
        nonfinite = step_if_finite(optimizer, gnorm)
    elif not overflow:
        gnorm = engine.clip_grads(grad_clip)
        found = anomaly.agree(world, device) if anomaly else None  # the first non-finite module
        nonfinite = not math.isfinite(gnorm) or found is not None
        if not nonfinite:
            optimizer.step()
    scaler.update(overflow)
    optimizer.zero_grad(set_to_none=True)
    return {"overflow": overflow, "grad_norm": gnorm, "nonfinite": nonfinite, "anomaly": found}


def build_adamw(cfg: TrainConfig, device: torch.device):
    """A function ``param_groups -> AdamW``: fused on CUDA (no temporaries), foreach in chunks on
    CPU (:class:`ChunkedAdamW`)."""
    def build(groups):
        kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
        if device.type == "cuda":
            return torch.optim.AdamW(decay_rule(groups, cfg), fused=True, **kwargs)
        return ChunkedAdamW(decay_rule(groups, cfg), foreach=True, **kwargs)
    return build


def schedule_steps(step: int, scaler, cfg: TrainConfig) -> int:
    """The steps a schedule has counted before optimizer step ``step``: all of them for cosine
    (shardlab's rule), for a ds_* schedule those not skipped for an fp16 overflow, as DeepSpeed's
    scheduler steps only with an applied step (``scaler.skipped`` is in every checkpoint)."""
    return step if cfg.lr_schedule == "cosine" else step - scaler.skipped


def lr_at(step: int, cfg: TrainConfig, peak: float | None = None) -> float:
    """The learning rate of optimizer step ``step`` (from 0; ``step`` = steps applied before it).
    cosine: linear warm-up to ``lr`` over ``warmup_steps``, then cosine to ``lr * min_lr_ratio``.
    ds_*: DeepSpeed's scheduler (:func:`ds_lr`). ``peak``: a param group's own lr (default lr)."""
    lr = cfg.lr if peak is None else peak
    if cfg.lr_schedule != "cosine":
        return ds_lr(step - 1, cfg, lr)
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = lr * cfg.min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def ds_lr(it: int, cfg: TrainConfig, peak: float) -> float:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR after ``it`` scheduler steps, with
    their arithmetic: DeepSpeed sets the lr when the scheduler is built (``it = -1``) and steps it
    after every applied optimizer step, so step ``k`` trains with ``ds_lr(k - 1)``; warm-up spans
    ``max(2, warmup_num_steps)``; ``total_num_steps`` is ``train.steps``."""
    kind, w, start = cfg.lr_schedule, max(2, cfg.warmup_steps), cfg.warmup_start
    if it < 0:  # before the first scheduler step: warmup_min_lr (WarmupCosineLR: 0)
        return 0.0 if kind == "ds_warmup_cosine" else start
    if it < w:
        gamma = 1.0 / math.log(w) * math.log(it + 1) if cfg.warmup_type == "log" else it / w
        if kind == "ds_warmup_cosine":
            return peak * (start + gamma * (1.0 - start))
        return start + (peak - start) * gamma
    if kind == "ds_warmup":
        return start + (peak - start) * 1.0
    if kind == "ds_warmup_decay":
        return start + (peak - start) * max(0.0, float(cfg.steps - it) / float(max(1.0, cfg.steps - w)))
    progress = min(1.0, (it - w + 1) / max(1, cfg.steps - w))
    return peak * max(0.0, cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * ((1 + math.cos(math.pi * progress)) / 2))


def param_dtype(precision: str) -> torch.dtype:
    """Parameters stay fp32 under bf16/fp16 autocast (master weights); fp64 for parity runs."""
    return torch.float64 if precision == "fp64" else torch.float32


def autocast_factory(precision: str, device: torch.device):
    """A zero-argument callable returning the autocast context for forward passes (or None)."""
    if precision not in ("bf16", "fp16"):
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling for fp16, with ``torch.amp.GradScaler``'s arithmetic: the loss is
    multiplied by ``scale`` before backward; :meth:`unscale_and_check` divides the gradients by it
    and looks for inf/nan; :meth:`update` halves the scale after an overflow (the step is skipped)
    and doubles it after ``window`` consecutive clean steps. Disabled (bf16, fp32): scale 1, no check.

    The gradients are the tensors an engine owns (``engine.grads()``: DDP buckets, ZeRO/FSDP flat
    shards, TP/EP shards, a pipeline rank's stage), so every element is unscaled exactly once and
    checked on the rank that holds it; one all-reduce (max) of the found-inf flag over the world
    makes every rank skip the same steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, window: int = 1000,
                 growth: float = 2.0, backoff: float = 0.5, rule: str = "torch"):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.window, self.growth, self.backoff = window, growth, backoff
        self.clean_steps = 0
        self.skipped = 0
        # rule "deepspeed": DeepSpeed's DynamicLossScaler (hysteresis 2, min scale 1, its window count)
        self.rule, self.hysteresis, self.min_scale = rule, 2, 1.0
        self.iter, self.last_overflow = 0, -1

    @classmethod
    def from_config(cls, t) -> "LossScaler":
        """The scaler of ``train.*`` (enabled by ``precision = fp16``)."""
        return cls(t.precision == "fp16", t.loss_scale_init, t.loss_scale_window, rule=t.loss_scaler)

    def unscale_and_check(self, grads, comm=None, device=None) -> bool:
        """Multiply every tensor of ``grads`` by 1/scale in place; return True when any element on
        any rank is inf or nan (the step must be skipped). ``comm``: a world Comm (every rank must
        call, even with no gradients); ``device``: where the flag lives (the mesh device)."""
        if not self.enabled:
            return False
        grads = [g for g in grads if g is not None]
        if device is None:
            device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for (dev, _), ts in by_device_and_dtype(grads).items():
            flag = torch.zeros(1, dtype=torch.float32, device=dev)
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(ts, flag, inv)
            found = torch.maximum(found, flag.to(device))
        if comm is not None and comm.size > 1:
            comm.all_reduce(found, op="max")
        return bool(found.item() > 0)

    def update(self, overflow: bool) -> None:
        """After the step: back off on overflow (and count the skip), else grow after ``window``."""
        if not self.enabled:
            return
        if self.rule == "deepspeed":
            return self._update_deepspeed(overflow)
        if overflow:
            self.scale *= self.backoff
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= self.growth
                self.clean_steps = 0

    def _update_deepspeed(self, overflow: bool) -> None:
        """DeepSpeed's rule: an overflow first uses up the hysteresis (2: the scale halves at the
        2nd overflow), never below the min scale; the scale doubles when the steps since the last
        overflow reach a multiple of the window (and the hysteresis refills)."""
        if overflow:
            if self.hysteresis == 1:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iter
            self.skipped += 1
        else:
            stable = self.iter - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.hysteresis = 2
                self.scale *= self.growth
        self.iter += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped,
                "hysteresis": self.hysteresis, "iter": self.iter, "last_overflow": self.last_overflow}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.skipped = int(state.get("skipped", 0))
        self.hysteresis = int(state.get("hysteresis", 2))
        self.iter, self.last_overflow = int(state.get("iter", 0)), int(state.get("last_overflow", -1))
