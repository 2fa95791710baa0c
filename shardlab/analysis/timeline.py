"""Draw pipeline timelines (simulated or measured): text for the terminal, PNG via matplotlib.

A timeline is ``timeline[r] = [(action, start, end), ...]`` per pipeline rank, where
``action`` has ``kind`` (F, B or W), ``mb`` and ``stage`` (see parallel/pipeline/schedule.py).
"""
from __future__ import annotations

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2"}


def render_text(timeline, unit: float | None = None, cell: int = 3, max_cols: int = 160) -> str:
    """One row per rank; each column is ``unit`` of time, ``cell`` characters wide. A column
    shows the action running at its middle ("F3" = forward of micro-batch 3), '.' when idle.
    Chunks of an interleaved rank after the first are shown in lower case."""
    spans = [(a, s, e) for tl in timeline for a, s, e in tl]
    if not spans:
        return "(empty timeline)"
    t0 = min(s for _, s, _ in spans)
    end = max(e for _, _, e in spans)
    if unit is None:
        unit = min(e - s for _, s, e in spans) or (end - t0) / 100
    cols = int(round((end - t0) / unit))
    if cols * cell > max_cols:  # too wide: one character per column, coarser columns
        cell, cols = 1, min(cols, max_cols)
        unit = (end - t0) / cols
    p = len(timeline)
    lines = []
    for r, tl in enumerate(timeline):
        row, last = [], None
        for c in range(cols):
            mid = t0 + (c + 0.5) * unit
            hit = next((a for a, s, e in tl if s <= mid < e), None)
            if hit is None:
                row.append("." * cell)
                last = None
                continue
            kind = hit.kind if hit.stage < p else hit.kind.lower()
            label = f"{kind}{hit.mb}" if cell > 1 else kind
            row.append((label if hit is not last else "-" * len(label))[:cell].ljust(cell))
            last = hit
        lines.append(f"rank {r} |" + "".join(row) + "|")
    return "\n".join(lines)


def _draw(ax, timeline, title: str, legend: bool = True):
    import matplotlib.pyplot as plt

    p = len(timeline)
    spans = [(a, s, e) for tl in timeline for a, s, e in tl]
    t0 = min(s for _, s, _ in spans) if spans else 0.0
    width = (max(e for _, _, e in spans) - t0) if spans else 1.0
    for r, tl in enumerate(timeline):
        for a, s, e in tl:
            chunk = a.stage // p
            ax.broken_barh([(s - t0, e - s)], (p - 1 - r - 0.4, 0.8), facecolors=COLORS.get(a.kind, "gray"),
                           edgecolor="white", linewidth=0.5, alpha=1.0 - 0.35 * (chunk % 2))
            if (e - s) > 0.012 * width:
                ax.text(s - t0 + (e - s) / 2, p - 1 - r, f"{a.kind}{a.mb}", ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))])
    if legend:
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
        ax.legend(handles, ["F forward", "B backward (input grad if split)", "W weight grad"],
                  loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10, loc="left")


def plot(timeline, path: str, title: str = "") -> str:
    """Save a Gantt chart of the timeline as a PNG; returns the path. Lighter bars: the
    second (odd) chunk of an interleaved rank."""
    return plot_grid([(timeline, title)], path)


def plot_grid(items, path: str) -> str:
    """Several timelines ``[(timeline, title), ...]`` stacked on one time axis, one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [0.6 * len(tl) + 0.9 for tl, _ in items]
    fig, axes = plt.subplots(len(items), 1, figsize=(12, sum(heights) + 0.6), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for i, (ax, (tl, title)) in enumerate(zip(axes[:, 0], items)):
        _draw(ax, tl, title, legend=(i == 0))
    axes[-1, 0].set_xlabel("time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measured_bubble(timeline) -> float:
    """1 - busy / (ranks * span), from measured (action, start, end) spans on a shared clock."""
    spans = [(s, e) for tl in timeline for _, s, e in tl]
    if not spans:
        return 0.0
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    return 1.0 - sum(e - s for s, e in spans) / (len(timeline) * span)
