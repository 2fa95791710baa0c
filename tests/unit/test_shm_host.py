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


def test_spin_before_napping_only_with_two_cores_per_rank(monkeypatch):
    """A wait yields for spin_s before its first nap (no sleep before it); the policy spins only
    where the host has at least two cores per rank of the group (else ranks outnumber cores)."""
    slept = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    t0 = time.monotonic()
    shm_host.wait(lambda: time.monotonic() - t0 > 0.01, 5, lambda: "late", spin_s=0.05)
    assert not slept  # done after 10 ms, inside the 50 ms spin
    shm_host.wait(lambda: len(slept) >= 3, 5, lambda: "late")  # no spin: naps after SPINS yields
    assert slept[:3] == [2e-5, 4e-5, 8e-5]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert shm_host.spin_seconds(8) == shm_host.SPIN_S and shm_host.spin_seconds(9) == 0.0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # this CI machine: 2 cores
    assert shm_host.spin_seconds(2) == 0.0 and shm_host.spin_seconds(1) == shm_host.SPIN_S
