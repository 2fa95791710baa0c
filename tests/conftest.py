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


# The longest files first. `make test` runs pytest-xdist with --dist loadfile --no-loadscope-reorder,
# which hands whole files to the two workers in collection order (xdist's own order, by number of
# tests per file, handed out the Ray file, 6 tests and about 10 minutes of one worker, 44th of 109:
# docs/status.md). Longest first, the short files fill in beside them at the end. Within a file
# the order stays.
SLOW_FIRST = ("tests/distributed/test_ray.py", "tests/distributed/test_reshard.py",
              "tests/distributed/test_live_recovery.py", "tests/distributed/test_memory_peaks.py",
              "tests/distributed/test_deepspeed_parity.py", "tests/distributed/test_compile.py",
              "tests/distributed/test_verify.py", "tests/distributed/test_faults.py", "tests/unit/test_gguf.py",
              "tests/test_docs_commands.py")


def pytest_collection_modifyitems(config, items):
    first = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(SLOW_FIRST)))  # stable
