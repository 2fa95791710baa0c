"""The planner's price of torch's foreach AdamW and gradient clipping (``foreach_adamw``,
analysis/plan_features.py ``adamw_bytes``), against the bytes torch's own optimizer and
``clip_grad_norm_`` read and write on a model's parameters, counted operator by operator as they
run (a dispatch mode reading each operator's schema for what it writes), and in a step."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardlab.analysis.devices import HBM_EFF
from shardlab.analysis.plan_features import adamw_bytes
from shardlab.analysis.plan_memory import model_state
from shardlab.config import Config

SMALL = 64
"""Tensors of fewer elements (optimizer step counters, per-tensor norms, the clip coefficient) are
scalars beside the parameters and are not counted."""


class _Bytes(TorchDispatchMode):
    """HBM bytes moved by every operator: each distinct input tensor read once, each tensor the
    schema marks as written (in place) or returned fresh written once."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
        read, written = {}, 0
        for arg, value in zip(func._schema.arguments, values):
            ts = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.numel() >= SMALL]
            read.update({(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in ts})
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += sum(t.numel() * t.element_size() for t in ts)
        fresh = all(r.alias_info is None for r in func._schema.returns)
        if fresh:
            written += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                           if isinstance(t, torch.Tensor) and t.numel() >= SMALL)
        if read or written:
            self.ops.append(func.overloadpacket.__name__)
            self.bytes += sum(read.values()) + written
        return out


def _cfg() -> Config:
    """configs/tiny.toml's Llama (0.9M parameters), one rank."""
    from shardlab.commands.plan_cmd import load_model
    return load_model("tiny")


def _step_bytes(clip: bool, step: bool) -> tuple[int, list]:
    """Bytes of torch's second AdamW(foreach) step (the first makes the moments) and / or its
    clip_grad_norm_(foreach), on the tiny Llama's fp32 parameters, with torchtitan's settings."""
    from shardlab.models.spec import build_model
    torch.manual_seed(0)
    model = build_model(_cfg().model, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        mode = _Bytes()
        with mode:
            if clip:
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            if step:
                opt.step()
    return mode.bytes, mode.ops


@pytest.mark.parametrize("clip,step", [(False, True), (True, False), (True, True)])
def test_foreach_adamw_moves_the_priced_bytes(clip, step):
    """The planner's bytes for the elements its memory model says the optimizer steps equal what
    torch's AdamW (foreach) and clip_grad_norm_ (foreach) move, op for op."""
    from shardlab.models.spec import build_model
    got, ops = _step_bytes(clip, step)
    elems = model_state(_cfg())["opt_elems"]
    assert elems == sum(p.numel() for p in build_model(_cfg().model, 0).parameters())
    want = adamw_bytes(elems, clip) if step else adamw_bytes(elems, True) - adamw_bytes(elems, False)
    assert got == want, (got, want, ops)


def test_foreach_adamw_in_a_step():
    """``foreach_adamw`` on Llama-3.1-8B FSDP 8: the optimizer term is the rank's 1/8 of the
    parameters (the model's dimensions) at 80 bytes of AdamW and 12 of clipping each, where the
    engine's fused step moves 32, at the measured HBM share; the step grows by exactly the change
    of that term and nothing else moves."""
    from shardlab.analysis.predict import predict
    from test_planner_features import _cfg as layout_cfg, _llama_params
    cfg = layout_cfg("fsdp8 mb2x1 ac-op", 8)
    n, _ = _llama_params(cfg.model)
    hbm = 3.35e12 * HBM_EFF
    plain = predict(cfg, "h100", per_rank=False).breakdown
    fe = predict(cfg, "h100", per_rank=False, features=("foreach_adamw",)).breakdown
    # both add the global norm's all-reduce; the fused step reads and writes the fp32 master, the
    # fp32 gradient and the two moments (2 x 16 bytes per element)
    assert fe["optimizer"] - plain["optimizer"] == pytest.approx(math.ceil(n / 8) * (80 + 12 - 32) / hbm, rel=1e-3)
    assert fe["step_s"] == pytest.approx(plain["step_s"] + fe["optimizer"] - plain["optimizer"], rel=1e-12)
    assert fe["compute"] == plain["compute"] and fe["exposed_comm"] == pytest.approx(plain["exposed_comm"], rel=1e-9)


def test_foreach_adamw_is_refused_on_a_cpu():
    """On a CPU (shardlab's engine already steps foreach there): one line naming the flag."""
    from shardlab.analysis.devices import Device
    from shardlab.analysis.plan_features import check_features
    from shardlab.errors import ConfigError
    cpu = Device("cpu", 1e11, 24e9, 1e10, 0.5, 0.5, 1e9, 1e-5, 1e9, 1e-5, 1, "test CPU", op_s=1e-5)
    with pytest.raises(ConfigError, match="--foreach-adamw"):
        check_features(_cfg(), cpu, ("foreach_adamw",))
