"""What ``deepspeed.initialize``'s callers pass and get back, for ``shardlab.initialize``
(docs/api.md, A DeepSpeed script unchanged): the ``args`` namespace (``--deepspeed_config``,
``local_rank``), ``config_params``, ``training_data`` / ``collate_fn`` and DeepSpeed's data loader,
the four values ``engine, optimizer, training_dataloader, lr_scheduler``, DeepSpeed's engine
accessors (:class:`DeepSpeedAccessors`), ``add_config_arguments`` and ``init_distributed``."""
from __future__ import annotations

from .errors import ConfigError

DROP_LAST = "dataloader_drop_last"
"""The DeepSpeed key that shapes ``training_data``'s loader (DeepSpeed's default: false)."""


def config_from_args(args, config, config_params):
    """The config DeepSpeed would read: ``config``, else ``config_params`` (its older name), and
    ``args.deepspeed_config`` (or the deprecated ``args.deepscale_config``) when neither is given;
    both a file in ``args`` and one in the call is refused, as DeepSpeed refuses it."""
    if config is None:
        config = config_params
    given = None
    for name in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, name, None)
        if value is not None:
            if given is not None:
                raise ConfigError(f"args.{name}", f"both args.{given[0]} and args.{name} are set; keep one")
            given = (name, value)
    if given is not None:
        if config is not None:
            raise ConfigError(f"args.{given[0]}", "a config is given both in args and as config=; pass one "
                                                  "(DeepSpeed refuses the pair too)")
        config = given[1]
    return config


def refuse_model_parallel(mpu, mesh_param) -> None:
    """DeepSpeed's model-parallel hooks: a user model has no tensor / sequence plan here."""
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ConfigError(name, "shardlab.initialize trains a user model data-parallel only; leave it None "
                                    "(shardlab's own models take tensor / sequence parallel from parallel.tp / cp)")


def is_scheduler(x) -> bool:
    """A scheduler object (built on an optimizer), as opposed to a factory taking one."""
    return hasattr(x, "optimizer") and hasattr(x, "step")


def set_local_rank(args, local_rank: int) -> None:
    """As DeepSpeed does: ``args.local_rank``, where the namespace has one, is this rank's."""
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local_rank


def data_loader(dataset, batch_size: int, rank: int, world: int, collate_fn=None, drop_last: bool = False):
    """DeepSpeed's training loader (``DeepSpeedDataLoader`` on a launched rank): a
    ``DistributedSampler`` over the data-parallel ranks with its defaults (shuffled, seed 0, the
    same order every epoch unless you call ``loader.data_sampler.set_epoch``), ``batch_size``
    samples per rank, ``dataloader_drop_last`` for the last short batch. Loaded in this process
    (DeepSpeed starts 2 workers per rank; the batches are the same)."""
    from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset) or not hasattr(dataset, "__len__"):
        raise ConfigError("training_data", f"expected a map-style torch Dataset (with __len__), got "
                          f"{type(dataset).__name__}; an IterableDataset cannot be split by DistributedSampler: "
                          "shard it yourself and iterate it")
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError("collate_fn", f"expected a callable, got {type(collate_fn).__name__}")
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
    loader.data_sampler = sampler  # DeepSpeedDataLoader's name for it
    return loader


def drop_last_of(ds: dict | None) -> bool:
    """``dataloader_drop_last`` of a DeepSpeed JSON (False when absent or not DeepSpeed's)."""
    value = (ds or {}).get(DROP_LAST, False)
    if not isinstance(value, bool):
        raise ConfigError(DROP_LAST, f"got {value!r}; must be true or false")
    return value


class ConfigSchedule:
    """What DeepSpeed returns as ``lr_scheduler`` when the config holds the schedule: the engine
    sets each step's lr (``engine.step`` advances it), this reads it."""

    def __init__(self, engine):
        self._engine = engine

    def get_last_lr(self) -> list[float]:
        """Each param group's lr for the next optimizer step, as DeepSpeed's scheduler reports it
        (stepped after each applied optimizer step)."""
        return self._engine.get_lr()

    get_lr = get_last_lr

    def step(self, *_, **__) -> None:
        raise ConfigError("lr_scheduler", "this schedule comes from the config and engine.step() advances it; "
                                          "remove this call (in DeepSpeed it would advance the schedule twice a step)")

    def state_dict(self) -> dict:
        return {}  # the schedule is a function of engine.global_steps, saved with every checkpoint

    def load_state_dict(self, state: dict) -> None:
        pass


def returned(engine) -> tuple:
    """``engine, optimizer, training_dataloader, lr_scheduler`` as ``deepspeed.initialize``
    returns them (the scheduler: yours, a view of the config's schedule, or None for a constant lr)."""
    sched, t = engine.lr_scheduler, engine.cfg.train
    constant = t.lr_schedule == "cosine" and t.warmup_steps == 0 and t.min_lr_ratio == 1.0  # a JSON without one
    if sched is None and engine._schedule and not constant:
        sched = ConfigSchedule(engine)
    return engine, engine.optimizer, engine.training_dataloader, sched



class DeepSpeedAccessors:
    """Mixed into api.ModelEngine: DeepSpeed's engine methods that read the configuration and the
    last step (uses ``cfg``, ``accumulation``, ``world_size``, ``global_rank``, ``last_overflow``,
    ``last_nonfinite``, ``grad_norm``, ``optimizer``, ``lr_scheduler``, ``training_dataloader``)."""

    def __iter__(self):
        """``engine, optimizer, training_dataloader, lr_scheduler = shardlab.initialize(...)``, as
        ``deepspeed.initialize`` returns them (:func:`returned`)."""
        return iter(returned(self))

    def compile(self, backend="inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` the whole module in place
        (``module.compile(backend=..., **compile_kwargs)``; ``parallel.compile = true`` calls it
        from initialize). shardlab's communication inside it (ZeRO-3's gather / free hooks)
        runs eagerly between the compiled graphs (distributed/eager.py). Once per engine."""
        if schedule is not None:
            raise ConfigError("schedule", "is DeepSpeed's DeepCompile pass schedule; shardlab compiles the module "
                                          "with plain torch.compile; leave it None")
        if compiled_autograd_enabled:
            raise ConfigError("compiled_autograd_enabled", "compiled autograd is not supported by shardlab's "
                                                           "gradient hooks; leave it False")
        if self.is_compiled:
            return
        from .distributed.eager import prepare
        prepare()
        self.module.compile(**{**(compile_kwargs or {}), "backend": backend})
        self.is_compiled = True

    def deepspeed_io(self, dataset, batch_size: int | None = None, collate_fn=None, drop_last: bool = False):
        """DeepSpeed's loader of ``dataset`` for this rank (:func:`data_loader`); ``batch_size``
        defaults to the micro-batch."""
        return data_loader(dataset, batch_size or self.train_micro_batch_size_per_gpu(), self.global_rank,
                           self.world_size, collate_fn, drop_last)

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch per rank: train.global_batch / (accumulation * ranks)."""
        return self.cfg.train.global_batch // (self.accumulation * self.world_size)

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def train_batch_size(self) -> int:
        return self.cfg.train.global_batch

    def zero_optimization_stage(self) -> int:
        return self.cfg.parallel.zero_stage

    def bfloat16_enabled(self) -> bool:
        """bf16 autocast (DeepSpeed's ``bf16.enabled``); the weights stay fp32 here, so inputs cast
        to bf16 (as DeepSpeed's examples do when this is true) meet autocast, not bf16 weights."""
        return self.cfg.train.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.cfg.train.precision == "fp16"

    def was_step_applied(self) -> bool:
        """False when the last step was skipped (fp16 overflow, or a non-finite gradient)."""
        return not (self.last_overflow or self.last_nonfinite)

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm over all ranks at the last step, before clipping (None before one)."""
        return self.grad_norm


def add_config_arguments(parser):
    """``deepspeed.add_config_arguments``: DeepSpeed's argument group (``--deepspeed``,
    ``--deepspeed_config``, and the deprecated ``--deepscale`` / ``--deepscale_config``) on
    ``parser``, which is returned; ``initialize(args=...)`` reads ``deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by shardlab.initialize)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="a flag for your own code (no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated name of --deepspeed_config")
    return parser


def init_distributed(dist_backend: str | None = None, timeout=None, **_) -> None:
    """``deepspeed.init_distributed``: join the job the launcher started (torchrun / ``shardlab
    launch`` / already initialised / a world of one), as ``initialize`` does; a later
    ``initialize`` uses it. ``dist_backend``: ``nccl`` (one GPU a rank) or ``gloo`` (the CPU);
    DeepSpeed's other arguments (MPI discovery, port, ...) are accepted and unused."""
    from .launch import init_from_env
    if dist_backend not in (None, "nccl", "gloo"):
        raise ConfigError("dist_backend", f"got {dist_backend!r}; use nccl (GPUs), gloo (CPU) or None")
    device = {"nccl": "cuda", "gloo": "cpu"}.get(dist_backend, "auto")
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else (timeout or 600.0)
    init_from_env(device, float(seconds))
