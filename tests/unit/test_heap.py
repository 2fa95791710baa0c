"""distributed/heap.release hands the heap's free pages back: blocks below glibc's mmap threshold
freed between live ones leave holes that stay resident until it runs (docs/data-parallel.md,
Where the memory goes). Run in a fresh process, so this test's heap is its own."""
import platform
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
from shardlab.distributed import heap

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

blocks = [torch.ones(16 * 1024) for _ in range(4096)]  # 64 KiB each (below the 128 KiB threshold): 256 MiB of heap
del blocks[::2]                                          # 128 MiB of holes between live blocks
before = rss()
heap.release(torch.device("cpu"))
after = rss()
heap.release("cuda")                                     # not a CPU rank: nothing to do
print(before - after)
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's malloc_trim")
def test_release_returns_the_holes_left_by_freed_blocks():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    freed = int(out.stdout.split()[-1])
    assert freed > 100 * 2**20, f"{freed / 2**20:.1f} MiB handed back; 128 MiB of holes were free"
