"""The image classifier of PyTorch's MNIST example, trained on Fashion-MNIST: ``task = "classify"``
(a "token" is an image), data-parallel engines only (docs/cnn.md)."""
from __future__ import annotations

import math

from ...errors import require
from ..spec import ModelSpec, register
from .model import CNN, FLAT, IMAGE_SIZE


def init_std(name: str, shape, cfg) -> float:
    """Weights normal with std 1/sqrt(fan_in), fan_in = prod(shape[1:]) (in_channels*kh*kw for
    a convolution, in_features for a linear layer); biases zeros."""
    if name.endswith(".bias"):
        return 0.0
    return 1.0 / math.sqrt(math.prod(shape[1:]))


def forward_macs(cfg) -> int:
    """Multiply-accumulates of one image's forward pass."""
    o1, o2 = IMAGE_SIZE - 2, IMAGE_SIZE - 4
    conv1 = o1 * o1 * 32 * (1 * 3 * 3)
    conv2 = o2 * o2 * 64 * (32 * 3 * 3)
    return conv1 + conv2 + FLAT * cfg.d_model + cfg.d_model * cfg.n_classes


def flops_per_token(cfg, seq_len: int = 1) -> float:
    """Training FLOPs per IMAGE (the "token" of a classify task): forward 2*MACs, backward twice
    the forward, so 3 * 2 * MACs. ``seq_len`` is ignored."""
    return 3.0 * 2.0 * forward_macs(cfg)


def blocks(model) -> dict:
    """The layers in forward order: FSDP's default units, activation checkpointing."""
    return {"conv1": model.conv1, "conv2": model.conv2, "fc1": model.fc1, "fc2": model.fc2}


def check(cfg) -> None:
    m = cfg.model
    require(m.d_model >= 1, "model.d_model", "is the width of fc1; must be >= 1 (the example uses 128)")
    require(m.n_classes >= 2, "model.n_classes", "must be >= 2 (Fashion-MNIST has 10)")
    require(0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)")


def sample_batch(cfg, batch: int, generator):
    """Random normalised 28x28 images and labels."""
    import torch
    return (torch.randn(batch, 1, 28, 28, generator=generator),
            torch.randint(0, cfg.model.n_classes, (batch,), generator=generator))


SPEC = register(ModelSpec(
    name="cnn", build=CNN, init_std=init_std, flops_per_token=flops_per_token, blocks=blocks,
    task="classify", tp_plan=None, attention=None, pp_first=None, check=check, sample_batch=sample_batch))

__all__ = ["CNN", "SPEC", "forward_macs"]
