"""The CNN of PyTorch's MNIST example: two 3x3 convolutions, max-pool, two linear layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 28
"""Input images are (B, 1, 28, 28): 28 -> 26 (conv1) -> 24 (conv2) -> 12 (pool)."""
FLAT = 64 * 12 * 12
"""Features entering fc1: 64 channels of 12 x 12 = 9216."""


class CNN(nn.Module):
    """conv1(1->32, 3x3) ReLU conv2(32->64, 3x3) ReLU maxpool(2) dropout flatten
    fc1(9216->d_model) ReLU dropout fc2(d_model->n_classes)."""

    def __init__(self, cfg):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(FLAT, cfg.d_model)
        self.fc2 = nn.Linear(cfg.d_model, cfg.n_classes)
        self.dropout = nn.Dropout(cfg.dropout)
        self.criterion = nn.CrossEntropyLoss()  # mean over the batch

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``images`` float (B, 1, 28, 28) -> logits (B, n_classes), or the mean cross-entropy
        against ``targets`` (B,) int64 when given."""
        x = F.relu(self.conv1(images))
        x = F.relu(self.conv2(x))
        x = self.dropout(F.max_pool2d(x, 2))
        x = self.dropout(F.relu(self.fc1(torch.flatten(x, 1))))
        logits = self.fc2(x)
        if targets is None:
            return logits
        return self.criterion(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
                              targets)
