"""What ``deepspeed.initialize``'s callers pass and get back, for ``shardlab.initialize``
(docs/deepspeed.md, A DeepSpeed script unchanged): the ``args`` namespace (``--deepspeed_config``,
``local_rank``), ``config_params``, ``optimizer=`` as DeepSpeed takes it (:func:`client_optimizer`),
what the engine reads of the JSON itself (:func:`json_settings`), ``training_data`` /
``collate_fn`` and DeepSpeed's data loader, the four values ``engine, optimizer,
training_dataloader, lr_scheduler``, DeepSpeed's engine members (:class:`DeepSpeedAccessors`:
accessors, ``deepspeed_io``, ``no_sync``, ``zero_grad``, the ``steps_per_print`` line),
``add_config_arguments`` and ``init_distributed``."""
from __future__ import annotations

from contextlib import contextmanager

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


def client_optimizer(optimizer, model, model_parameters, cfg, device):
    """DeepSpeed's ``_configure_optimizer``: None -> AdamW from the config (``train.optim``); a
    class or a factory is called as DeepSpeed calls it, ``optimizer(model_parameters)`` (default
    ``list(model.parameters())``) and nothing else, and what it returns is kept as an object is;
    an object is kept and ``model_parameters`` ignored, as DeepSpeed ignores them. Returns
    (build(param_groups) -> optimizer, whether the config's lr schedule applies, the kept
    optimizer's groups (trainable parameters only) or None)."""
    import inspect
    import torch
    from .train.optim import build_adamw
    if optimizer is None:
        return build_adamw(cfg.train, device), True, None
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        made = optimizer(list(model.parameters() if model_parameters is None else model_parameters))
        if not isinstance(made, torch.optim.Optimizer):
            what = "class" if inspect.isclass(optimizer) else "factory"
            raise ConfigError("optimizer", f"the {what} returned {type(made).__name__}, not a torch optimizer; it is "
                                           "called as DeepSpeed calls it, optimizer(model_parameters)")
        optimizer = made
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("optimizer", f"expected None, a torch optimizer (object or class) or a factory taking "
                                       f"model_parameters, got {type(optimizer).__name__}")
    # A ready optimizer holds the unsharded parameters. As DeepSpeed does, the same object is kept
    # and its groups refilled with the engine's (possibly sharded) tensors, each group's settings
    # (weight decay, lr, a scheduler's initial_lr) on exactly its parameters: your scheduler built
    # on it, and lr you set in its param_groups, act on the engine's step.
    if optimizer.state:
        raise ConfigError("optimizer", f"this {type(optimizer).__name__} has already stepped (it has state); "
                          "pass a fresh one, its class or a factory taking model_parameters")
    cfg.train.weight_decay = float(optimizer.defaults.get("weight_decay", 0.0))
    given = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in optimizer.param_groups]

    def refill(groups):
        optimizer.param_groups.clear()
        for g in groups:
            optimizer.add_param_group(g)
        return optimizer
    return refill, False, [g for g in given if g["params"]]  # frozen parameters: no gradient, never stepped


def json_settings(ds: dict | None, optimizer) -> tuple[dict | None, dict]:
    """What the engine itself reads of a DeepSpeed JSON (None: a shardlab config): the config
    left for ``translate`` (without ``dataloader_drop_last`` and a static ``fp16.loss_scale``,
    which only ``shardlab.initialize`` implements) and ``{drop_last, steps_per_print,
    loss_scale, static_scale, optimizer_name, scheduler}`` as DeepSpeed's accessors answer them."""
    name = optimizer.__class__.__name__ if optimizer is not None else "adamw"  # DeepSpeed's optimizer_name()
    out = {"drop_last": False, "steps_per_print": None, "loss_scale": 0, "static_scale": 0.0,
           "optimizer_name": name, "scheduler": False}
    if ds is None:
        return None, out
    config = {k: v for k, v in ds.items() if k != DROP_LAST}
    fp16 = ds.get("fp16") if isinstance(ds.get("fp16"), dict) else {}
    scale = fp16.get("loss_scale", 0)
    if scale != "auto":
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale < float("inf"):
            raise ConfigError("fp16.loss_scale", f"must be 0 (dynamic) or a positive static scale, got {scale!r}")
        out["loss_scale"] = scale
        if scale > 0 and fp16.get("enabled") is True:
            out["static_scale"] = float(scale)
            config["fp16"] = {k: v for k, v in fp16.items() if k != "loss_scale"}
    spp = ds.get("steps_per_print")
    block = ds.get("optimizer") if isinstance(ds.get("optimizer"), dict) else {}
    out.update(drop_last=drop_last_of(ds), steps_per_print=None if spp == "auto" else spp,
               scheduler=bool(ds.get("scheduler")))
    if optimizer is None:  # the JSON block's type, lower-cased as DeepSpeed's config does; None without one
        out["optimizer_name"] = block["type"].lower() if isinstance(block.get("type"), str) else None
    return config, out


ROUTES = ("train", "eval", "predict", "encode")
"""``deepspeed_io``'s routes (DeepSpeed's constants): eval and predict read in order."""


def data_loader(dataset, batch_size: int, rank: int, world: int, collate_fn=None, drop_last: bool = False, *,
                sampler=None, shuffle: bool = True, pin_memory: bool = False, workers: int = 0,
                field: str = "training_data"):
    """DeepSpeed's loader (``DeepSpeedDataLoader`` on a launched rank): ``sampler``, else a
    ``DistributedSampler`` over the data-parallel ranks with its defaults (seed 0, the same order
    every epoch unless you call ``loader.data_sampler.set_epoch``; ``shuffle=False`` for the eval
    and predict routes), ``batch_size`` samples per rank, ``dataloader_drop_last`` for the last
    short batch. ``workers`` loader processes (0: loaded in this process; DeepSpeed starts 2 per
    rank by default, the batches are the same)."""
    from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset) or not hasattr(dataset, "__len__"):
        raise ConfigError(field, f"expected a map-style torch Dataset (with __len__), got "
                          f"{type(dataset).__name__}; an IterableDataset cannot be split by DistributedSampler: "
                          "shard it yourself and iterate it")
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError("collate_fn", f"expected a callable, got {type(collate_fn).__name__}")
    for name, value, low in (("batch_size", batch_size, 1), ("num_local_io_workers", workers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")
    if sampler is None:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                        pin_memory=pin_memory, num_workers=workers)
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
        return {}  # the schedule's own step count is in every checkpoint (api_checkpoint.py)

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
    last step (uses ``cfg``, ``settings`` (:func:`json_settings`), ``accumulation``,
    ``world_size``, ``global_rank``, ``global_steps``, ``skipped_steps``, ``grad_norm``,
    ``optimizer``, ``lr_scheduler``, ``module``, ``collate_fn``, and the step's flags
    ``_step_applied``, ``_no_sync``, ``_boundary``, ``_last_loss``)."""

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

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None):
        """DeepSpeed's loader of ``dataset`` for this rank (:func:`data_loader`), with its
        arguments: ``batch_size`` (default the micro-batch), ``route`` (``eval`` / ``predict``:
        in order), ``data_sampler`` (yours instead of the DistributedSampler), ``collate_fn``
        (default initialize's), ``num_local_io_workers`` (default 0: in this process),
        ``pin_memory`` (on CUDA); the JSON's ``dataloader_drop_last``."""
        if route not in ROUTES:
            raise ConfigError("route", f"got {route!r}; use one of {', '.join(ROUTES)} (DeepSpeed's routes)")
        return data_loader(dataset, self.train_micro_batch_size_per_gpu() if batch_size is None else batch_size,
                           self.global_rank, self.world_size, self.collate_fn if collate_fn is None else collate_fn,
                           self.dataloader_drop_last(), sampler=data_sampler, shuffle=route not in ("eval", "predict"),
                           pin_memory=bool(pin_memory) and self.device.type == "cuda",
                           workers=0 if num_local_io_workers is None else num_local_io_workers, field="dataset")

    def dataloader_drop_last(self) -> bool:
        """The JSON's ``dataloader_drop_last`` (False without one)."""
        return self.settings["drop_last"]

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch per rank: train.global_batch / (accumulation * ranks)."""
        return self.cfg.train.global_batch // (self.accumulation * self.world_size)

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def train_batch_size(self) -> int:
        return self.cfg.train.global_batch

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch from the same micro-batch, by the accumulation steps."""
        per = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1 \
                or train_batch_size % per:
            raise ConfigError("train_batch_size", f"{train_batch_size!r} is not a multiple of micro batch * ranks = "
                                                  f"{per} (DeepSpeed raises a ValueError too)")
        self.accumulation = self.cfg.parallel.microbatches = train_batch_size // per
        self.cfg.train.global_batch = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch, the same accumulation steps (the global batch follows)."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ConfigError("micro_batch_size", f"must be a positive integer, got {micro_batch_size!r}")
        self.cfg.train.global_batch = micro_batch_size * self.accumulation * self.dp_world_size

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    def zero_optimization_stage(self) -> int:
        return self.cfg.parallel.zero_stage

    def bfloat16_enabled(self) -> bool:
        """bf16 autocast (DeepSpeed's ``bf16.enabled``); the weights stay fp32 here, so inputs cast
        to bf16 (as DeepSpeed's examples do when this is true) meet autocast, not bf16 weights."""
        return self.cfg.train.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.cfg.train.precision == "fp16"

    def loss_scale(self):
        """DeepSpeed's: the JSON's static ``fp16.loss_scale`` (0: dynamic scaling; the current
        scale is ``engine.scaler.scale``)."""
        return self.settings["loss_scale"]

    def gradient_clipping(self) -> float:
        return self.cfg.train.grad_clip

    def steps_per_print(self):
        """The JSON's ``steps_per_print`` (None without one, DeepSpeed's default)."""
        return self.settings["steps_per_print"]

    def optimizer_name(self):
        """DeepSpeed's: the class name of the ``optimizer=`` you passed (``type`` for a class,
        ``function`` for a factory, as DeepSpeed's ``__class__.__name__``), else the JSON block's
        type lower-cased (None without a block; ``adamw`` under a shardlab config)."""
        return self.settings["optimizer_name"]

    def get_mom(self) -> list:
        """Each param group's ``momentum`` (SGD, RMSprop) or ``betas`` (others), 0.0 where absent."""
        key = "momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas"
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` changed the parameters: False between accumulation
        boundaries and after a skipped step (fp16 overflow, or a non-finite gradient)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm over all ranks at the last step, before clipping (None before one)."""
        return self.grad_norm

    @contextmanager
    def no_sync(self):
        """DeepSpeed's: backward passes inside do not reduce gradients (they accumulate on this
        rank until a backward outside); ``step()`` inside is refused, and so is the context under
        ZeRO-2/3, whose gradient partitioning needs the reduction, and its re-entry, as in DeepSpeed."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise ConfigError("no_sync", f"is incompatible with ZeRO stage {stage}'s gradient partitioning (DeepSpeed "
                                         "refuses it too); accumulate with gradient_accumulation_steps instead")
        if self._no_sync:
            raise ConfigError("no_sync", "is already active; re-entry is refused (as in DeepSpeed)")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: from now on the boundary is ``is_boundary`` (not the micro-step count), so a
        loop may call ``step()`` once after its last backward."""
        self._boundary = bool(is_boundary)

    def zero_grad(self) -> None:
        """DeepSpeed's: the module's parameters' ``.grad`` set to None (under DDP what the
        micro-batches so far accumulated is dropped; ZeRO's gradient shards, like DeepSpeed's
        partitions, are the engine's and untouched)."""
        for p in self.module.parameters():
            p.grad = None

    def report_progress(self) -> None:
        """Rank 0, every ``steps_per_print`` optimizer steps, DeepSpeed's progress line (its
        ``step=, skipped=, lr=, mom=``) and the loss of rank 0's last micro-batch."""
        every = self.steps_per_print()
        if every and self.global_rank == 0 and self.global_steps % every == 0:
            loss = "" if self._last_loss is None else f", loss={float(self._last_loss):.6g}"
            print(f"[shardlab] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                  f"mom={self.get_mom()}{loss}", flush=True)


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
