"""Parameter bytes per pipeline rank: DualPipe (two stages per rank, a copy each) vs 1F1B.

    PYTHONPATH=. python benchmarks/dualpipe_memory.py

Counts the bytes of the parameters each rank keeps after ``pipeline.stage.split_model`` (the
function the engine uses), fp32, for the benchmark model of benchmarks/pipeline.py and a larger
one. No processes are started: the split is the same on every rank whatever the launch.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab.config import Config  # noqa: E402
from shardlab.models import get_spec  # noqa: E402
from shardlab.models.spec import meta_model  # noqa: E402
from shardlab.parallel.pipeline.schedule import build  # noqa: E402
from shardlab.parallel.pipeline.stage import split_model  # noqa: E402

MODELS = {"d128 L8 V256": (256, 128, 8, 4), "d512 L16 V8192": (8192, 512, 16, 8)}


def rank_bytes(dims, pp: int, schedule: str) -> list[int]:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads = dims
    m.tie_embeddings = False  # as pipeline parallelism requires
    out = []
    for r in range(pp):
        model = meta_model(m)  # shapes only: the split does not need values
        if schedule == "dualpipe":
            sched = build("dualpipe", pp, 2 * pp)
            model, _, _ = split_model(model, get_spec(m), r, pp, 2, owner=sched.rank_of, dual=True)
        else:
            model, _, _ = split_model(model, get_spec(m), r, pp)
        out.append(sum(p.numel() * p.element_size() for p in model.parameters()))
    return out


def main():
    print("| model | pp | 1f1b MiB per rank (max) | dualpipe MiB per rank (max) | ratio | whole model MiB |")
    print("|---|---|---|---|---|---|")
    for name, dims in MODELS.items():
        for pp in (2, 4):
            a, b = rank_bytes(dims, pp, "1f1b"), rank_bytes(dims, pp, "dualpipe")
            print(f"| {name} | {pp} | {max(a) / 2**20:.2f} | {max(b) / 2**20:.2f} | {max(b) / max(a):.2f}x "
                  f"| {sum(a) / 2**20:.2f} |")


if __name__ == "__main__":
    main()
