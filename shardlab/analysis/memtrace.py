"""Memory over one training step, as the user meets it: a :class:`Trace` per rank (the resident
set on CPU, ``max_memory_allocated`` / reserved on CUDA, sampled by a thread; phase marks with the
model-state categories) and :func:`draw`, the picture of all ranks (docs/data-parallel.md, "The
timeline")."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
SPLIT = ("RssAnon", "RssFile", "RssShmem")
"""The resident set's parts in /proc/self/status: heap (anonymous), libraries (file-backed), shared memory."""


def proc_status() -> dict[str, int]:
    """Bytes of the resident-set fields of ``/proc/self/status`` (Linux; {} elsewhere)."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, val = line.partition(":")
                if key in _FIELDS:
                    out[key] = int(val.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Start the kernel's peak-RSS counter (VmHWM, and with it ``ru_maxrss``) afresh at the
    current RSS (Linux >= 4.0, ``/proc/self/clear_refs`` "5"), so a peak read later is what ran
    since, not a warm-up's before it; False where the kernel refuses (peaks are then cumulative)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def current_bytes(device: torch.device) -> int:
    """What the rank holds now: RSS on CPU, allocated bytes on CUDA."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return proc_status().get("VmRSS", 0)


@dataclass
class Trace:
    """One rank's samples and phase marks (seconds from the start of the trace)."""

    rank: int = 0
    device: str = "cpu"
    samples: list = field(default_factory=list)
    marks: list = field(default_factory=list)
    state: list = field(default_factory=list)
    """At each mark: (seconds, params, grads, optim) bytes of model state."""
    baseline: int = 0
    """Bytes of the empty rank (torch imported, process groups up) before the model is built."""
    peak: int = 0
    """CPU: VmHWM at the end (the whole run's peak RSS); CUDA: max_memory_allocated."""
    reserved: int = 0
    """CUDA: max_memory_reserved (0 on CPU)."""
    split: dict = field(default_factory=dict)
    """CPU: RssAnon / RssFile / RssShmem at the end."""
    baseline_split: dict = field(default_factory=dict)
    """CPU: RssAnon / RssFile / RssShmem of the empty rank (with ``baseline``)."""
    categories: dict = field(default_factory=dict)
    """With profiling: bytes per torch.profiler category at the last step's allocation peak."""


class Recorder:
    """Samples the rank's memory in a background thread while it runs ``with recorder:``."""

    def __init__(self, device: torch.device, rank: int = 0, interval_s: float = 0.002):
        self.device, self.interval_s = torch.device(device), interval_s
        self.trace = Trace(rank=rank, device=self.device.type)
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.device.type == "cpu":  # one read: the baseline and its parts at the same moment
            st = proc_status()
            self.trace.baseline = st.get("VmRSS", 0)
            self.trace.baseline_split = {k: st.get(k, 0) for k in SPLIT}
        else:
            self.trace.baseline = current_bytes(self.device)

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self):
        self.trace.samples.append((time.perf_counter() - self._t0, current_bytes(self.device)))

    def mark(self, name: str, state=None):
        """A phase starts now; ``state``: a StateBytes of the model state at this moment."""
        now = time.perf_counter() - self._t0
        self.sample()
        self.trace.marks.append((now, name))
        if state is not None:
            self.trace.state.append((now, state.params, state.grads, state.optim))

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.mark("end")
        if self.device.type == "cuda":
            self.trace.peak = torch.cuda.max_memory_allocated(self.device)
            self.trace.reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            st = proc_status()
            # the kernel's counters lag a little (per-thread batching): the larger of both
            self.trace.peak = max([st.get("VmHWM", 0)] + [b for _, b in self.trace.samples])
            self.trace.split = {k: st.get(k, 0) for k in SPLIT}
        return False


CATEGORIES = ("parameters", "optimizer states", "inputs", "temporaries", "activations", "gradients",
              "autograd detail", "unknown")
"""torch.profiler's memory categories, in the order of ``MemoryProfileTimeline``'s size rows."""


def profiled(enabled: bool):
    """A torch.profiler context recording allocations with what its memory profile needs (or a
    no-op context); pass it to :func:`categories_at_peak` afterwards."""
    from contextlib import nullcontext
    if not enabled:
        return nullcontext()
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True)


def categories_at_peak(prof, device: torch.device) -> dict[str, int]:
    """Bytes per category (torch.profiler's memory profile: parameters, optimizer states, inputs,
    temporaries, activations, gradients, autograd detail, unknown) at the moment the profiled
    tensors' total peaked, plus ``allocated`` (that total). Tensors alive before profiling began
    count as 'pre-existing' in their category. Storages made outside the allocator (the
    shared-memory arena) are not tensors' allocations and are absent."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    dev = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(dev)
    best, at = -1, []
    for row in sizes:  # row[0] is unused; row[i + 1]: bytes of category i live at that time
        if sum(row[1:]) > best:
            best, at = sum(row[1:]), list(row[1:])
    out = dict(zip(CATEGORIES, at or [0] * len(CATEGORIES)))
    out["allocated"] = max(best, 0)
    return out


def cuda_history(enabled: bool):
    """Start PyTorch's CUDA allocation history (for the memory viewer) when ``enabled`` on CUDA."""
    if enabled and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=200_000)


def dump_cuda_history(path: str):
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


_PHASE_COLOURS = {"forward": "#dbe9f6", "backward": "#fde2cf", "optimizer": "#dff2dc", "step": "#eeeeee"}


def draw(traces: list[Trace], path: str, title: str = "", predicted: list[float] | None = None):
    """One panel per rank: memory over the traced steps (MiB), phases shaded, model state stacked
    (parameters, gradients, optimizer states, over the empty rank's baseline), the peak and, when
    given, the predicted peak as a dashed line. Written to ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mib = 2**20
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.6 * len(traces)), sharex=True, squeeze=False)
    for ax, tr in zip(axes[:, 0], traces):
        marks = tr.marks + [(tr.samples[-1][0] if tr.samples else 0.0, "end")]
        for (t0, name), (t1, _) in zip(marks, marks[1:]):
            kind = name.split(" ")[0]
            if kind in _PHASE_COLOURS:
                ax.axvspan(t0, t1, color=_PHASE_COLOURS[kind], lw=0)
        if tr.state:
            ts = [s[0] for s in tr.state] + [marks[-1][0]]
            base = [tr.baseline / mib] * len(ts)
            layers = [("parameters", 1, "#4c72b0"), ("gradients", 2, "#dd8452"), ("optimizer states", 3, "#55a868")]
            bottom = base
            ax.fill_between(ts, 0, base, step="post", color="#bbbbbb", label="empty rank (torch, process groups)")
            for label, i, colour in layers:
                vals = [s[i] / mib for s in tr.state] + [tr.state[-1][i] / mib]
                top = [b + v for b, v in zip(bottom, vals)]
                ax.fill_between(ts, bottom, top, step="post", color=colour, alpha=0.8, label=label)
                bottom = top
        if tr.samples:
            ax.plot([s[0] for s in tr.samples], [s[1] / mib for s in tr.samples], color="black", lw=1,
                    label="RSS" if tr.device == "cpu" else "allocated")
        ax.axhline(tr.peak / mib, color="#c44e52", lw=1, label=f"peak {tr.peak / mib:,.0f} MiB")
        if predicted:
            ax.axhline(predicted[tr.rank] / mib, color="#c44e52", lw=1, ls="--",
                       label=f"predicted {predicted[tr.rank] / mib:,.0f} MiB")
        ax.set_ylabel(f"rank {tr.rank}, MiB")
        ax.set_ylim(bottom=0)
    axes[0, 0].legend(loc="lower right", fontsize=7, ncol=3, framealpha=0.9)
    axes[-1, 0].set_xlabel("seconds (shaded: forward blue, backward orange, optimizer green)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
