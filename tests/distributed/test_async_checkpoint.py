"""Asynchronous checkpoint saves (checkpoint.async_save; docs/checkpoints.md "Asynchronous saves"):
the same files as a blocking save, exact resume, a failed or killed background write keeps the
previous checkpoint, at most one save in flight."""
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from shardlab.cli import main as cli_main
from shardlab.checkpoint import async_save
from shardlab.checkpoint import save as ckpt

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=0",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0",
        "--checkpoint.every=2", "--train.steps=4", "--parallel.dp_shard=2", "--parallel.zero_stage=3"]


def _train(run: Path, cache: Path, *extra) -> int:
    return cli_main(["train", "--nproc", "2", *TINY, f"--data.cache_dir={cache}", f"--logging.run_dir={run}", *extra])


def _files(step_dir: Path) -> dict:
    """File name -> bytes; index.json without meta.config (run_dir and the flags differ)."""
    out = {}
    for f in sorted(step_dir.iterdir()):
        if f.name == "index.json":
            index = json.loads(f.read_text())
            index["meta"].pop("config")
            out[f.name] = index
        else:
            out[f.name] = f.read_bytes()
    return out


def _same_state(a: Path, b: Path) -> None:
    """Every tensor equal (read by key: a resumed run lists its optimizer pieces in another order,
    so its files are not byte-identical, with blocking saves too) and the same meta but config."""
    with ckpt.Reader(a) as ra, ckpt.Reader(b) as rb:
        assert sorted(ra.keys()) == sorted(rb.keys())
        assert [k for k in ra.keys() if not torch.equal(ra.read(k), rb.read(k))] == []
        ma, mb = dict(ra.meta), dict(rb.meta)
        ma.pop("config"), mb.pop("config")
        assert ma == mb


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """A blocking-save run: checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("sync") / "run"
    assert _train(run, cache) == 0
    return run / "checkpoints"


def test_async_save_writes_the_same_files_as_a_blocking_save(tmp_path, cache, reference):
    run = tmp_path / "run"
    assert _train(run, cache, "--checkpoint.async_save=true") == 0
    ck = run / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step_00000002", "step_00000004"]
    assert not list(ck.glob(".tmp-*"))
    for name in ("step_00000002", "step_00000004"):
        assert _files(ck / name) == _files(reference / name), name
    cfg = json.loads((ck / "step_00000004" / "index.json").read_text())["meta"]["config"]
    assert cfg["checkpoint"]["async_save"] is True
    # resuming from an asynchronous checkpoint: test_failed_background_write_...[exit]


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_failed_background_write_keeps_the_previous_checkpoint(tmp_path, cache, reference, monkeypatch, capsys, kind):
    """Rank 1's writer of step 4 raises (reported at the end of training) or the rank dies
    (os._exit, as if killed) in the middle of its data file: step 2 stays the newest valid
    checkpoint, and (after the killed rank) --resume continues from it to the same step 4 as an
    uninterrupted run."""
    run = tmp_path / "run"
    monkeypatch.setenv(async_save.HOOK_ENV, f"{kind}:1:4")
    assert _train(run, cache, "--checkpoint.async_save=true") != 0
    err = capsys.readouterr().err
    if kind == "raise":
        assert "asynchronous save of step 4 failed" in err, err[-2000:]
    ck = run / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step_00000002"]
    assert ckpt.latest_valid(ck) == ck / "step_00000002"
    ckpt.Reader(ck / "step_00000002").verify_all()
    if kind == "raise":
        return
    monkeypatch.delenv(async_save.HOOK_ENV)
    assert _train(run, cache, "--checkpoint.async_save=true", "--resume") == 0
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step_00000002", "step_00000004"]
    assert not list(ck.glob(".tmp-*"))
    _same_state(ck / "step_00000004", reference / "step_00000004")


# -- in one process (a world of one): ordering and error reporting ---------------------------------

class _Comm:
    def barrier(self):
        pass

    def all_reduce(self, t, op="sum"):
        return t


class _Mesh:
    rank, world_size = 0, 1

    def comm(self, name):
        return _Comm()


def _pieces(w):
    return lambda: [ckpt.Piece("model.w", tuple(w.shape), (0,) * w.dim(), w),
                    ckpt.Piece("model.b", (3,), (0,), torch.arange(3.0))]


def test_at_most_one_save_in_flight_and_snapshot_is_taken_at_the_step(tmp_path):
    saver, mesh, w = async_save.AsyncSaver(), _Mesh(), torch.zeros(4, 4)
    t0 = time.perf_counter()
    saver.save(tmp_path, 1, mesh, _pieces(w), lambda: {"n": 1}, "cpu", keep=5, hook="sleep:0:1")  # a 2 s write
    assert time.perf_counter() - t0 < 1.0  # returned before the write
    w.add_(1.0)  # training mutates the parameters in place: the snapshot must not see it
    done = {}
    second = threading.Thread(target=lambda: done.setdefault(
        "t", (saver.save(tmp_path, 2, mesh, _pieces(w), lambda: {"n": 2}, "cpu", keep=5), time.perf_counter())[1]))
    second.start()
    time.sleep(0.5)
    assert second.is_alive() and ckpt.list_checkpoints(tmp_path) == []  # waits for the first save
    second.join()
    assert done["t"] - t0 >= 1.9
    saver.settle(mesh)
    with ckpt.Reader(tmp_path / "step_00000001") as r:
        assert torch.equal(r.read("model.w"), torch.zeros(4, 4))
    with ckpt.Reader(tmp_path / "step_00000002") as r:
        assert torch.equal(r.read("model.w"), torch.ones(4, 4)) and r.meta == {"n": 2}


def test_error_is_raised_at_the_next_save_and_nothing_is_published(tmp_path):
    saver, mesh, w = async_save.AsyncSaver(), _Mesh(), torch.zeros(2, 2)
    saver.save(tmp_path, 1, mesh, _pieces(w), dict, "cpu")
    saver.settle(mesh)
    saver.save(tmp_path, 2, mesh, _pieces(w), dict, "cpu", hook="raise:0:2")
    with pytest.raises(ckpt.CheckpointError, match="asynchronous save of step 2 failed.*injected"):
        saver.save(tmp_path, 3, mesh, _pieces(w), dict, "cpu")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert (ckpt.staging_dir(tmp_path, 2) / "rank_00000.failed").exists()
    saver.save(tmp_path, 3, mesh, _pieces(w), dict, "cpu")  # the error was reported once; saving goes on
    saver.settle(mesh)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003"]
    assert not ckpt.staging_dir(tmp_path, 2).exists()  # removed by the next commit


def test_on_commit_runs_after_the_commit_and_not_after_a_failure(tmp_path):
    """What names a checkpoint (DeepSpeed's ``latest``, written by ``engine.save_checkpoint``'s
    ``on_commit``) must not name one that is not committed: before 2026-12-07 the engine wrote
    ``latest`` when an asynchronous save was issued."""
    saver, mesh, w, calls = async_save.AsyncSaver(), _Mesh(), torch.zeros(2, 2), []

    def named():
        calls.append([p.name for p in ckpt.list_checkpoints(tmp_path)])
    saver.save(tmp_path, 1, mesh, _pieces(w), dict, "cpu", hook="sleep:0:1", on_commit=named)  # a 2 s write
    assert calls == []  # issued, not committed
    saver.settle(mesh)
    assert calls == [["step_00000001"]]  # called once, with the checkpoint in place
    saver.save(tmp_path, 2, mesh, _pieces(w), dict, "cpu", hook="raise:0:2", on_commit=named)
    with pytest.raises(ckpt.CheckpointError, match="step 2 failed"):
        saver.settle(mesh)
    assert calls == [["step_00000001"]]  # a failed save names nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_is_pinned_and_taken_at_the_step(tmp_path):
    saver, mesh, w = async_save.AsyncSaver(), _Mesh(), torch.zeros(256, 256, device="cuda")
    saver.save(tmp_path, 1, mesh, _pieces(w), dict, "cuda")
    w.add_(1.0)  # queued after the copy on the same stream
    saver.settle(mesh)
    # the CUDA piece's snapshot buffer is pinned (an asynchronous copy); the CPU piece's is not
    assert [h.is_pinned() for h in saver._host] == [True, False]
    with ckpt.Reader(tmp_path / "step_00000001") as r:
        assert torch.equal(r.read("model.w"), torch.zeros(256, 256))
