"""``shardlab plot RUN_DIR``: training and validation loss curves to ``RUN_DIR/loss.png``."""
from __future__ import annotations

from pathlib import Path

from .metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in recs if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in recs if r.get("kind") == "val"]
    start = next((r for r in reversed(recs) if r.get("kind") == "start"), {})
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    if start.get("unigram_baseline"):
        ax.axhline(start["unigram_baseline"], ls="--", c="gray", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{run_dir.name}: {start.get('layout', '')}")
    ax.legend()
    ax.grid(alpha=0.3)
    out = Path(out) if out else run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
