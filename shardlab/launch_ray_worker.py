"""Parts of the Ray launcher (launch_ray.py) that run in its workers or travel between them and
the driver: rank 0's mailbox (its return value, each rank's start count), Python's own print
around the rank function, the reported checkpoints, a failed script's exit status. Docs: docs/ray.md."""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def plain_print():
    """Python's own ``print`` around the rank function. Ray Train replaces it in its workers with one
    that logs each line and, since Ray's worker wraps sys.stderr, also prints it: every line of a
    rank (``train: step ...``) reached the driver twice. Ray's log_to_driver still forwards it."""
    import builtins
    import sys
    original = getattr(sys.modules.get("ray.train.v2._internal.logging.patch_print"), "_original_print", None)
    patched = builtins.print
    if original is None or patched is original:
        yield
        return
    builtins.print = original
    try:
        yield
    finally:
        builtins.print = patched


class Mailbox:
    """A Ray actor holding rank 0's return value for the driver."""

    def __init__(self):
        self.value = pickle.dumps(None)
        self.starts: dict[int, int] = {}

    def start(self, rank: int) -> int:
        """How many times ``rank`` started before (every rank restarts with its group)."""
        self.starts[rank] = self.starts.get(rank, 0) + 1
        return self.starts[rank] - 1

    def put(self, value: bytes) -> None:
        self.value = value

    def get(self) -> bytes:
        return self.value


def step_of(path) -> int:
    return int(Path(path).name.rpartition("_")[2]) if Path(path).name.startswith("step_") else -1


def newest_reported(run_storage: str):
    """The newest complete checkpoint the ranks reported, read from this launch's Ray Train storage
    when this node sees it: it may be newer than ``get_checkpoint()``'s (docs/ray.md, "Checkpoints
    and failure recovery")."""
    from .checkpoint.save import latest_valid
    return latest_valid(run_storage, warn=lambda *_: None) if Path(run_storage).is_dir() else None


def reporter(rank: int):
    """``on_checkpoint(path, step)``: hand Ray Train this rank's files of checkpoint ``path``
    (hard links in a scratch directory; rank 0 adds the index)."""
    import ray.train

    def report(path, step):
        path = Path(path)
        mine = [p for p in path.iterdir() if p.name.startswith(f"rank_{rank:05d}.")
                or (rank == 0 and not p.name.startswith("rank_"))]
        with tempfile.TemporaryDirectory(prefix=f"shardlab-ray-rank{rank}-") as scratch:
            for p in mine:
                try:
                    os.link(p, Path(scratch) / p.name)
                except OSError:  # another file system: copy this rank's own file
                    shutil.copy2(p, Path(scratch) / p.name)
            ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(scratch),
                             checkpoint_dir_name=path.name)
    return report


class ScriptFailed(RuntimeError):
    """A rank's script exited non-zero under ``shardlab launch --launcher ray``; ``code``: its exit
    status (negative: the signal that killed it), which the command returns as the local launcher does."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return ScriptFailed, (self.args[0], self.code)
