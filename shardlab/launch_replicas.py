"""Launching replica groups with live recovery (``train.fault_tolerance = "replica"``).

``run(fn, n_replicas, n_local, *args)`` hosts the TCPStore that replicas coordinate through and
the :class:`~shardlab.distributed.quorum.Lighthouse`, starts ``n_replicas`` groups of
``n_local`` processes (each group its own torch.distributed world of ``n_local``), and calls
``fn(ctx, ft, *args)`` in each rank. It supervises them every few milliseconds:

* a rank that exits (killed, crashed, raised) or whose heartbeat is older than ``ft_timeout_s``
  (stopped, hung) fails its whole replica group: the group's other ranks are SIGKILLed, the
  lighthouse drops it from open quorums (the survivors' step is aborted and retried without it),
  and a replacement group (generation + 1) is started from warm spare processes (already started,
  torch imported) so that it can ask to join within a second; it is healed from a live peer;
* a rank whose error is bad input or a divergence (``quorum.Diverged``) ends the job
  (:class:`launch.WorkerError`), as does a replica slot replaced more than ``max_replacements`` times.

``injector(seconds since start, view)`` (benchmarks/soak.py) may return faults to apply:
[(replica, local rank, how)] with how ``sigkill``, ``sigstop:<seconds>`` (SIGCONT after) or
``raise`` (SIGUSR1: the rank raises in its training loop), or ``"stop"``: training ends two steps
after the most advanced quorum (the lighthouse's ``stop_at``) and no more faults are injected. Returns (results, report): results[r] = the ranks' return values of
replica r's last generation; report = failures (with detect / rejoin / first-step times) and
the lighthouse's log.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import signal
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from . import launch
from .launch_report import report_to
from .distributed.quorum import Lighthouse

FATAL = ("Diverged:", *launch.BAD_INPUT)


class InjectedFailure(BaseException):
    """Raised by SIGUSR1 (the soak's "raised exception"): a BaseException, so that no ``except
    Exception`` on the way (a failed collective is retried) can swallow it: the rank fails."""


def _raise_on_usr1(signum, frame):
    raise InjectedFailure("injected failure (SIGUSR1: an exception raised in the training loop)")


def _spare(inbox, results, parent_pid, fn, args, device, timeout_s, threads):
    """A warm process: imports done, waits for its assignment (replica, gen, local, ...)."""
    launch.die_with_parent(parent_pid)
    signal.signal(signal.SIGUSR1, _raise_on_usr1)
    from .train import heal  # noqa: F401  (warm: the import cost is paid before a failure)
    job = inbox.get()
    if job is None:
        return
    r, gen, i, n_local, init_method, ft = job
    report_to(results, (r, gen, i),
                     lambda: fn(launch._init(i, n_local, i, n_local, init_method, device, timeout_s, threads), ft, *args))


class _Pool:
    """Spare processes, started ahead of need."""

    def __init__(self, mpctx, results, fn, args, device, timeout_s, threads):
        self.mpctx, self.results, self.spec = mpctx, results, (fn, args, device, timeout_s, threads)
        self.free: list[tuple] = []
        self.all: list = []

    def start(self, n: int) -> None:
        for _ in range(n):
            inbox = self.mpctx.Queue()
            p = self.mpctx.Process(target=_spare, args=(inbox, self.results, os.getpid(), *self.spec), daemon=False)
            p.start()
            self.free.append((p, inbox))
            self.all.append((p, inbox))  # the queue lives as long as its process (spawn unpickles it late)

    def take(self, n: int) -> list[tuple]:
        if len(self.free) < n:
            self.start(n - len(self.free))
        out, self.free = self.free[:n], self.free[n:]
        return out

    def stop(self) -> None:
        for _, inbox in self.free:
            inbox.put(None)
        deadline = time.time() + 5
        for p, _ in self.all:
            p.join(timeout=max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join()


def run(fn, n_replicas: int, n_local: int, *args, device: str = "cpu", timeout_s: float = 60.0,
        ft_timeout_s: float = 5.0, threads: int = 0, injector=None, faults: dict | None = None,
        max_replacements: int = 10_000, say=None, poll_s: float = 0.005, spares: int = 1):
    """(results, report); see the module doc."""
    from .train.heal import FTContext
    say = say or (lambda msg: print(msg, flush=True))
    mpctx = mp.get_context("spawn")
    results = mpctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ft_store = dist.PrefixStore("ft/", store)
    lh = Lighthouse(ft_store, n_replicas, n_local, ft_timeout_s)
    pool = _Pool(mpctx, results, fn, args, device, timeout_s, threads)
    pool.start((n_replicas + spares) * n_local)  # every replica, and spare replicas
    gen, procs, files = [0] * n_replicas, {}, []
    done: dict[int, dict[int, object]] = {r: {} for r in range(n_replicas)}
    failures, stopped, replaced = [], {}, [0] * n_replicas
    t0 = time.monotonic()

    def start(r: int) -> None:
        fd, path = tempfile.mkstemp(prefix=f"shardlab-ft-r{r}-g{gen[r]}-")
        os.close(fd)
        os.unlink(path)
        files.append(path)
        ft = FTContext(r, gen[r], n_replicas, store.port, ft_timeout_s, dict(faults or {}))
        procs[r] = []
        for i, (p, inbox) in enumerate(pool.take(n_local)):
            inbox.put((r, gen[r], i, n_local, f"file://{path}", ft))
            procs[r].append(p)
        lh.spawned(r, gen[r])
        done[r] = {}
        if len(pool.free) < spares * n_local:
            pool.start(spares * n_local - len(pool.free))

    def fail(r: int, why: str) -> None:
        now = time.monotonic()
        for p in procs[r]:
            if p.is_alive():
                p.kill()
        for p in procs[r]:
            p.join()
        lh.mark_dead(r, why)
        rec = next((f for f in reversed(failures) if f["replica"] == r and f["gen"] == gen[r] and "detect" not in f),
                   None)
        if rec is None:
            rec = {"replica": r, "gen": gen[r], "how": "natural", "t": now}
            failures.append(rec)
        rec.update(detect=now - rec["t"], why=why, t_detect=now)
        replaced[r] += 1
        if replaced[r] > max_replacements:
            raise launch.WorkerError(r * n_local, f"replica {r} failed {replaced[r]} times; giving up ({why})")
        gen[r] += 1
        start(r)

    try:
        for r in range(n_replicas):
            start(r)
        while not (lh.done and all(len(done[r]) == n_local for r in range(n_replicas))):
            while True:
                try:
                    r, g, i, status, payload = results.get_nowait()
                except queue_mod.Empty:
                    break
                if g != gen[r]:
                    continue
                if status == "ok":
                    done[r][i] = pickle.loads(payload)
                elif payload.startswith(FATAL):
                    raise launch.WorkerError(r * n_local + i, payload)
                else:
                    procs[r][i].join(timeout=1.0)
            for r in range(n_replicas):
                codes = [p.exitcode for p in procs[r]]
                bad = next((c for c in codes if c not in (None, 0)), None)
                if bad is not None:
                    fail(r, f"rank exited ({'signal ' + str(-bad) if bad < 0 else 'exit code ' + str(bad)})")
            for r in lh.stale(ft_timeout_s):
                fail(r, f"no heartbeat for {ft_timeout_s:g} s (stopped or hung)")
            lh.poll()
            now = time.monotonic()
            for (r, i), until in list(stopped.items()):
                if now >= until:
                    stopped.pop((r, i))
                    _signal(procs[r][i] if i < len(procs[r]) else None, signal.SIGCONT)
            if injector and not lh.done:
                view = {"now": now, "status": list(lh.status), "gen": list(gen), "failures": failures,
                        "log": lh.log, "n_local": n_local}
                acts = injector(now - t0, view) or []
                if acts == "stop":  # end training two steps after the most advanced quorum
                    lh.stop_at, injector = max((e["step"] for e in lh.log if e["event"] == "quorum"), default=0) + 2, None
                    acts = []
                for r, i, how in acts:
                    failures.append({"replica": r, "gen": gen[r], "how": how, "t": now})
                    p = procs[r][i]
                    if how.startswith("sigstop"):
                        _signal(p, signal.SIGSTOP)
                        stopped[(r, i)] = now + float(how.split(":")[1])
                    else:
                        _signal(p, signal.SIGKILL if how == "sigkill" else signal.SIGUSR1)
            time.sleep(poll_s)
    finally:
        for r in procs:
            for p in procs[r]:
                _signal(p, signal.SIGCONT)
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        pool.stop()
        results.close()
        results.join_thread()
        for f in files:
            if os.path.exists(f):
                os.unlink(f)
    _recovery_times(failures, lh.log)
    return [[done[r][i] for i in range(n_local)] for r in range(n_replicas)], \
        {"failures": failures, "log": lh.log, "seconds": time.monotonic() - t0}


def _signal(p, sig) -> None:
    if p is None or p.pid is None:
        return
    try:
        os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


def _recovery_times(failures: list[dict], log: list[dict]) -> None:
    """Per failure that was detected: ``rejoin`` = until the replacement's heal was committed,
    ``first_step`` = until the first step committed after the detection (seconds from the
    injection, or from the detection for failures not injected)."""
    for f in failures:
        if "t_detect" not in f:
            continue
        heal = next((e for e in log if e["event"] == "heal" and e["decision"] == "commit"
                     and e["t"] > f["t_detect"] and f["replica"] in e["members"]), None)
        step = next((e for e in log if e["event"] == "step" and e["decision"] == "commit" and e["t"] > f["t_detect"]),
                    None)
        f["rejoin"] = heal["t"] - f["t"] if heal else None
        f["first_step"] = step["t"] - f["t"] if step else None


def train(cfg, nproc: int, data_dir: str, say=None) -> int:
    """``shardlab train`` with ``train.fault_tolerance = "replica"``: dp_replicate groups of
    nproc / dp_replicate ranks; prints one line per failure and a summary; exit status."""
    from .train.heal import check, train_replica
    say = say or (lambda msg: print(msg, flush=True))
    check(cfg)
    t, n_rep = cfg.train, cfg.parallel.dp_replicate
    results, report = run(train_replica, n_rep, nproc // n_rep, cfg, data_dir, device=t.device,
                          timeout_s=t.timeout_s, ft_timeout_s=t.ft_timeout_s, threads=t.threads, say=say)
    for f in report["failures"]:
        if "detect" in f:
            say(f"shardlab: replica {f['replica']} (gen {f['gen']}) failed: {f.get('why')}; detected in "
                f"{f['detect']:.2f} s, replacement healed in {_s(f.get('rejoin'))}, first step after {_s(f.get('first_step'))}")
    heads = [r[0] for r in results]
    same = len({h["fingerprint"] for h in heads}) == 1
    say(f"shardlab: {n_rep} replicas x {nproc // n_rep} rank(s) trained {heads[0]['step']} steps in "
        f"{report['seconds']:.1f} s; {sum(h['degraded'] for h in heads[:1])} degraded step(s) seen by replica 0; "
        f"final state fingerprints {'identical' if same else 'DIFFER'} ({', '.join(format(h['fingerprint'], '08x') for h in heads)})")
    return 0 if same else 1


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"
