"""Helpers shared by benchmarks/init_memory.py and benchmarks/checkpoint.py: per-process peak
RSS, building an engine on the meta path or the full-build path, one training step.

Peak RSS. ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is max(peak RSS of this process image,
peak RSS of the parent at spawn time): multiprocessing's spawn starts a rank with vfork + exec,
and Linux folds the parent's high-water mark into the child's ``ru_maxrss`` at exec (checked:
a parent holding 1 GB gives a fresh child ``ru_maxrss`` = 1012 MiB before it allocated
anything). So we read the same counter from ``/proc/self/status`` (``VmHWM``, the peak RSS of
this process image only) and also report ``ru_maxrss``; ``reset_peak()`` resets ``VmHWM`` to
the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) so that one process can
measure several phases one after the other.
"""
from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

from shardlab.analysis.memtrace import reset_peak_rss as reset_peak  # noqa: F401 (True if VmHWM was reset)

MiB = 2**20


def write_table(out: str | None, *blocks: str) -> None:
    """Write the command line and the printed blocks (header, table, notes) to ``out`` (.md)."""
    if out:
        import sys
        with open(out, "w") as fh:
            fh.write("\n\n".join([f"`python {' '.join(sys.argv)}`", *blocks]) + "\n")
        print(f"wrote {out}")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_mib() -> float:
    """Peak RSS of this process image (VmHWM), MiB."""
    return _status_kib("VmHWM") / 1024


def rss_mib() -> float:
    """Current RSS, MiB."""
    return _status_kib("VmRSS") / 1024


def ru_maxrss_mib() -> float:
    """``ru_maxrss`` (KiB on Linux), MiB: includes the spawning parent's peak (module doc)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_engine(cfg, device, path: str):
    """(mesh, engine, optimizer). ``path``: "meta" (meta build, each rank materialises what it
    owns) or "full-build" (the whole model materialised on the rank, then ``parallelize``)."""
    from shardlab.distributed.mesh import Mesh
    from shardlab.distributed.topology import Topology
    from shardlab.models import build_model, meta_model
    from shardlab.parallelize import parallelize

    mesh = Mesh.build(Topology.from_config(cfg.parallel), device)
    if path == "meta":
        model = meta_model(cfg.model, torch.float32)
    elif path == "full-build":
        model = build_model(cfg.model, cfg.train.seed, dtype=torch.float32)
    else:
        raise ValueError(f"path must be meta or full-build, got {path!r}")
    engine = parallelize(model, mesh, cfg)
    del model
    opt = engine.make_optimizer(lambda groups: torch.optim.AdamW(groups, lr=cfg.train.lr))
    return mesh, engine, opt


def micro_batches(cfg, rank: int, micro: int, seq: int, step: int = 0):
    """``cfg.parallel.microbatches`` random (tokens, targets) pairs of shape (micro, seq)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(cfg.parallel.microbatches):
        tok = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def train_step(cfg, mesh, engine, opt, micro: int, seq: int, step: int = 0) -> None:
    engine.forward_backward(micro_batches(cfg, mesh.rank, micro, seq, step))
    opt.step()
    opt.zero_grad()


def timed(fn) -> float:
    """Wall seconds of ``fn()`` on the slowest rank, with barriers before and after."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def max_over_ranks(x: float) -> float:
    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
