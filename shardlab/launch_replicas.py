"""Launching replica groups with live recovery (``train.fault_tolerance = "replica"``).

``run(fn, n_replicas, n_local, *args)`` hosts the TCPStore and the
:class:`~shardlab.distributed.quorum.Lighthouse`, starts ``n_replicas`` groups of ``n_local``
processes (each its own torch.distributed world) and hot spare groups; each rank calls
``prepared = fn(ctx, *args)`` before it knows its replica, then ``prepared.run(ft)`` once
assigned. The launcher supervises every few milliseconds and replaces a failed replica group
(exited, errored, stale heartbeat, stuck at start, silent) from the spares; bad input or a
divergence ends the job (:class:`launch.WorkerError`). Every wait has a deadline; ranks report
through files, never a queue shared by all ranks. Docs: docs/faults.md, "Live recovery"."""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import replace

import torch.distributed as dist

from . import launch
from .distributed.quorum import Lighthouse
from .errors import BAD_INPUT

FATAL = ("Diverged:", *BAD_INPUT)


class InjectedFailure(BaseException):
    """Raised by SIGUSR1 (the soak's "raised exception"): a BaseException, so that no ``except
    Exception`` on the way (a failed collective is retried) can swallow it: the rank fails."""


def _raise_on_usr1(signum, frame):
    raise InjectedFailure("injected failure (SIGUSR1: an exception raised in the training loop)")


def _result_path(run_dir: str, r: int, gen: int, i: int) -> str:
    return os.path.join(run_dir, f"result-r{r}-g{gen}-i{i}.pkl")


def _ready_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"ready-{pid}")


def _spare(inbox, run_dir, parent_pid, fn, args, device, timeout_s, threads, plan, env=None):
    """A hot spare (one rank of a spare group): joins its group's world, ``prepared = fn(ctx, *args)``
    (the engine, the data), waits for its assignment ``(replica, gen, ft)``, reports
    ``prepared.run(ft)`` ("ok" or "error") in its result file and ``os._exit``s (no exit handler
    can hang on a peer that is gone)."""
    launch.enter_rank(parent_pid, env)
    signal.signal(signal.SIGUSR1, _raise_on_usr1)
    group = inbox.get()
    if group is None:
        return
    i, n_local, init_method = group
    prepared, error = None, None
    try:
        prepared = fn(launch._init(i, n_local, i, n_local, init_method, device, timeout_s, threads, plan), *args)
    except BaseException as e:  # reported once assigned: the launcher then replaces the replica
        error = f"{type(e).__name__}: {e} (while the spare prepared)\n{traceback.format_exc()}"
    open(_ready_path(run_dir, os.getpid()), "w").close()  # the start deadline counts from here
    job = inbox.get()
    if job is None:
        os._exit(0)
    r, gen, ft = job
    code = 0
    try:
        if error:
            raise RuntimeError(error)
        # Plain pickle: tensors by value (torch's reducers would pass handles that die with us)
        out = ("ok", pickle.dumps(prepared.run(ft)))
    except BaseException as e:  # everything, InjectedFailure included
        out, code = ("error", error or f"{type(e).__name__}: {e}\n{traceback.format_exc()}"), 1
    path = _result_path(run_dir, r, gen, i)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(out, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Pool:
    """Hot spare groups of ``n_local`` processes, started (and prepared) ahead of need."""

    def __init__(self, mpctx, run_dir, n_local, fn, args, device, timeout_s, threads, plan):
        self.mpctx, self.run_dir, self.K, self.spec = mpctx, run_dir, n_local, (fn, args, device, timeout_s, threads, plan)
        self.free: list[list[tuple]] = []
        self.all: list = []
        self.n = 0

    def start(self, n_groups: int) -> None:
        for _ in range(n_groups):
            self.n += 1
            init, group = f"file://{os.path.join(self.run_dir, f'rdzv-{self.n}')}", []
            for i in range(self.K):
                inbox = self.mpctx.Queue()
                p = self.mpctx.Process(target=_spare, args=(inbox, self.run_dir, os.getpid(), *self.spec),
                                       kwargs={"env": launch.launcher_env()}, daemon=False)
                p.start()
                inbox.put((i, self.K, init))
                group.append((p, inbox))
                self.all.append((p, inbox))  # the queue lives as long as its process (spawn unpickles it late)
            self.free.append(group)

    def take(self) -> list[tuple]:
        """The oldest spare group all of whose processes are alive (a broken one is killed)."""
        while self.free:
            group = self.free.pop(0)
            if all(p.is_alive() for p, _ in group):
                return group
            for p, _ in group:
                p.kill()
        self.start(1)
        return self.free.pop(0)

    def stop(self) -> None:
        for group in self.free:
            for _, inbox in group:
                inbox.put(None)
        deadline = time.time() + 5
        for p, _ in self.all:
            p.join(timeout=max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join()


def run(fn, n_replicas: int, n_local: int, *args, device: str = "cpu", timeout_s: float = 60.0,
        ft_timeout_s: float = 5.0, threads: int = 0, injector=None, faults: dict | None = None,
        max_replacements: int = 10_000, say=None, poll_s: float = 0.005, spares: int = 1,
        start_timeout_s: float | None = None, plan=None):
    """(results, report): results[r] = the return values of replica r's last generation's ranks;
    report = failures (with detect / rejoin / first-step times) and the lighthouse's log.
    ``start_timeout_s`` (default ``timeout_s``): a replica (re)started that has not asked to join
    that long after its spare group was ready (or ``timeout_s + start_timeout_s`` after its
    assignment) is failed and started again. ``plan``: the run plan (its Mesh transport becomes
    process_group: no shared-memory arenas left by a killed rank). ``injector(seconds since
    start, view)`` (benchmarks/soak.py) may return [(replica, local rank, how)] with how
    ``sigkill``, ``sigstop:<seconds>`` or ``raise`` (SIGUSR1), or ``"stop"``: training ends two
    steps after the most advanced quorum."""
    from .train.heal import FTContext
    plan = replace(plan, transport="process_group") if plan else None
    say = say or (lambda msg: print(msg, flush=True))
    start_timeout_s = timeout_s if start_timeout_s is None else start_timeout_s
    mpctx = launch.rank_context(device)
    run_dir = tempfile.mkdtemp(prefix="shardlab-ft-")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ft_store = dist.PrefixStore("ft/", store)
    lh = Lighthouse(ft_store, n_replicas, n_local, ft_timeout_s)
    pool = _Pool(mpctx, run_dir, n_local, fn, args, device, timeout_s, threads, plan)
    pool.start(n_replicas + spares)  # every replica, and spare replica groups
    gen, procs, started, assigned = [0] * n_replicas, {}, [0.0] * n_replicas, [0.0] * n_replicas
    done: dict[int, dict[int, object]] = {r: {} for r in range(n_replicas)}
    failures, stopped, replaced = [], {}, [0] * n_replicas
    t0 = time.monotonic()

    def start(r: int) -> None:
        ft = FTContext(r, gen[r], n_replicas, store.port, ft_timeout_s, dict(faults or {}))
        procs[r] = []
        for p, inbox in pool.take():
            inbox.put((r, gen[r], ft))
            procs[r].append(p)
        lh.spawned(r, gen[r])
        done[r], started[r], assigned[r] = {}, time.monotonic(), time.monotonic()
        if len(pool.free) < spares:
            pool.start(spares - len(pool.free))

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
            for r in range(n_replicas):
                failed = None
                for i, p in enumerate(procs[r]):
                    path = _result_path(run_dir, r, gen[r], i)
                    if i in done[r] or not os.path.exists(path):
                        continue
                    with open(path, "rb") as f:
                        status, payload = pickle.load(f)
                    if status == "ok":
                        done[r][i] = pickle.loads(payload)
                    elif payload.startswith(FATAL):
                        raise launch.WorkerError(r * n_local + i, payload)
                    else:  # a reported error fails the replica now, whether or not the rank has exited
                        failed = failed or f"local rank {i} raised {payload.splitlines()[0][:200]}"
                bad = next((c for c in (p.exitcode for p in procs[r]) if c not in (None, 0)), None)
                if failed is None and bad is not None:
                    failed = f"rank exited ({'signal ' + str(-bad) if bad < 0 else 'exit code ' + str(bad)})"
                if failed is None and lh.status[r] == "starting":
                    now = time.monotonic()
                    if not all(os.path.exists(_ready_path(run_dir, p.pid)) for p in procs[r]):
                        if now - assigned[r] > timeout_s + start_timeout_s:
                            failed = f"its spare group was not ready {timeout_s + start_timeout_s:g} s after assignment"
                        started[r] = now
                    elif now - started[r] > start_timeout_s:
                        failed = f"did not ask to join within {start_timeout_s:g} s of its start (stuck at start)"
                if failed is not None:
                    fail(r, failed)
            for r in lh.stale(ft_timeout_s):
                fail(r, f"no heartbeat for {ft_timeout_s:g} s (stopped or hung)")
            for r in lh.silent():
                fail(r, f"silent in the protocol for {lh.silent_s:g} s (no request, no vote: hung)")
            lh.poll()
            if lh.lost:
                raise launch.WorkerError(0, lh.lost)
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
        shutil.rmtree(run_dir, ignore_errors=True)
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


def train(plan, nproc: int, data_dir: str, say=None) -> int:
    """``shardlab train`` with ``train.fault_tolerance = "replica"``: dp_replicate groups of
    nproc / dp_replicate ranks; prints one line per failure and a summary; exit status."""
    from .train.heal import check, train_replica
    say = say or (lambda msg: print(msg, flush=True))
    cfg = plan.config
    check(cfg)
    t, n_rep = cfg.train, cfg.parallel.dp_replicate
    results, report = run(train_replica, n_rep, nproc // n_rep, data_dir, device=t.device, timeout_s=t.timeout_s,
                          ft_timeout_s=t.ft_timeout_s, threads=t.threads, say=say, plan=plan)
    for f in report["failures"]:
        if "detect" in f:
            say(f"shardlab: replica {f['replica']} (gen {f['gen']}) failed: {f.get('why')}; detected in "
                f"{f['detect']:.2f} s, replacement healed in {_s(f.get('rejoin'))}, first step after {_s(f.get('first_step'))}")
    heads = [r[0] for r in results]
    same = len({h["fingerprint"] for h in heads}) == 1
    say(f"shardlab: {n_rep} replicas x {nproc // n_rep} rank(s) trained {heads[0]['step']} steps in "
        f"{report['seconds']:.1f} s; {sum(h['degraded'] for h in heads[:1])} degraded step(s) seen by replica 0; "
        f"final state fingerprints {'identical' if same else 'DIFFER'} ({', '.join(format(h['fingerprint'], '08x') for h in heads)})"
        + (f"; resumed from {heads[0]['resumed_from']}" if heads[0].get("resumed_from") else ""))
    return 0 if same else 1


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"
