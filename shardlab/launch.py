"""Starting ranks: local ranks (CPU gloo, N ranks sharing one GPU, NCCL one rank per GPU) and the
torchrun contract; with cli.py, the only module that reads environment variables. ``run(fn, nproc,
*args, plan=...)`` calls ``fn(ctx, *args)`` on every rank with a :class:`RankContext` (``ctx.plan``:
the run plan, train/plan.py) and returns the results in rank order; a rank that raises or dies
stops the others at once (:class:`WorkerError`, never a hang). Under torchrun it runs in place.
Docs: docs/training.md, "Launcher"."""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .distributed.heap import set_mmap_threshold
from .launch_procs import die_with_parent, let_forkserver_exit, rank_context, set_pdeathsig  # noqa: F401 (launch's API)
from .launch_report import close_dump_dir, report_to
from .train.plan import RunPlan


class WorkerError(RuntimeError):
    """A rank failed; ``rank`` is the first failing rank and ``str(err)`` holds its error. ``rank``
    None: no rank failed, the launcher itself did (Ray's driver), and the message says so."""

    def __init__(self, rank: int | None, message: str):
        self.rank = rank
        self.who = f"rank {rank}" if rank is not None else "the launcher"
        super().__init__(f"{self.who} failed{'' if rank is not None else ' (no rank did)'}:\n{message}")


@dataclass
class RankContext:
    """What a rank needs to know about the launch: passed to the worker function."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    plan: RunPlan | None = None
    """The run plan the parent resolved for this start (``shardlab train``), else None."""
    on_checkpoint: object = None
    """Called by every rank as ``on_checkpoint(path, step)`` after each checkpoint save (Ray Train's
    checkpoint reporting, shardlab/launch_ray.py), else None."""
    restart_count: int = 0
    """Under Ray: how many times Ray Train restarted the worker group before this start."""
    max_restarts: int = 0

    def after_step(self, step: int) -> None:
        """After each step (the training loop): TEST-ONLY fault injection, a no-op unless armed."""
        injected_fault_point(step)


def check_device(device: str, fix: str = "--device cpu (or auto)") -> None:
    """``cuda`` where no GPU is visible: a ConfigError naming ``fix``. ``run`` checks it in the
    parent before any rank starts; commands call it before their own work (a dry run starts none)."""
    if device == "cuda" and not torch.cuda.is_available():
        from .errors import ConfigError
        raise ConfigError("train.device", f"cuda, but no CUDA device is visible here; use {fix}")


def choose_backend(device: str, nproc_local: int) -> tuple[str, str]:
    """-> (backend, device kind). NCCL needs one GPU per rank; N ranks on one GPU use gloo."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        check_device(device)
        return ("nccl" if torch.cuda.device_count() >= nproc_local else "gloo"), "cuda"
    return "gloo", "cpu"


def mps_running() -> bool:
    """Whether CUDA's MPS control daemon runs for this user: its pipe directory
    (``CUDA_MPS_PIPE_DIRECTORY``, default /tmp/nvidia-mps) holds its ``control`` pipe. Ranks sharing
    a GPU under MPS run their kernels at once instead of in time slices (docs/gpu.md)."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def default_threads(nproc_local: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, nproc_local))


def _rank_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def mmap_threshold() -> int:
    """glibc's mmap threshold of every rank (SHARDLAB_MMAP_THRESHOLD; 0: glibc's; docs/data-parallel.md)."""
    return int(os.environ.get("SHARDLAB_MMAP_THRESHOLD", 16 << 20))


def _init(rank, world, local_rank, local_world, init_method, device, timeout_s, threads, plan=None) -> RankContext:
    set_mmap_threshold(mmap_threshold())
    backend, kind = choose_backend(device, local_world)
    torch.set_num_threads(threads or default_threads(local_world))
    dev = _rank_device(kind, local_rank)
    if kind == "cuda":
        torch.cuda.set_device(dev)
    kwargs = dict(backend=backend, rank=rank, world_size=world,
                  timeout=datetime.timedelta(seconds=timeout_s))
    if init_method:
        kwargs["init_method"] = init_method
    if backend == "nccl":
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)
    return RankContext(rank, world, local_rank, dev, backend, plan)


def launcher_env() -> dict:
    """The launcher's environment as it is now, handed to each rank it starts (:func:`enter_rank`)."""
    return dict(os.environ)


def enter_rank(parent_pid: int | None, env: dict | None) -> None:
    """First thing in a rank process started from :func:`rank_context`: the launcher's environment
    ``env`` (a forkserver's child starts with the server's), and never outliving the launcher."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
        let_forkserver_exit()
    if parent_pid is not None:
        die_with_parent(parent_pid)


def _worker(rank, world, init_method, device, timeout_s, threads, fn, args, results, parent_pid=None, plan=None,
            env=None):
    enter_rank(parent_pid, env)

    def body():
        _arm_test_hooks(rank, plan.test_hooks if plan else {})
        return fn(_init(rank, world, rank, world, init_method, device, timeout_s, threads, plan), *args)
    report_to(results, (rank,), body)


# -- TEST-ONLY fault injection (docs/faults.md, "Automatic restart"; never set in real runs) --------
_TEST_KILL: tuple[int, str] | None = None


def test_env() -> dict:
    """TEST-ONLY: this process's ``SHARDLAB_TEST_*`` variables (the run plan's ``test_hooks``)."""
    return {k: v for k, v in os.environ.items() if k.startswith("SHARDLAB_TEST_")}


def _arm_test_hooks(rank: int, hooks: dict) -> None:
    """In a rank, from the plan's ``test_hooks``: SHARDLAB_TEST_KILL_AT_STEP, SHARDLAB_TEST_REFUSE_RANK."""
    global _TEST_KILL
    if spec := hooks.get("SHARDLAB_TEST_KILL_AT_STEP"):
        r, step, once = spec.split(":", 2)
        if int(r) == rank:
            _TEST_KILL = (int(step), once)
    if spec := hooks.get("SHARDLAB_TEST_REFUSE_RANK"):
        r, flag = spec.split(":", 1)
        if int(r) == rank and os.path.exists(flag):
            raise RuntimeError(f"rank {rank} cannot come back (test hook SHARDLAB_TEST_REFUSE_RANK)")


def injected_fault_point(step: int) -> None:
    """TEST-ONLY: called by the training loop after each step; see SHARDLAB_TEST_KILL_AT_STEP."""
    if _TEST_KILL is None or _TEST_KILL[0] != step or os.path.exists(_TEST_KILL[1]):
        return
    open(_TEST_KILL[1], "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_world_size() -> int | None:
    """WORLD_SIZE under torchrun, else None."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


def torchrun_rank() -> int | None:
    return int(os.environ["RANK"]) if under_torchrun() else None


def elastic_restarts() -> tuple[int, int]:
    """(TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS) under torchrun, else (0, 0)."""
    env = os.environ if under_torchrun() else {}
    return int(env.get("TORCHELASTIC_RESTART_COUNT") or 0), int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)


def run(fn, nproc: int, *args, device: str = "cpu", timeout_s: float = 60.0, threads: int = 0,
        plan: RunPlan | None = None):
    """Run ``fn(ctx, *args)`` on ``nproc`` ranks; return results in rank order (see module doc)."""
    if under_torchrun():
        _arm_test_hooks(torchrun_rank(), plan.test_hooks if plan else {})
        ctx = _torchrun_init(device, timeout_s, threads, plan)
        try:
            return [fn(ctx, *args)]
        finally:
            dist.destroy_process_group()
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    check_device(device)  # here, not in every rank (a traceback each)
    ctx = rank_context(device)
    results = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="shardlab-store-")
    os.close(fd)
    os.unlink(store)  # FileStore creates it; a fresh name avoids port races between jobs
    init_method = f"file://{store}"
    from .distributed import flight
    dump_dir = flight.new_dump_dir()  # each rank dumps its flight recorder here at the end
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(r, nproc, init_method, device, timeout_s, threads, flight.wrap(fn, dump_dir),
                               args, results, os.getpid(), plan, launcher_env()))
             for r in range(nproc)]
    for p in procs:
        p.start()
    ok, failure = False, None
    try:
        out = _collect(procs, results, nproc)
        ok = True
        return out
    except WorkerError as err:
        from .distributed.flight import diagnose_failure
        diagnose_failure(err, dump_dir, procs)
        failure = err
        raise
    finally:
        # After a success, let the ranks exit by themselves: a rank terminated while it shuts down
        # skips its exit finalizers and leaks its semaphores (tqdm's lock) to the resource tracker.
        deadline = time.time() + (10 if ok else 0)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.time()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        results.close()
        results.join_thread()
        if os.path.exists(store):
            os.unlink(store)
        close_dump_dir(dump_dir, ok, failure)  # kept (and named) only when it holds dumps


_SECONDARY = ("Connection closed by peer", "remote worker", "Connection reset", "Timed out", "timed out")


def _collect(procs, results, nproc, grace_s: float = 1.0):
    """Results in rank order, or WorkerError for the root failure. When one rank fails, the
    others usually fail next with a broken-connection error: wait ``grace_s`` for every report,
    then blame a rank that died silently (killed) or raised a non-communication error first."""
    out: dict[int, object] = {}
    failures: dict[int, str] = {}
    deadline = None
    while len(out) + len(failures) < nproc:
        if deadline is not None and time.time() > deadline:
            break
        try:
            rank, status, payload = results.get(timeout=0.1)
            if status == "error":
                failures[rank] = payload
            else:
                out[rank] = pickle.loads(payload)
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if r not in out and r not in failures and p.exitcode not in (None, 0):
                    if deadline is None:  # give its own report a moment to arrive
                        deadline = time.time() + grace_s
                    elif time.time() > deadline - grace_s / 2:
                        failures[r] = f"process died ({exit_how(p.exitcode)}) without reporting an error"
        if failures and deadline is None:
            deadline = time.time() + grace_s
    if not failures:
        return [out[r] for r in range(nproc)]

    def blame(item):
        rank, msg = item
        silent = msg.startswith("process died")
        secondary = any(s in msg for s in _SECONDARY)
        return (not silent, secondary, rank)
    rank, msg = min(failures.items(), key=blame)
    others = sorted(set(failures) - {rank})
    note = f"\n(then ranks {others} stopped as a consequence)" if others else ""
    raise WorkerError(rank, msg + note)


def _torchrun_init(device, timeout_s, threads, plan=None) -> RankContext:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return _init(rank, world, int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                 None, device, timeout_s, threads, plan)


# -- shardlab.initialize: join the job this process was started in ------------------------------

def init_from_env(device: str = "auto", timeout_s: float = 60.0, threads: int = 0) -> RankContext:
    """The :class:`RankContext` of this process for ``shardlab.initialize``: torch.distributed
    as it is when already initialised (``launch.run`` workers, a user's own init), else from the
    torchrun contract (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_*``,
    set by torchrun and ``shardlab launch``), else a world of one (a private file store)."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        backend = dist.get_backend()
        # NCCL means one GPU per rank; a gloo job runs on the CPU unless device = cuda says otherwise
        on_gpu = backend == "nccl" or (device == "cuda" and torch.cuda.is_available())
        dev = _rank_device("cuda", local_rank) if on_gpu else torch.device("cpu")
        return RankContext(rank, world, local_rank, dev, backend)
    if under_torchrun():
        return _torchrun_init(device, timeout_s, threads)
    fd, store = tempfile.mkstemp(prefix="shardlab-store-")
    os.close(fd)
    os.unlink(store)
    return _init(0, 1, 0, 1, f"file://{store}", device, timeout_s, threads or torch.get_num_threads())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, nproc: int, port: int, base: dict | None = None) -> dict:
    """The environment torchrun gives rank ``rank`` of a one-node job of ``nproc`` ranks."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(default_threads(nproc)))
    return env


def spawn_script(nproc: int, argv: list[str], poll_s: float = 0.05, report=None,
                 restart_count: int = 0, max_restarts: int = 0) -> int:
    """``shardlab launch``: run ``python argv...`` as ``nproc`` local ranks with torchrun's
    environment. Returns 0 when every rank exits 0; when one fails, the others are terminated
    (SIGTERM, then SIGKILL after 5 s) and its exit code is returned, the rank named through
    ``report`` (default: stderr). Never waits on a dead job. Like torchrun, the ranks see
    ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS`` (``shardlab launch --max-restarts``)."""
    import subprocess
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    report = report or (lambda msg: print(msg, file=sys.stderr, flush=True))
    port = free_port()
    parent = os.getpid()

    def child_setup():  # in each rank between fork and exec: die with this launcher (Linux)
        if set_pdeathsig() and os.getppid() != parent:
            os._exit(1)
    setup = child_setup if sys.platform.startswith("linux") else None
    elastic_env = dict(TORCHELASTIC_RESTART_COUNT=str(restart_count), TORCHELASTIC_MAX_RESTARTS=str(max_restarts))
    procs = [subprocess.Popen([sys.executable, *argv], env=dict(torchrun_env(r, nproc, port), **elastic_env),
                              preexec_fn=setup)
             for r in range(nproc)]
    failed = None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = r
                    break
            time.sleep(poll_s)
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if failed is None:
        return 0
    return script_failure(failed, procs[failed].returncode, report)


def exit_how(code: int) -> str:
    """A process's exit status in words (a negative status: the signal that killed it)."""
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def script_failure(rank: int, code: int, report) -> int:
    """``shardlab launch``'s line for a script rank that failed (local or Ray), and the status the
    command returns: the script's own, 1 for a signal."""
    report(f"shardlab launch: rank {rank} failed ({exit_how(code)}); the other ranks were stopped")
    return code if code > 0 else 1
