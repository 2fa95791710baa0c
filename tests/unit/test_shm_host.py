"""shm_host: the shared-memory transport's file reservation and its wait loop."""
import errno
import os
import time
import uuid

import pytest

from shardlab.distributed import shm_host
from shardlab.errors import ConfigError


def _path():
    return f"/dev/shm/shardlab-test-{uuid.uuid4().hex}"


def test_reserve_allocates_the_whole_file():
    path = _path()
    try:
        shm_host.reserve(path, 1 << 20)
        st = os.stat(path)
        assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20  # allocated, not only promised
        with pytest.raises(FileExistsError):  # never overwrites
            shm_host.reserve(path, 4096)
    finally:
        os.unlink(path)


def test_reserve_without_room_names_the_fix_and_leaves_nothing(monkeypatch):
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    path = _path()
    with pytest.raises(ConfigError, match=r"^config error: parallel.comm_transport: the shared-memory transport needs 64 MiB more in /dev/shm \(\d+ MiB free\); enlarge it \(docker run --shm-size=8g\)"):
        shm_host.reserve(path, 64 << 20)
    assert not os.path.exists(path)


def test_wait_times_out_with_the_late_text_and_progress_restarts_the_clock():
    with pytest.raises(RuntimeError, match=r"^rank 1 did not arrive in 0 s$"):
        shm_host.wait(lambda: False, 0.05, lambda: "rank 1 did not arrive")
    # something moves for 0.2 s, four times the timeout: the wait must not give up meanwhile
    end = time.monotonic() + 0.2

    def progress():
        time.sleep(0.01)
        return time.monotonic() < end
    shm_host.wait(lambda: time.monotonic() >= end, 0.05, lambda: "gave up while moving", progress)
