"""Sharded checkpoint IO with synthetic pieces: box geometry, resharded reads, what is read,
checksums, truncation, incomplete saves, dtypes, and the CLI's refusals (exit 2, one line)."""
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlab.checkpoint import save as ckpt
from shardlab.checkpoint.format import flat_boxes, plan_cover

REPO = Path(__file__).resolve().parents[2]


def save(directory, step, tensors, layout, meta=None, keep=3, extra=None):
    """Save global ``tensors`` as pieces: layout[rank] = [(key, offsets, sizes), ...]."""
    staging = ckpt.prepare(directory, step)
    for rank, boxes in enumerate(layout):
        pieces = [ckpt.Piece(k, tuple(tensors[k].shape), off,
                             tensors[k][tuple(slice(o, o + s) for o, s in zip(off, size))].clone())
                  for k, off, size in boxes]
        ckpt.write_rank(staging, rank, pieces, (extra or {}).get(rank, {}))
    return ckpt.commit(directory, step, len(layout), meta or {"layout": f"test x{len(layout)}"}, keep=keep)


def row_split(key, shape, n):
    """Dim-0 shards (like TP / ZeRO row shards) of ``key`` over n ranks."""
    step = math.ceil(shape[0] / n)
    return [[(key, (r * step,) + (0,) * (len(shape) - 1), (min(step, shape[0] - r * step),) + tuple(shape[1:]))]
            for r in range(n)]


# -- geometry ----------------------------------------------------------------------------------

def _min_boxes(shape, lo, hi):
    """Brute force: fewest flat-contiguous boxes partitioning [lo, hi) (dynamic programming)."""
    n = math.prod(shape)
    idx = np.arange(n).reshape(shape)
    is_box = {}
    for a in range(lo, hi):
        for b in range(a + 1, hi + 1):
            coords = np.array(np.unravel_index(np.arange(a, b), shape)).T.reshape(b - a, len(shape))
            mins, maxs = coords.min(0), coords.max(0)
            box = idx[tuple(slice(m, x + 1) for m, x in zip(mins, maxs))]
            is_box[a, b] = box.size == b - a
    best = {hi: 0}
    for a in range(hi - 1, lo - 1, -1):
        best[a] = min(1 + best[b] for b in range(a + 1, hi + 1) if is_box[a, b])
    return best[lo]


@pytest.mark.parametrize("shape", [(1,), (5,), (1, 1), (2, 3), (3, 1), (1, 4), (3, 4), (2, 3, 4), (2, 1, 3),
                                   (3, 2, 2), (1, 2, 1)])
def test_flat_boxes_exhaustive(shape):
    t = torch.arange(math.prod(shape)).reshape(shape)
    flat = t.reshape(-1)
    for lo in range(flat.numel()):
        for hi in range(lo + 1, flat.numel() + 1):
            boxes = flat_boxes(shape, lo, hi)
            parts = [t[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes]
            assert torch.equal(torch.cat(parts), flat[lo:hi]), (shape, lo, hi, boxes)
            assert len(boxes) == _min_boxes(shape, lo, hi), (shape, lo, hi, boxes)


def test_flat_boxes_edges():
    assert flat_boxes((), 0, 1) == [((), ())]
    assert flat_boxes((4, 5), 3, 3) == []
    assert flat_boxes((4, 5), 0, 20) == [((0, 0), (4, 5))]
    with pytest.raises(ValueError, match="outside"):
        flat_boxes((2, 2), 1, 5)


def test_plan_cover_random_boxes_against_a_mask():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        shape = tuple(int(x) for x in torch.randint(1, 6, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                      generator=g))
        boxes = []
        for _ in range(int(torch.randint(0, 6, (1,), generator=g))):
            lo = [int(torch.randint(0, s, (1,), generator=g)) for s in shape]
            boxes.append((tuple(lo), tuple(int(torch.randint(1, s - o + 1, (1,), generator=g))
                                            for o, s in zip(lo, shape))))
        mask = torch.zeros(shape, dtype=torch.int64)
        for off, size in boxes:
            mask[tuple(slice(o, o + s) for o, s in zip(off, size))] = 1
        plan, hole = plan_cover((0,) * len(shape), shape, boxes)
        assert (hole is None) == bool(mask.all())
        if hole is None:  # the plan's parts are disjoint, inside their box, and cover everything once
            count = torch.zeros(shape, dtype=torch.int64)
            for i, off, size in plan:
                assert all(bo <= o and o + s <= bo + bs for o, s, bo, bs in zip(off, size, *boxes[i]))
                count[tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
            assert bool((count == 1).all())


# -- resharded reads ---------------------------------------------------------------------------

def test_read_any_box_under_another_layout(tmp_path):
    w = torch.randn(7, 5, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64)
    # saved by 3 ranks: w in dim-0 rows, b as FSDP-like flat shards; rank 2 duplicates rank 0's w rows
    layout = [[("model.w", (0, 0), (3, 5)), ("model.b", (0,), (2,))],
              [("model.w", (3, 0), (4, 5)), ("model.b", (2,), (4,))],
              [("model.w", (0, 0), (3, 5))]]
    path = save(tmp_path, 10, {"model.w": w, "model.b": b}, layout)
    r = ckpt.Reader(path)
    assert (r.step, r.world_size, r.meta["layout"]) == (10, 3, "test x3")
    assert r.keys() == ["model.b", "model.w"] and r.global_shape("model.w") == (7, 5)
    assert r.dtype("model.w") == torch.float64 and r.has("model.b") and not r.has("model.x")
    assert torch.equal(r.read("model.w"), w) and torch.equal(r.read("model.b"), b)
    for off in itertools.product(range(7), range(5)):
        for size in [(1, 1), (7 - off[0], 5 - off[1]), (min(2, 7 - off[0]), 5 - off[1])]:
            got = r.read("model.w", off, size)
            assert torch.equal(got, w[off[0]:off[0] + size[0], off[1]:off[1] + size[1]])
    assert r.read("model.w", dtype=torch.float32).dtype == torch.float32
    assert r.read("model.w", (2, 0), (0, 5)).shape == (0, 5)
    with pytest.raises(ckpt.CheckpointError, match="outside its global shape"):
        r.read("model.w", (5, 0), (3, 5))
    with pytest.raises(ckpt.CheckpointError, match="no tensor model.x"):
        r.read("model.x")


def test_reads_only_intersecting_slices(tmp_path, monkeypatch):
    w = torch.arange(80, dtype=torch.float32).view(8, 10)
    path = save(tmp_path, 1, {"model.w": w}, row_split("model.w", (8, 10), 4))
    r = ckpt.Reader(path)
    touched = []
    real_pread = r._pread

    def spy(file, start, n):   # every positioned read: which file, how many bytes
        touched.append((file, n))
        return real_pread(file, start, n)

    monkeypatch.setattr(r, "_pread", spy)
    assert torch.equal(r.read("model.w", (2, 3), (3, 4)), w[2:5, 3:7])   # rows 2..4: ranks 1 and 2
    # only the touched rows are read: rank 1 holds rows 2-3 (row 2..3 needed), rank 2 rows 4-5 (row 4)
    assert sorted(touched) == [("rank_00001.safetensors", 2 * 10 * 4), ("rank_00002.safetensors", 1 * 10 * 4)]
    touched.clear()
    assert torch.equal(r.read("model.w", (4, 0), (4, 10)), w[4:])         # exactly ranks 2 and 3: whole
    assert sorted(touched) == [("rank_00002.safetensors", 80), ("rank_00003.safetensors", 80)]


def test_dtypes_scalars_and_extras_roundtrip(tmp_path):
    tensors = {f"model.{n}": (torch.arange(12) % 7).to(d).view(3, 4) for n, d in
               [("f64", torch.float64), ("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16),
                ("i64", torch.int64), ("u8", torch.uint8)]}
    tensors["optim.f32.step"] = torch.tensor(7.0)
    layout = [[(k, (0,) * t.dim(), tuple(t.shape)) for k, t in tensors.items()]] * 2  # two replicas
    torch.manual_seed(5)
    extra = {r: ckpt.rng_tensors(torch.device("cpu")) for r in range(2)}
    expect = torch.rand(3)
    path = save(tmp_path, 3, tensors, layout, extra=extra)
    r = ckpt.Reader(path)
    for k, t in tensors.items():
        got = r.read(k)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k
    assert r.read("optim.f32.step").shape == ()
    assert ckpt.restore_rng({"rng.cpu": r.extra(1, "rng.cpu")}, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expect)
    assert r.extra(1, "rng.cuda") is None and r.extra(9, "rng.cpu") is None
    assert not ckpt.restore_rng({"rng.cpu": r.extra(9, "rng.cpu")}, torch.device("cpu"))
    assert r.verify_all() == len(tensors) * 2 + 2


def test_bad_pieces_are_refused(tmp_path):
    st = ckpt.prepare(tmp_path, 1)
    with pytest.raises(ValueError, match="does not fit"):
        ckpt.write_rank(st, 0, [ckpt.Piece("model.w", (4,), (3,), torch.ones(2))], {})
    with pytest.raises(ValueError, match="not supported"):
        ckpt.write_rank(st, 0, [ckpt.Piece("model.w", (2,), (0,), torch.ones(2, dtype=torch.complex64))], {})
    # a hole: nobody saved rows 2..3
    ckpt.write_rank(st, 0, [ckpt.Piece("model.w", (4,), (0,), torch.ones(2))], {})
    with pytest.raises(ckpt.CheckpointError, match=r"model.w: no rank saved the box at offsets \(2,\)"):
        ckpt.commit(tmp_path, 1, 1, {})
    # ranks that disagree on the global shape
    st = ckpt.prepare(tmp_path, 1)
    ckpt.write_rank(st, 0, [ckpt.Piece("model.w", (4,), (0,), torch.ones(4))], {})
    ckpt.write_rank(st, 1, [ckpt.Piece("model.w", (5,), (0,), torch.ones(5))], {})
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.json: model.w saved as float32 \\[5\\]"):
        ckpt.commit(tmp_path, 1, 2, {})
    with pytest.raises(ckpt.CheckpointError, match="rank_00002.json: missing: rank 2 did not finish"):
        ckpt.commit(tmp_path, 1, 3, {})
    assert ckpt.list_checkpoints(tmp_path) == []


def test_commit_replaces_prunes_and_cleans_staging(tmp_path):
    w = torch.arange(4.0)
    for step in (1, 2, 3):
        save(tmp_path, step, {"model.w": w + step}, [[("model.w", (0,), (4,))]], keep=2)
    ckpt.prepare(tmp_path, 9)  # a save that crashed: its staging dir is never listed, later removed
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    save(tmp_path, 3, {"model.w": w * 10}, [[("model.w", (0,), (2,))], [("model.w", (2,), (2,))]], keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003"]
    r = ckpt.Reader(ckpt.latest_valid(tmp_path))
    assert r.world_size == 2 and torch.equal(r.read("model.w"), w * 10)


# -- damage ------------------------------------------------------------------------------------

def _flip_data_byte(path: Path, name: str):
    """Flip one byte inside tensor ``name``'s data region of a safetensors file."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    raw[8 + n + (begin + end) // 2] ^= 0x55
    path.write_bytes(bytes(raw))


def test_damage_is_detected_and_named(tmp_path):
    w = torch.randn(6, 4)
    layout = row_split("model.w", (6, 4), 2)
    p1 = save(tmp_path, 1, {"model.w": w}, layout)
    p2 = save(tmp_path, 2, {"model.w": w}, layout)
    _flip_data_byte(p2 / "rank_00001.safetensors", "p0.model.w")
    r = ckpt.Reader(p2)  # sizes and headers are fine: opening is cheap and succeeds
    assert torch.equal(r.read("model.w", (0, 0), (3, 4)), w[:3])  # rank 0's piece is intact
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.safetensors: checksum mismatch.*re-save or use"):
        r.read("model.w")
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.safetensors: checksum mismatch"):
        r.verify_all()
    # truncation: found without reading data, and latest_valid falls back to step 1
    f = p2 / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(ckpt.CheckpointError, match="rank_00000.safetensors: .* bytes, index.json records"):
        ckpt.Reader(p2)
    warned = []
    assert ckpt.latest_valid(tmp_path, warn=warned.append) == p1
    assert "step_00000002" in warned[0] and "rank_00000.safetensors" in warned[0]
    (p1 / "index.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="index.json: missing \\(incomplete checkpoint"):
        ckpt.Reader(p1)
    assert ckpt.latest_valid(tmp_path, warn=warned.append) is None


def test_read_into_fills_in_place_checks_crc_and_respects_wrappers(tmp_path, monkeypatch):
    """``read_into``: a whole piece is read straight into the target in chunks, its crc32 taken
    chunk by chunk (CHUNK shrunk so the piece spans several); a box that is not one piece, a
    dtype or layout that differs, goes through ``read``; a flipped byte is refused; a wrapping
    reader (``__getattr__`` forwarding) is read through its own ``read`` by ``state.fill``."""
    from shardlab.checkpoint import pieces as state
    from shardlab.checkpoint import reader as ckpt_reader
    monkeypatch.setattr(ckpt_reader, "CHUNK", 40)
    w = torch.randn(6, 5, dtype=torch.float64)
    path = save(tmp_path, 1, {"model.w": w}, row_split("model.w", (6, 5), 2))
    r = ckpt.Reader(path)
    out = torch.full((3, 5), float("nan"), dtype=torch.float64)
    r.read_into("model.w", (3, 0), (3, 5), out)  # rank 1's piece whole: the fast path
    assert torch.equal(out, w[3:])
    part = torch.zeros(2, 5, dtype=torch.float32)  # another box and dtype: through read()
    r.read_into("model.w", (2, 0), (2, 5), part)
    assert torch.equal(part, w[2:4].float())
    _flip_data_byte(path / "rank_00001.safetensors", "p0.model.w")
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.safetensors: checksum mismatch"):
        ckpt.Reader(path).read_into("model.w", (3, 0), (3, 5), out)

    class Doubling:  # a wrapper like models/pretrained.MergedLoRA: changes what read returns
        def __init__(self, reader):
            self.reader = reader

        def __getattr__(self, name):
            return getattr(self.reader, name)

        def read(self, key, offsets=None, sizes=None, dtype=None):
            return 2 * self.reader.read(key, offsets, sizes, dtype)
    good = save(tmp_path / "b", 1, {"model.w": w}, row_split("model.w", (6, 5), 2))
    state.fill(Doubling(ckpt.Reader(good)), "model.w", (0, 0), (3, 5), out)
    assert torch.equal(out, 2 * w[:3])


def test_damaged_index_and_header_are_named(tmp_path):
    w = torch.randn(4, 2)
    path = save(tmp_path, 1, {"model.w": w}, row_split("model.w", (4, 2), 2))
    index = path / "index.json"
    good = index.read_text()
    for bad in ["{not json", '{"step": 1}', good.replace('"keys": {', '"keys": {"model.x": 3, ', 1)]:
        index.write_text(bad)
        with pytest.raises(ckpt.CheckpointError, match="index.json: damaged"):
            ckpt.Reader(path)
    index.write_text(good)
    f = path / "rank_00001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[9] ^= 0x20  # inside the JSON header: the header no longer parses or no longer matches
    f.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="rank_00001.safetensors"):
        ckpt.Reader(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pieces_and_rng(tmp_path):
    dev = torch.device("cuda", 0)
    w = torch.randn(6, 3, device=dev)
    staging = ckpt.prepare(tmp_path, 1)
    torch.cuda.manual_seed(3)
    rng = ckpt.rng_tensors(dev)
    expect = torch.rand(4, device=dev)
    for r in range(2):
        ckpt.write_rank(staging, r, [ckpt.Piece("model.w", (6, 3), (3 * r, 0), w[3 * r:3 * r + 3])], rng)
    r = ckpt.Reader(ckpt.commit(tmp_path, 1, 2, {}))
    assert torch.equal(r.read("model.w").to(dev), w) and sorted(r.rank_files()[1]["extra"]) == ["rng.cpu", "rng.cuda"]
    assert ckpt.restore_rng({n: r.extra(1, n) for n in ("rng.cpu", "rng.cuda")}, dev)
    assert torch.equal(torch.rand(4, device=dev), expect)


def _cli(*args):
    """The real entry point in a subprocess: exit code, stderr, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "shardlab.cli", "checkpoint", *map(str, args)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    return res.returncode, res.stderr


def _main(capsys, *args):
    """The same through cli.main in this process (cheaper than a subprocess)."""
    from shardlab.cli import main
    capsys.readouterr()
    rc = main(["checkpoint", *map(str, args)])
    return rc, capsys.readouterr().err


def _assert_refused(res, *needles):
    rc, err = res
    assert rc == 2, res
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_refuses_bad_checkpoints(tmp_path, capsys):
    w = torch.randn(6, 4)
    path = save(tmp_path / "ck", 4, {"model.w": w}, row_split("model.w", (6, 4), 2))
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    # a flipped data byte: verify and export name the file; --to is not touched
    _flip_data_byte(path / "rank_00001.safetensors", "p0.model.w")
    _assert_refused(_cli("verify", path), "rank_00001.safetensors", "re-save or use an older checkpoint")
    _assert_refused(_main(capsys, "export", path, "--to", out, "--force"), "rank_00001.safetensors", "checksum")
    assert out.read_bytes() == b"keep me" and not list(tmp_path.glob(".out*"))
    # truncated shard
    f = path / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:-5])
    _assert_refused(_main(capsys, "inspect", path), "rank_00000.safetensors", "truncated")
    # index.json missing
    (path / "index.json").unlink()
    _assert_refused(_cli("verify", path), str(path / "index.json"), "incomplete checkpoint")
    _assert_refused(_main(capsys, "inspect", tmp_path / "ck"), "no valid checkpoint in", "incomplete checkpoint")
    _assert_refused(_main(capsys, "export", path, "--to", out), "exists; pass --force")
    _assert_refused(_main(capsys, "verify", tmp_path / "nope"), "does not exist")
    assert out.read_bytes() == b"keep me"


def test_cli_export_hf_keeps_a_directory_it_was_not_given_empty(tmp_path, capsys):
    """--format hf into a directory holding anything (a user's config.json, ...) is refused before
    a byte is written; a flag the action would ignore is refused by name."""
    path = save(tmp_path / "ck", 4, {"model.w": torch.randn(6, 4)}, row_split("model.w", (6, 4), 2))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("mine")
    _assert_refused(_main(capsys, "export", path, "--to", out, "--format", "hf"), "is not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "mine"
    _assert_refused(_main(capsys, "export", path, "--to", out / "config.json", "--format", "hf"), "is a file")
    _assert_refused(_main(capsys, "inspect", path, "--to", out), "--to", "not to inspect")
    _assert_refused(_main(capsys, "verify", path, "--merge-lora"), "--merge-lora", "not to verify")


def test_export_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    """The exports' writer draws a bar of the bytes written when stderr is a terminal, nothing when
    it is not (logs, pipes), and never for a rank's checkpoint file (no label)."""
    import io
    import sys

    from shardlab.checkpoint.format import SafetensorsWriter

    class Terminal(io.StringIO):
        def __init__(self, tty):
            super().__init__()
            self.tty = tty

        def isatty(self):
            return self.tty

    for tty, label, shown in ((True, "export", True), (False, "export", False), (True, "", False)):
        err = Terminal(tty)
        monkeypatch.setattr(sys, "stderr", err)
        w = SafetensorsWriter(tmp_path / "x.safetensors", [("w", torch.float32, (256, 4))], progress=label)
        w.write("w", torch.ones(128, 4), last=False)
        w.write("w", torch.ones(128, 4))
        w.close()
        out = err.getvalue()
        assert ("export:" in out and "/4.00k" in out) == shown and (out == "") != shown, (tty, label, out)
