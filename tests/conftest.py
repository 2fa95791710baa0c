"""Shared test helpers. Distributed tests start real gloo ranks with shardlab.launch.run;
worker functions must live at module level (they are pickled into spawned processes)."""
import os

import pytest
import torch

import shardlab.train.checks  # noqa: F401  (registers every config check, as each entry point does)

# Parity is checked in float64 against one process: 1e-10 is the bar (docs/composition.md).
PARITY_ATOL = 1e-10


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    yield
