"""The Ray launcher (``--launcher ray``): ``run(fn, nproc, *args, opts=RayOptions(...))`` runs
``fn(ctx, *args)`` on ``nproc`` Ray Train workers of a ``TorchTrainer``, gang-scheduled in one
placement group; the same function as under launch.run, so the same losses. Every rank reports
its own shard files of each checkpoint to Ray Train; after a worker failure (``FailureConfig``)
the restarted ranks resume the newest reported one (in ``ctx.plan.resume_from``). Ray is an
optional extra, imported only here; the ``SHARDLAB_TEST_*`` hooks reach the workers in the run
plan. Docs: docs/ray.md (flight recorder dumps: docs/faults.md)."""
from __future__ import annotations

import math
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import ConfigError, at_least
from .launch_ray_worker import Mailbox, ScriptFailed, newest_reported, plain_print, reporter, step_of

INSTALL = "--launcher ray needs Ray, an optional extra: pip install 'shardlab[ray]'"


@dataclass
class RayOptions:
    """How to start the Ray job (CLI: --ray-address, --ray-num-cpus, --ray-strategy, ...)."""

    address: str | None = None       # join this cluster (host:port, ray://host:port, "auto"); None: start one
    num_cpus: int = 0                # local Ray: logical CPUs (0: max(nproc * cpus_per_worker, os.cpu_count()))
    cpus_per_worker: float = 1.0
    strategy: str = "PACK"           # placement of the workers: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    max_failures: int = 0            # FailureConfig(max_failures=K): group restarts after a worker failure
    storage_path: str | None = None  # where Ray Train keeps reported checkpoints (None: a temporary directory)
    log_to_driver: bool = True


STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def require_ray():
    """The ``ray`` module, or ConfigError (one line, exit 2) saying how to install the extra."""
    try:
        import ray
        import ray.train.torch  # noqa: F401  (the train extra)
    except ImportError:
        raise ConfigError("--launcher", INSTALL) from None
    return ray


def check_address(address: str | None, timeout_s: float = 3.0) -> None:
    """Fail within seconds, naming the address, when nothing listens at ``--ray-address``
    (``ray.init`` itself retries for a long time). ``auto`` and a missing port are left to Ray."""
    if not address or address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--ray-address", f"expected HOST:PORT or ray://HOST:PORT, got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError("--ray-address", f"no Ray cluster reachable at {address} ({e}); start one with "
                                           "`ray start --head` or drop --ray-address for a local Ray") from None


def check_options(opts: RayOptions, nproc: int) -> None:
    if opts.strategy not in STRATEGIES:
        raise ConfigError("--ray-strategy", f"must be one of {', '.join(STRATEGIES)}, got {opts.strategy!r}")
    if opts.cpus_per_worker <= 0:
        raise ConfigError("--ray-cpus-per-worker", f"must be > 0, got {opts.cpus_per_worker}")
    if opts.num_cpus < 0:
        raise ConfigError("--ray-num-cpus", f"must be >= 1 (or 0 for the default), got {opts.num_cpus}")
    at_least(opts.max_failures, 0, "--max-restarts")
    at_least(nproc, 1, "--nproc")


def local_cpus(opts: RayOptions, nproc: int) -> int:
    """The logical CPUs of the local Ray this launch starts; ConfigError (before anything starts)
    when --ray-num-cpus cannot hold nproc workers (Ray Train would wait for them forever)."""
    need = nproc * opts.cpus_per_worker
    if opts.num_cpus and opts.num_cpus < need:
        raise ConfigError("--ray-num-cpus", f"{opts.num_cpus} CPU(s) cannot hold {nproc} workers of "
                                            f"{opts.cpus_per_worker:g} CPU(s) each; pass --ray-num-cpus "
                                            f"{math.ceil(need)} or more, or a smaller --ray-cpus-per-worker")
    return opts.num_cpus or max(math.ceil(need), os.cpu_count() or 1)


def ensure_ray(opts: RayOptions, nproc: int) -> bool:
    """Join ``opts.address``, or start a local Ray of our own (``address="local"``: never a cluster
    already running here or named by RAY_ADDRESS, whose CPUs cannot be set); True when this call
    started or joined it (the caller shuts it down). A failure is one line (ConfigError). Ray's
    driver replaces the SIGTERM handler (cli.py's, which stops the ranks): it is put back."""
    ray = require_ray()
    check_address(opts.address)
    if ray.is_initialized():
        return False
    cpus = None if opts.address else local_cpus(opts, nproc)
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        if opts.address:
            ray.init(address=opts.address, log_to_driver=opts.log_to_driver)
        else:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=150 * 2 ** 20,
                     log_to_driver=opts.log_to_driver)
    except Exception as e:
        if ray.is_initialized():
            ray.shutdown()
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        if opts.address:
            raise ConfigError("--ray-address", f"could not connect to Ray at {opts.address} ({why}); start one with "
                                               "`ray start --head` or drop --ray-address for a local Ray") from None
        raise ConfigError("--launcher", f"could not start a local Ray ({why})") from None
    finally:
        if main and before is not None:
            signal.signal(signal.SIGTERM, _chained(before) if callable(before) else before)
    return True


_RAISED: list = []  # the exception shardlab's SIGTERM handler raised (cli.Terminated), once raised


def _chained(handler):
    """``handler`` (cli.py's: raises Terminated), remembering what it raised: Ray turns an exception
    raised by a signal handler inside ``ray.get`` into a plain KeyboardInterrupt (Ctrl-C's path)."""
    def on_signal(signum, frame):
        try:
            handler(signum, frame)
        except BaseException as e:
            _RAISED[:] = [e]
            raise
    return on_signal


def run(fn, nproc: int, *args, device: str = "cpu", timeout_s: float = 60.0, threads: int = 0,
        opts: RayOptions | None = None, report_checkpoints: bool = False, plan=None):
    """Run ``fn(ctx, *args)`` on ``nproc`` Ray Train workers; rank 0's return value in a one-item list
    (the other ranks' values stay on their workers). A worker's failure that Ray does not recover
    from raises launch.WorkerError naming its rank."""
    opts = opts or RayOptions()
    check_options(opts, nproc)
    started = ensure_ray(opts, nproc)
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from .launch import choose_backend, default_threads, mmap_threshold
    from .launch_report import close_dump_dir
    use_gpu = choose_backend(device, 1)[1] == "cuda" if device != "auto" else _cluster_has_gpus()
    backend = "nccl" if use_gpu else "gloo"
    storage = opts.storage_path or tempfile.mkdtemp(prefix="shardlab-ray-")
    name = f"shardlab-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    import ray
    from .distributed import flight
    dump_dir = flight.new_dump_dir()  # each rank dumps its flight recorder here (as under launch.run)
    mailbox = ray.remote(num_cpus=0)(Mailbox).remote()  # rank 0's return value comes back through it
    loop_config = {"mailbox": mailbox, "fn": flight.wrap(fn, dump_dir), "args": args, "threads": threads or default_threads(nproc), "use_gpu": use_gpu,
                   "plan": plan, "report": report_checkpoints, "mmap": mmap_threshold(), "max_restarts": opts.max_failures,
                   "run_storage": str(Path(storage).resolve() / name)}
    trainer = TorchTrainer(
        _worker, train_loop_config=loop_config,
        torch_config=TorchConfig(backend=backend, timeout_s=int(timeout_s)),
        scaling_config=ScalingConfig(num_workers=nproc, use_gpu=use_gpu, placement_strategy=opts.strategy,
                                     resources_per_worker={"CPU": opts.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}),
        # a worker group that cannot start (too few CPUs) fails after Ray Train's start timeout,
        # retried as often as a worker failure, instead of Ray's default: forever
        run_config=RunConfig(name=name, storage_path=str(Path(storage).resolve()),
                             failure_config=FailureConfig(max_failures=opts.max_failures,
                                                          controller_failure_limit=opts.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    ok, failure = False, None
    try:
        trainer.fit()
        ok = True
        return [pickle.loads(ray.get(mailbox.get.remote()))]
    except KeyboardInterrupt as e:  # SIGTERM's Terminated comes out of Ray as a KeyboardInterrupt
        raised = _RAISED.pop() if _RAISED else e
        raise raised from None
    except Exception as e:
        _refuse_if_not_started(e, nproc, opts)
        failure = _as_worker_error(e)
        flight.diagnose_failure(failure, dump_dir, nproc)  # the workers have ended: their dumps are final
        raise failure from None
    finally:
        close_dump_dir(dump_dir, ok, failure)  # kept (and named) only when it holds dumps
        ray.kill(mailbox)
        if not opts.storage_path:
            shutil.rmtree(storage, ignore_errors=True)
        if started:
            ray.shutdown()


def _refuse_if_not_started(e: Exception, nproc: int, opts: RayOptions) -> None:
    """Ray Train's worker group start timed out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by
    default): the cluster cannot place the workers. One line (ConfigError), not Ray's error."""
    cause = getattr(e, "controller_failure", None)
    if type(cause).__name__ != "WorkerGroupStartupTimeoutError":
        return
    import ray
    have = ray.cluster_resources().get("CPU", 0)
    raise ConfigError("--nproc", f"Ray could not start {nproc} workers of {opts.cpus_per_worker:g} CPU(s) each "
                                 f"(the cluster has {have:g} CPUs; Ray Train gave up waiting); lower --nproc or "
                                 "--ray-cpus-per-worker, or add nodes") from None


def _cluster_has_gpus() -> bool:
    import ray
    return ray.cluster_resources().get("GPU", 0) > 0


def _as_worker_error(e: Exception):
    """Ray's TrainingFailedError -> launch.WorkerError of the first failing rank, its root error
    first (``ConfigError: ...`` stays one line through the CLI). An error with no worker's failure
    in it (the driver's own: Ray's storage, a signal in ``fit``) is the launcher's, not rank 0's."""
    from .launch import WorkerError
    failures = getattr(e, "worker_failures", None)
    if not failures:
        return WorkerError(None, f"{type(e).__name__}: {e}")
    rank = min(failures)
    err = failures[rank]
    cause = getattr(err, "cause", None) or err
    text = str(cause)
    first = f"{type(cause).__name__}: {text}" if not text.startswith(type(cause).__name__) else text
    out = WorkerError(rank, first)
    code = getattr(cause, "code", None)  # ScriptFailed: the script's exit status
    out.exit_code = code if isinstance(code, int) and isinstance(cause, ScriptFailed) else None
    return out


def _worker(config: dict) -> None:
    """One Ray Train worker: the rank's context from Ray Train, then the launcher's function."""
    import ray.train
    import torch
    import torch.distributed as dist
    from . import launch
    tc = ray.train.get_context()
    rank, world, local_rank = tc.get_world_rank(), tc.get_world_size(), tc.get_local_rank()
    plan = config["plan"]
    attempt = ray.get(config["mailbox"].start.remote(rank))  # Ray Train's group restarts before this start
    launch._arm_test_hooks(rank, plan.test_hooks if plan else {})
    launch.set_mmap_threshold(config["mmap"])  # as launch._init does for a local rank
    torch.set_num_threads(config["threads"])
    if config["use_gpu"]:
        import ray.train.torch
        device = ray.train.torch.get_device()
    else:
        device = torch.device("cpu")
    on_ckpt = reporter(rank) if config["report"] else None
    restored = ray.train.get_checkpoint()
    on_disk = newest_reported(config["run_storage"])
    if on_disk is not None and (restored is None or step_of(on_disk) > step_of(restored.path)):
        restored = ray.train.Checkpoint.from_directory(str(on_disk))
    # local storage: the directory itself, else a download; it replaces the plan's resume checkpoint
    with restored.as_directory() if restored is not None else nullcontext() as path:
        if path is not None and plan is not None:
            plan = replace(plan, resume_from=Path(path))
        if plan is not None and attempt:
            plan = replace(plan, restarts=attempt, resume_step=step_of(path) if path is not None else 0)
            if rank == 0:
                from .launch_restart import record_restart
                record_restart(plan, config["max_restarts"], "a Ray worker", "Ray Train restarted the worker group",
                               world)
        ctx = launch.RankContext(rank, world, local_rank, device, dist.get_backend(), plan, on_ckpt,
                                 restart_count=attempt, max_restarts=config["max_restarts"])
        with plain_print():
            result = config["fn"](ctx, *config["args"])
    if rank == 0:
        ray.get(config["mailbox"].put.remote(pickle.dumps(result)))


# -- command line (shardlab train / shardlab launch) ----------------------------------------------

def add_flags(parser) -> None:
    parser.add_argument("--launcher", choices=["local", "ray"], default="local",
                        help="local: spawn the ranks here; ray: run them as Ray Train workers (docs/ray.md)")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="with --launcher ray: join this Ray cluster (HOST:PORT, ray://HOST:PORT or auto) "
                             "instead of starting a local Ray")
    parser.add_argument("--ray-num-cpus", type=int, default=0, metavar="N",
                        help="local Ray only (not with --ray-address): logical CPUs, at least nproc * cpus per "
                             "worker (default: max(nproc * cpus per worker, CPU count))")
    parser.add_argument("--ray-cpus-per-worker", type=float, default=1.0, metavar="C",
                        help="CPUs reserved for each worker (default 1)")
    parser.add_argument("--ray-strategy", default="PACK", choices=list(STRATEGIES),
                        help="placement of the workers on the cluster's nodes (default PACK)")


def options(args, max_failures: int, storage_path: str | None, nproc: int = 1) -> RayOptions | None:
    """The RayOptions of ``--launcher ray`` (None for the local launcher); checks that Ray is
    installed, the address reachable and a local Ray's CPUs enough for ``nproc`` workers before
    anything starts. Ray flags without it are refused, and --ray-num-cpus with --ray-address."""
    if args.launcher != "ray":
        given = [f for f, v in (("--ray-address", args.ray_address), ("--ray-num-cpus", args.ray_num_cpus),
                                ("--ray-cpus-per-worker", args.ray_cpus_per_worker != 1.0),
                                ("--ray-strategy", args.ray_strategy != "PACK")) if v]
        if given:
            raise ConfigError(given[0], "applies only with --launcher ray")
        return None
    require_ray()
    opts = RayOptions(address=args.ray_address, num_cpus=args.ray_num_cpus, cpus_per_worker=args.ray_cpus_per_worker,
                      strategy=args.ray_strategy, max_failures=max_failures, storage_path=storage_path)
    if opts.address and opts.num_cpus:
        raise ConfigError("--ray-num-cpus", "sets the CPUs of a local Ray only; a cluster joined with --ray-address "
                                            "has its own (set at `ray start --num-cpus`): drop one of the two")
    check_options(opts, nproc)
    if not opts.address:
        local_cpus(opts, nproc)
    check_address(opts.address)
    return opts


# -- shardlab launch --launcher ray: a script as N Ray Train workers ------------------------------

def run_script(ctx, argv: list[str], cwd: str | None = None) -> int:
    """In a Ray Train worker: ``python argv...`` with torchrun's environment for this rank (rank 0's
    node address and a free port there, shared over Ray Train's process group), in ``cwd`` (the
    directory ``shardlab launch`` ran in, where this node has it: Ray workers start elsewhere, and
    the script and its relative paths mean what they mean locally). The child dies with the
    worker (Linux). A non-zero exit raises, so Ray counts a worker failure."""
    import subprocess
    import sys
    import torch.distributed as dist
    from . import launch
    addr = [None]
    if ctx.rank == 0:
        import ray.util
        addr = [(ray.util.get_node_ip_address(), launch.free_port())]
    dist.broadcast_object_list(addr, src=0)
    host, port = addr[0]
    env = launch.torchrun_env(ctx.rank, ctx.world_size, port)
    env.update(MASTER_ADDR=host, LOCAL_RANK=str(ctx.local_rank), TORCHELASTIC_RESTART_COUNT=str(ctx.restart_count),
               TORCHELASTIC_MAX_RESTARTS=str(ctx.max_restarts))
    setup = launch.set_pdeathsig if sys.platform.startswith("linux") else None
    code = subprocess.call([sys.executable, *argv], env=env, preexec_fn=setup,
                           cwd=cwd if cwd and os.path.isdir(cwd) else None)
    if code != 0:
        raise ScriptFailed(f"script {argv[0]} failed on rank {ctx.rank} ({launch.exit_how(code)})", code)
    return 0
