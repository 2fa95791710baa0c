"""Soak test of live recovery (train.fault_tolerance = replica; docs/faults.md, "Live recovery").

    python benchmarks/soak.py --replicas 2 --ranks 2 --minutes 10 --failures 200 --gap 0.3 --out benchmarks/results/soak.md

R replica groups of K ranks train a tiny model (CPU, gloo) for many steps while a seeded injector
fails a random rank of a random replica: SIGKILL, SIGSTOP (then SIGCONT after 0.3-2x the timeout:
a short pause must be ridden out, a long one is a hung rank and is dropped), or a raised
exception (SIGUSR1). The next failure is injected once every replica is back and a step has been
committed by all R of them (never two failures in one recovery: the state must survive somewhere).
The run stops after ``--failures`` injected failures or ``--minutes``, then trains two more steps.

Measured: per failure, from the injection: detect (the launcher drops the replica), rejoin
(its replacement's heal is committed) and first step after (the first step committed after the
drop, by the survivors); median and max per kind. Checked: every replica's final state
fingerprint equal, every trained step recorded once with one loss (union over the replicas'
metrics), no process of the run left (children of this process), the largest loss change at a
failure against the largest elsewhere.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardlab import config as C  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check validate runs)
from shardlab import launch_replicas  # noqa: E402
from shardlab.train import finetune  # noqa: E402
from shardlab.train.heal import train_replica  # noqa: E402
from shardlab.train.plan import make_plan  # noqa: E402

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.warmup_steps=10", "--train.lr=1e-3",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_every=0", "--train.threads=1",
        "--logging.log_every=1", "--train.steps=1000000", "--checkpoint.save=false"]


class Injector:
    """Seeded faults, one at a time (module doc)."""

    def __init__(self, seed: int, n_replicas: int, timeout_s: float, failures: int, seconds: float, gap_s: float):
        self.rng, self.R, self.timeout_s = random.Random(seed), n_replicas, timeout_s
        self.target, self.seconds, self.gap_s = failures, seconds, gap_s
        self.injected, self.next_at, self.last_t = 0, gap_s, None

    def __call__(self, t: float, view: dict):
        if self.injected >= self.target or t >= self.seconds:
            return "stop"
        if t < self.next_at or any(s != "active" for s in view["status"]):
            return []
        if self.last_t is None and not any(e["event"] == "step" and e["decision"] == "commit"
                                           and len(e["members"]) == self.R for e in view["log"][-50:]):
            return []  # not before the replicas have trained a step together
        if self.last_t is not None:  # the pause is over, R live replicas committed a step since
            if view["now"] < self.last_t + self.pause_s + 0.1:
                return []
            if not any(e["event"] == "step" and e["decision"] == "commit" and len(e["members"]) == self.R
                       and e["t"] > self.last_t + self.pause_s for e in view["log"][-50:]):
                return []
        kind, self.pause_s = self.rng.choice(["sigkill", "sigstop", "raise"]), 0.0
        if kind == "sigstop":
            self.pause_s = self.rng.uniform(0.3, 2.0) * self.timeout_s
            kind = f"sigstop:{self.pause_s:.2f}"
        r, i = self.rng.randrange(self.R), self.rng.randrange(view["n_local"])
        self.injected += 1
        self.last_t = view["now"]
        self.next_at = t + self.rng.uniform(0.5, 1.5) * self.gap_s
        return [(r, i, kind)]


def _children() -> list[int]:
    """Processes descended from this one, less its own multiprocessing helpers (the resource
    tracker and the forkserver, whose children, the ranks it forked, do count)."""
    parent, cmd = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                cmd[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    server = b"multiprocessing.forkserver import main"  # a forked rank keeps its server's command line

    def helper(pid):
        return b"resource_tracker" in cmd[pid] or (server in cmd[pid] and server not in cmd.get(parent[pid], b""))
    out, todo = [], [os.getpid()]
    while todo:
        me = todo.pop()
        for pid, pp in parent.items():
            if pp == me:
                todo.append(pid)
                if not helper(pid):
                    out.append(pid)
    return out


def _stats(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def losses(run_dir: Path, n_replicas: int) -> tuple[dict, int, set]:
    """{step: loss} over every replica's records, the number of steps whose records disagree,
    the steps trained by fewer than all replicas."""
    by_step, clash, degraded = {}, 0, set()
    for r in range(n_replicas):
        f = run_dir / f"replica_{r}" / "metrics.jsonl"
        for line in f.read_text().splitlines() if f.exists() else []:
            rec = json.loads(line)
            if rec.get("kind") != "train":
                continue
            if rec["step"] in by_step and by_step[rec["step"]] != rec["loss"]:
                clash += 1
            by_step.setdefault(rec["step"], rec["loss"])
            if rec["degraded"]:
                degraded.add(rec["step"])
    return by_step, clash, degraded


def soak(args, say=print) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="shardlab-soak-", dir="/tmp"))
    world = args.replicas * args.ranks
    extra = [f"--parallel.dp_replicate={args.replicas}", f"--train.global_batch={2 * world}"]
    if args.ranks > 1:
        extra += [f"--parallel.dp_shard={args.ranks}", "--parallel.zero_stage=3"]
    cfg = C.load(None, TINY + extra + [f"--logging.run_dir={run_dir}", f"--data.cache_dir={args.cache}"])
    cfg = cfg.validate(world_size=world)
    data_dir = finetune.prepare_tokens(cfg, None)
    inj = Injector(args.seed, args.replicas, args.timeout, args.failures, args.minutes * 60, args.gap)
    t0 = time.monotonic()
    results, report = launch_replicas.run(train_replica, args.replicas, args.ranks, str(data_dir), plan=make_plan(cfg),
                                          timeout_s=60, ft_timeout_s=args.timeout, threads=1, injector=inj,
                                          say=lambda *_: None, spares=args.spares, start_timeout_s=args.start_timeout)
    wall = time.monotonic() - t0
    (run_dir / "lighthouse.json").write_text(json.dumps({"log": report["log"], "failures": report["failures"]}))
    left = _children()
    by_step, clash, degraded = losses(run_dir, args.replicas)
    fails = report["failures"]
    fps = {tuple(x["fingerprint"] for x in rep) for rep in results}
    steps = sorted(by_step)
    near = set()  # the first step committed after each drop
    dead_t = sorted(f["t_detect"] for f in fails if "t_detect" in f)
    qlog = [e for e in report["log"] if e["event"] == "step" and e["decision"] == "commit"]
    quorums = {e["id"]: e for e in report["log"] if e["event"] == "quorum"}
    for t in dead_t:
        e = next((e for e in qlog if e["t"] > t), None)
        if e is not None:
            near.add(quorums[e["id"]]["step"] + 1)
    times = [e["t"] for e in qlog]
    gap = max((b - a for a, b in zip(times, times[1:])), default=0.0)  # the longest time with no step committed
    jumps = [(s, abs(by_step[s] - by_step[s - 1])) for s in steps if s - 1 in by_step]
    at = max((d for s, d in jumps if s in near), default=float("nan"))
    other = max((d for s, d in jumps if s not in near and s > 20), default=float("nan"))
    out = {"wall": wall, "fails": fails, "identical": len(fps) == 1, "orphans": left, "steps": len(steps),
           "last": steps[-1] if steps else 0, "missing": (steps[-1] - len(steps)) if steps else 0, "clash": clash,
           "degraded": len(degraded), "jump_at": at, "jump_else": other, "gap": gap,
           "restarts": sum(1 for f in fails if "did not ask" in f.get("why", "") or "silent" in f.get("why", "")),
           "refused": sum(x["refused"] for rep in results for x in rep), "run_dir": str(run_dir)}
    return out


def table(args, res: dict) -> str:
    fails = res["fails"]
    kinds = ["sigkill", "sigstop", "raise"]
    lines = [f"{args.replicas} replicas x {args.ranks} rank(s), tiny Llama (d_model 32, 2 layers), CPU gloo; "
             f"train.ft_timeout_s = {args.timeout:g}; seed {args.seed}; wall {res['wall']:.0f} s; "
             f"{len(fails)} failures injected; {res['steps']} steps trained (last {res['last']}), "
             f"{res['degraded']} of them degraded (fewer than {args.replicas} replicas live)",
             "",
             "| failure | injected | dropped | ridden out | detect s (median / max) | rejoin s (median / max) | "
             "first step after s (median / max) |",
             "|---|---:|---:|---:|---|---|---|"]
    for k in kinds:
        fk = [f for f in fails if f["how"].split(":")[0] == k]
        dropped = [f for f in fk if "t_detect" in f]
        lines.append(f"| {k} | {len(fk)} | {len(dropped)} | {len(fk) - len(dropped)} | "
                     f"{_stats([f['detect'] for f in dropped])} | {_stats([f.get('rejoin') for f in dropped])} | "
                     f"{_stats([f.get('first_step') for f in dropped])} |")
    dropped = [f for f in fails if "t_detect" in f]
    lines.append(f"| all | {len(fails)} | {len(dropped)} | {len(fails) - len(dropped)} | "
                 f"{_stats([f['detect'] for f in dropped])} | {_stats([f.get('rejoin') for f in dropped])} | "
                 f"{_stats([f.get('first_step') for f in dropped])} |")
    lines += ["",
              f"- replicas identical at the end (state fingerprints): {'yes' if res['identical'] else 'NO'}",
              f"- processes of the run left after it: {len(res['orphans'])}",
              f"- longest time with no step committed by any replica: {res['gap']:.2f} s; replacements failed "
              f"for not joining in time or for silence: {res['restarts']}",
              f"- steps with no record: {res['missing']}; steps recorded with two different losses: {res['clash']}",
              f"- largest loss change at a step right after a drop: {res['jump_at']:.4f}; elsewhere (after step 20): "
              f"{res['jump_else']:.4f}",
              f"- heals refused (checksum): {res['refused']}"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=1, help="ranks per replica (2: FSDP inside each replica)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--failures", type=int, default=200)
    ap.add_argument("--gap", type=float, default=0.5, help="mean seconds between failures (once recovered)")
    ap.add_argument("--spares", type=int, default=2, help="warm spare replica groups kept started")
    ap.add_argument("--timeout", type=float, default=1.5, help="train.ft_timeout_s")
    ap.add_argument("--start-timeout", type=float, default=30.0,
                    help="a replacement that has not asked to join after this many seconds is started again")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="/tmp/shardlab-soak-cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = soak(args)
    text = table(args, res)
    print(text)
    if args.out:
        Path(args.out).write_text(f"`python {' '.join(sys.argv)}`\n\n{text}\n")
    ok = res["identical"] and not res["orphans"] and not res["clash"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
