"""Sharded checkpoint save/load: shardlab's format vs torch.distributed.checkpoint (DCP), same state.

    PYTHONPATH=. python benchmarks/checkpoint.py --config configs/llama-350m.toml \\
        --nproc-list 1 2 4 --out benchmarks/results/checkpoint.md
    PYTHONPATH=. python benchmarks/checkpoint.py --mode blocking --nproc-list 2 --rounds 3

``--mode blocking``: how long the training loop is blocked per save, blocking saves vs
``checkpoint.async_save`` (``_blocking_worker``), on the same state in the same ranks.

For each N: N fresh spawned ranks build the model (meta build) under FSDP (zero_stage 3,
dp_shard = N), run one training step (micro-batch 1 x ``--seq`` tokens, AdamW: the Adam state
exists), then, one after the other in the same processes: save with shardlab
(``ckpt.prepare / write_rank / commit``, the Trainer's sequence), save with DCP
(``dcp.save``), load with shardlab (``engine.load_pieces(ckpt.Reader(path), opt)``), load with
DCP (``dcp.load`` in place). DCP gets exactly the tensors shardlab writes: this rank's
``engine.state_pieces(opt)`` keyed ``<key>@<offsets>`` (unique per box, so each rank saves its
own data) plus its RNG state keyed ``rng.cpu@rank<r>``; both write with fsync.

Measured: wall time of each phase on the slowest rank (barriers before and after), bytes
written (sum of the file sizes under each checkpoint directory), and the peak RSS increase of
each phase: the rank's peak RSS (VmHWM) is reset to its current RSS before the phase
(``/proc/self/clear_refs``; see benchmarks/_ranks.py) and the increase is peak - RSS before, max
over ranks. Memory-mapped checkpoint pages that a load touches count as RSS. Before each load
the state is zeroed in place; after it every box is compared (crc32 of its bytes) with what was
saved, and the RNG tensors with the saved ones: "ok" in the table. The loads read files the saves
have just written (page cache warm for both). Temp dirs under /tmp, removed at the end.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _ranks  # noqa: E402
from shardlab.config import load  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check validate runs)
from shardlab.launch import run  # noqa: E402
from shardlab.models import count_params, meta_model  # noqa: E402

MiB = _ranks.MiB
STEP = 1


def fsdp_cfg(path, overrides, n: int, seq: int):
    cfg = load(path, overrides)
    cfg.parallel.dp_shard, cfg.parallel.zero_stage = n, 3
    cfg.train.seq_len = seq
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq)
    cfg.train.global_batch = n
    return cfg.validate(world_size=n)


def _crcs(pieces) -> dict:
    from shardlab.checkpoint.format import crc32
    return {(p.key, tuple(p.offsets)): crc32(p.tensor) for p in pieces}


def _dcp_dict(pieces, rng: dict, rank: int) -> dict:
    sd = {f"{p.key}@{','.join(map(str, p.offsets))}": p.tensor for p in pieces}
    sd.update({f"{k}@rank{rank}": v for k, v in rng.items()})
    return sd


def _zero(pieces) -> None:
    with torch.no_grad():
        for p in pieces:
            p.tensor.zero_()


def _phase(fn) -> tuple[float, float]:
    """(seconds on the slowest rank, peak RSS increase MiB, max over ranks)."""
    gc.collect()
    _ranks.reset_peak()
    before = _ranks.rss_mib()
    t = _ranks.timed(fn)
    return t, _ranks.max_over_ranks(_ranks.peak_mib() - before)


def _worker(ctx, cfg, root: str, seq: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from shardlab.checkpoint import save as ckpt

    rank, world = ctx.rank, ctx.world_size
    mesh, engine, opt = _ranks.build_engine(cfg, ctx.device, "meta")
    _ranks.train_step(cfg, mesh, engine, opt, 1, seq)
    pieces = engine.state_pieces(opt)
    rng = ckpt.rng_tensors(ctx.device)
    saved = _crcs(pieces)
    saved_rng = {k: v.clone() for k, v in rng.items()}
    ours_dir, dcp_dir = Path(root) / "ours", Path(root) / "dcp"
    published = {}
    can_reset = _ranks.reset_peak()

    def save_ours():
        if rank == 0:
            ckpt.prepare(ours_dir, STEP)
        dist.barrier()
        ckpt.write_rank(ckpt.staging_dir(ours_dir, STEP), rank, pieces, rng)
        dist.barrier()
        if rank == 0:
            ckpt.commit(ours_dir, STEP, world, {"world_size": world}, keep=1)
        dist.barrier()
        published["path"] = ckpt.list_checkpoints(ours_dir)[-1]

    def save_dcp():
        dcp.save(_dcp_dict(pieces, rng, rank), checkpoint_id=str(dcp_dir))

    out = {"save ours": _phase(save_ours), "save dcp": _phase(save_dcp)}
    del pieces  # views of the state: our load replaces the Adam buffers

    # -- load with shardlab: zero the state in place, read this rank's boxes, compare ---------------
    _zero(engine.state_pieces(opt))

    def load_ours():
        with ckpt.Reader(published["path"]) as reader:
            engine.load_pieces(reader, opt)
            published["rng"] = {k: reader.extra(rank, k) for k in saved_rng}

    out["load ours"] = _phase(load_ours)
    ok_ours = _crcs(engine.state_pieces(opt)) == saved and \
        all(torch.equal(published["rng"][k], v) for k, v in saved_rng.items())

    # -- load with DCP: the same boxes, zeroed, filled in place -----------------------------------
    pieces = engine.state_pieces(opt)
    _zero(pieces)
    target = _dcp_dict(pieces, {k: torch.zeros_like(v) for k, v in saved_rng.items()}, rank)

    def load_dcp():
        dcp.load(target, checkpoint_id=str(dcp_dir))

    out["load dcp"] = _phase(load_dcp)
    ok_dcp = _crcs(engine.state_pieces(opt)) == saved and \
        all(torch.equal(target[f"{k}@rank{rank}"], v) for k, v in saved_rng.items())
    ok = torch.tensor([int(ok_ours), int(ok_dcp)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    out["ok ours"], out["ok dcp"] = bool(ok[0]), bool(ok[1])
    out["reset"] = can_reset
    out["state MiB"] = _ranks.max_over_ranks(sum(p.tensor.numel() * p.tensor.element_size() for p in pieces) / MiB)
    return out


def _blocking_worker(ctx, cfg, root: str, seq: int, rounds: int) -> dict:
    """Blocking time per save, sync vs async, the Trainer's call (``ckpt.save``) on the same state:
    each round saves blocking, then asynchronously (timed until ``save`` returns), then waits
    for the background write (``finish_saves``, timed apart), then one training step."""
    from shardlab.checkpoint import async_save, save as ckpt

    mesh, engine, opt = _ranks.build_engine(cfg, ctx.device, "meta")
    _ranks.train_step(cfg, mesh, engine, opt, 1, seq)
    pieces = lambda: engine.state_pieces(opt)  # noqa: E731
    meta = lambda: {"world_size": ctx.world_size}  # noqa: E731
    out = {"sync": [], "async": [], "background": [], "rss": []}
    for i in range(rounds):
        step = i + 1
        out["sync"].append(_ranks.timed(lambda: ckpt.save(Path(root) / "sync", step, mesh, pieces, meta,
                                                          ctx.device, keep=1)))
        out["async"].append(_ranks.timed(lambda: async_save.save(Path(root) / "async", step, mesh, pieces, meta,
                                                                 ctx.device, keep=1)))
        out["background"].append(_ranks.timed(lambda: ckpt.finish_saves(mesh)))
        out["rss"].append(_ranks.max_over_ranks(_ranks.rss_mib()))
        _ranks.train_step(cfg, mesh, engine, opt, 1, seq, step=step)
    out["state MiB"] = _ranks.max_over_ranks(sum(p.tensor.numel() * p.tensor.element_size()
                                                 for p in pieces()) / MiB)
    # the floor: one copy of the same pieces into buffers that exist (what the async save must do)
    src = [p.tensor for p in pieces()]
    dst = [torch.empty_like(t) for t in src]
    for d, t in zip(dst, src):
        d.copy_(t)  # first touch of the buffers, not timed (the async save reuses its buffers too)
    out["copy"] = _ranks.timed(lambda: [d.copy_(t) for d, t in zip(dst, src)])
    del dst
    a, b = (Path(root) / d / f"step_{rounds:08d}" for d in ("sync", "async"))
    same = all((a / f.name).read_bytes() == f.read_bytes() for f in b.iterdir() if f.suffix == ".safetensors")
    ok = torch.tensor([int(same)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    out["same files"] = bool(ok)
    return out


def blocking(args, overrides, head: str) -> None:
    """--mode blocking: the table of blocking time per save, sync vs async."""
    n = args.nproc_list[0]
    cfg = fsdp_cfg(args.config, overrides, n, args.seq)
    root = Path(tempfile.mkdtemp(prefix="shardlab-ckpt-bench-", dir="/tmp"))
    try:
        res = run(_blocking_worker, n, cfg, str(root), args.seq, args.rounds, threads=1, timeout_s=args.timeout)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [f"N = {n} ranks, state per rank {res['state MiB']:.0f} MiB; blocking = wall time of the save call "
             "on the slowest rank (barriers around it); background = the rest of the async save (finish_saves)",
             "| save | sync blocking s | async blocking s | async / sync | async background s | RSS after, max rank MiB |",
             "|---:|---:|---:|---:|---:|---:|"]
    for i, (s, a, b, r) in enumerate(zip(res["sync"], res["async"], res["background"], res["rss"])):
        lines.append(f"| {i + 1}{' (first: host buffers allocated)' if i == 0 else ''} | {s:.2f} | {a:.2f} | "
                     f"{a / s:.1%} | {b:.2f} | {r:.0f} |")
    later = slice(1, None) if len(res["sync"]) > 1 else slice(None)
    ms, ma = (sum(res[k][later]) / len(res[k][later]) for k in ("sync", "async"))
    lines.append(f"| mean{' of saves 2..' if len(res['sync']) > 1 else ''} | {ms:.2f} | {ma:.2f} | {ma / ms:.1%} | | |")
    lines.append("")
    lines.append(f"one copy of the same state into existing host buffers (slowest rank): {res['copy']:.2f} s; "
                 f"async blocking (mean of saves 2..) / that copy: {ma / res['copy']:.2f}x")
    lines.append(f"last checkpoint's data files byte-identical sync vs async: {'yes' if res['same files'] else 'NO'}")
    table = "\n".join(lines)
    print()
    print(table)
    _ranks.write_table(args.out, head, table)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-350m.toml")
    ap.add_argument("--nproc-list", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence of the one training step")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per launch, seconds")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    ap.add_argument("--mode", choices=("formats", "blocking"), default="formats",
                    help="formats: shardlab vs DCP save/load; blocking: blocking time per save, sync vs "
                         "checkpoint.async_save (first of --nproc-list ranks, --rounds saves)")
    ap.add_argument("--rounds", type=int, default=3, help="--mode blocking: saves of each kind")
    args, overrides = ap.parse_known_args()
    psi = count_params(meta_model(load(args.config, overrides).model))
    if args.mode == "blocking":
        return blocking(args, overrides, f"model: {args.config} {' '.join(overrides)}: {psi:,} parameters; FSDP "
                        f"(zero_stage 3) after one AdamW step; fp32 state = {12 * psi / MiB:.0f} MiB in all")
    head = (f"model: {args.config} {' '.join(overrides)}: {psi:,} parameters; FSDP (zero_stage 3, dp_shard = N) "
            f"after one AdamW step (micro-batch 1 x {args.seq}); fp32 state = params + exp_avg + exp_avg_sq "
            f"= {12 * psi / MiB:.0f} MiB")
    print(head, flush=True)
    lines = ["| N | method | save s | load s | MiB written | peak RSS increase save MiB | "
             "peak RSS increase load MiB | load correct | ratio ours/DCP (save, load, MiB) |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    notes = []
    for n in args.nproc_list:
        cfg = fsdp_cfg(args.config, overrides, n, args.seq)
        root = Path(tempfile.mkdtemp(prefix="shardlab-ckpt-bench-", dir="/tmp"))
        try:
            res = run(_worker, n, cfg, str(root), args.seq, threads=1, timeout_s=args.timeout)[0]
            size = {m: _dir_bytes(root / m) / MiB for m in ("ours", "dcp")}
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if not res["reset"]:
            notes.append(f"N={n}: /proc/self/clear_refs refused: peaks are cumulative over the phases")
        row = {}
        for m, name in (("ours", "shardlab"), ("dcp", "DCP")):
            row[m] = (res[f"save {m}"][0], res[f"load {m}"][0], size[m], res[f"save {m}"][1], res[f"load {m}"][1])
        o, d = row["ours"], row["dcp"]
        ratio = f"{o[0] / d[0]:.2f}, {o[1] / d[1]:.2f}, {o[2] / d[2]:.3f}"
        for m, name in (("ours", "shardlab"), ("dcp", "DCP")):
            s, l_, mib, ps, pl = row[m]
            lines.append(f"| {n} | {name} | {s:.2f} | {l_:.2f} | {mib:.1f} | {ps:.0f} | {pl:.0f} | "
                         f"{'ok' if res[f'ok {m}'] else 'MISMATCH'} | {ratio if m == 'ours' else ''} |")
        print(f"  N={n}: state per rank {res['state MiB']:.0f} MiB; " + "; ".join(
            f"{m}: save {row[m][0]:.2f}s load {row[m][1]:.2f}s" for m in row), flush=True)
    table = "\n".join(lines + [""] + notes)
    print()
    print(table)
    _ranks.write_table(args.out, head, table)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
