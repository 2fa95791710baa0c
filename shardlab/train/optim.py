"""AdamW, the warm-up + cosine schedule, mixed-precision autocast and the fp16 loss scaler."""
from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def build_adamw(cfg: TrainConfig, device: torch.device):
    """A function ``param_groups -> AdamW``: fused on CUDA, foreach on CPU."""
    def build(groups):
        kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        if device.type == "cuda":
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
        return torch.optim.AdamW(groups, **kwargs)
    return build


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine down to ``lr * min_lr_ratio``.
    ``step`` counts from 0 (the first optimizer step uses lr_at(0))."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


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
    """Dynamic loss scaling for fp16: multiply the loss by ``scale``; if any gradient on any rank
    is inf/nan, skip the step and halve the scale; after ``window`` clean steps, double it."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, window: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.window = window
        self.clean_steps = 0
        self.skipped = 0

    def unscale_and_check(self, params, comm=None) -> bool:
        """Divide gradients by the scale; return True when the step must be skipped (overflow).
        ``comm``: a world Comm so every rank takes the same decision."""
        if not self.enabled:
            return False
        found = torch.zeros((), dtype=torch.float32, device=next(iter(params)).device)
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)
                found += (~torch.isfinite(p.grad)).any().float()
        if comm is not None:
            comm.all_reduce(found, op="max")
        return bool(found > 0)

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.skipped = int(state.get("skipped", 0))
