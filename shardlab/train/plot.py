"""``shardlab plot RUN_DIR [RUN_DIR ...]``: training and validation loss curves to
``RUN_DIR/loss.png``, or several runs' in one picture (a layout against another)."""
from __future__ import annotations

import sys
from pathlib import Path

from .metrics import read_metrics


def _curves(run_dir: Path):
    """(train points, validation points, the last start record) of a run; unreadable lines said once."""
    skipped: list = []
    recs = read_metrics(run_dir, skipped)
    if skipped:
        print(f"shardlab plot: {run_dir / 'metrics.jsonl'}: left out {len(skipped)} unreadable line(s) "
              f"(line {', '.join(map(str, skipped[:3]))}: a record cut off by a killed run)", file=sys.stderr)
    train = [(r["step"], r["loss"]) for r in recs if r.get("kind") == "train" and "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in recs if r.get("kind") == "val" and "val_loss" in r]
    return train, val, next((r for r in reversed(recs) if r.get("kind") == "start"), {})


def plot_runs(run_dirs, out: str | Path | None = None) -> Path:
    """One picture of the runs' loss curves: train (line) and validation (dots) per run, and the
    unigram baseline of a single run. ``out`` defaults to the only run's ``loss.png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(d) for d in run_dirs]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run_dir in enumerate(run_dirs):
        train, val, start = _curves(run_dir)
        name = "" if len(run_dirs) == 1 else f"{run_dir.name} ({start.get('layout', '?')}): "
        color = f"C{i}" if len(run_dirs) > 1 else None
        if train:
            ax.plot(*zip(*train), color=color, label=f"{name}train loss")
        if val:
            ax.plot(*zip(*val), "o-" if len(run_dirs) == 1 else "o--", color=color if color else "C1",
                    label=f"{name}validation loss")
        if len(run_dirs) == 1 and start.get("unigram_baseline"):
            ax.axhline(start["unigram_baseline"], ls="--", c="gray", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{run_dirs[0].name}: {start.get('layout', '')}" if len(run_dirs) == 1
                 else f"{len(run_dirs)} runs")
    ax.legend(fontsize=8 if len(run_dirs) > 1 else None)
    ax.grid(alpha=0.3)
    out = Path(out) if out else run_dirs[0] / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """``RUN_DIR/loss.png`` (or ``out``) of one run."""
    return plot_runs([run_dir], out)
