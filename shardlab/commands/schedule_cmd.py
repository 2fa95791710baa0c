"""``shardlab schedule --pp P --microbatches M --schedule NAME [--virtual V] [--out timeline.png]``

Builds the schedule's action lists, simulates them (deadlock check, timeline, bubble, memory),
prints the timeline as text and the theoretical vs simulated bubble, and optionally saves a PNG.
"""
from __future__ import annotations

from ..parallel.pipeline.schedule import SCHEDULES, ScheduleError, build, theoretical_bubble
from ..parallel.pipeline.simulate import simulate
from ..analysis.timeline import plot, render_text


def configure(parser):
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual", "-v", type=int, default=None,
                        help="virtual stages per rank (interleaved; default 2 there, 1 elsewhere)")
    parser.add_argument("--cost", default="1,1,1", help="F,B,W cost per stage (default 1,1,1); B = input "
                        "gradient only, the full backward costs B+W")
    parser.add_argument("--out", default="", help="save the timeline as a PNG here")


def summary(name: str, p: int, m: int, v: int, f: float = 1.0, b: float = 1.0, w: float = 1.0):
    """(text report, SimResult) for one schedule; raises ScheduleError if it cannot run."""
    sched = build(name, p, m, v)
    v = 1 if sched.layout == "dual" else sched.v  # dualpipe's chunks are whole stages
    res = simulate(sched, f=f, b=b, w=w)
    if not res.ok:
        raise ScheduleError(f"schedule {name} refused: {res.reason}")
    theory = theoretical_bubble(name, p, m, v, f, b, w)
    lines = [f"{name}: pp={p} microbatches={m} virtual={v} costs F={f:g} B={b:g} W={w:g}"
             + (" (B and W split)" if sched.split_bw else " (backward = B+W)"),
             render_text(res.timeline, unit=min(f, b, w) / v),
             f"bubble: theoretical {theory:.4f}   simulated {res.bubble:.4f}   "
             f"(step {res.makespan:g} time units, {p} rank{'s' if p > 1 else ''})",
             "micro-batches held per rank (F done, backward not): "
             + " ".join(f"{x / v:g}" for x in res.peak_inflight)
             + ("   until W: " + " ".join(f"{x / v:g}" for x in res.peak_held) if sched.split_bw else "")
             + ("  (in units of a rank's whole layer share)" if v > 1 else "")
             + ("  (in stages; each rank holds two)" if sched.layout == "dual" else "")]
    return "\n".join(lines), res


def _costs(text: str) -> tuple[float, float, float]:
    """``--cost F,B,W``: three positive, finite numbers of time units."""
    from ..config import ConfigError
    try:
        f, b, w = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError("--cost", f"{text!r}: give three numbers F,B,W, e.g. 1,1,1") from None
    if not all(0 < x < float("inf") for x in (f, b, w)):
        raise ConfigError("--cost", f"{text!r}: each of F, B, W must be a positive number of time units, "
                                    "e.g. 1,2,1 (a backward twice a forward)")
    return f, b, w


def main(args) -> int:
    from ..config import ConfigError
    from ..errors import at_least, output_file
    output_file(args.out, "--out")
    v = args.virtual if args.virtual is not None else (2 if args.schedule == "interleaved" else 1)
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches), ("--virtual", v)):
        at_least(value, 1, flag)
    f, b, w = _costs(args.cost)
    try:
        text, res = summary(args.schedule, args.pp, args.microbatches, v, f, b, w)
    except ScheduleError as e:
        raise ConfigError("--schedule", str(e)) from None
    print(text)
    if args.out:
        plot(res.timeline, args.out, f"{args.schedule} pp={args.pp} m={args.microbatches} v={v}: "
                                     f"simulated bubble {res.bubble:.3f}")
        print(f"timeline saved to {args.out}")
    return 0
