"""``shardlab.initialize``: any ``nn.Module`` trained data-parallel, in the spirit of ``deepspeed.initialize``.

    engine = shardlab.initialize(model, config="ds_config.json")   # or a shardlab dict / TOML / Config
    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()           # an optimizer step every gradient_accumulation_steps micro-batches

The model is one shardlab has never seen (no ModelSpec), so only the data-parallel layouts apply:
DDP (``zero_stage`` 0), ZeRO-1/2 and ZeRO-3/FSDP (units from ``parallel.wrap_policy``: ``size:<N>``
or ``class:<Name>``; ``blocks``, the default: the model's repeated blocks and the modules outside
them as large as one, parallel/units.py ``block_units``), over all ranks of the job. The job is joined
through ``launch.init_from_env`` (torchrun / ``shardlab launch`` / an initialised torch.distributed /
a world of one). The Mesh lives in the engine; nothing is global. Docs: docs/api.md.
"""
from __future__ import annotations

import copy
import json
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from . import config as C
from .config.deepspeed import is_deepspeed, resolve_batch, translate, uniform_peak
from .errors import ConfigError
from .distributed.mesh import Mesh
from .distributed.topology import Topology
from .api_checkpoint import EngineCheckpoints
from .api_deepspeed import DeepSpeedAccessors, is_scheduler, json_settings
from .api_model import check_user_config, compile_blocks, recompute_blocks, tag_groups
from .train.groups import regroup, user_groups
from .train.optim import LossScaler, autocast_factory, decay_rule, lr_at, optimizer_step

__all__ = ["initialize", "ModelEngine", "resolve_config"]


def _read(config):
    """-> ("shardlab", Config) or ("deepspeed", dict)."""
    if config is None:
        return "shardlab", C.Config()
    if isinstance(config, C.Config):
        return "shardlab", copy.deepcopy(config)
    if isinstance(config, (str, Path)):
        p = Path(config)
        if p.suffix == ".json" and p.exists():
            try:
                data = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(str(p), f"cannot parse: {e}") from None
            if isinstance(data, dict) and is_deepspeed(data, C.SECTIONS):
                return "deepspeed", data
        return "shardlab", C.load(p)
    if isinstance(config, dict):
        if is_deepspeed(config, C.SECTIONS):
            return "deepspeed", dict(config)
        return "shardlab", C.from_dict(copy.deepcopy(config))
    raise ConfigError("config", f"expected a dict, a path or a shardlab Config, got {type(config).__name__}")


def resolve_config(config, world_size: int) -> C.Config:
    """The shardlab Config that ``initialize`` runs for ``world_size`` ranks (DeepSpeed batch
    rules applied with the real world size; all ranks data-parallel). Raises ConfigError."""
    kind, data = _read(config)
    if kind == "deepspeed":
        ds = resolve_batch(data, world_size)
        cfg = C.from_dict(translate(ds))
        # DeepSpeed's activation_checkpointing section configures the deepspeed.checkpointing calls in
        # the model's own code: it recomputes nothing by itself (shardlab train maps it to full)
        cfg.parallel.activation_checkpointing = "none"
    else:
        cfg = data
    C.check_ranges(cfg)  # every field within its declared range (config/schema.py), as validate() does
    p = cfg.parallel
    check_user_config(cfg)
    if p.dp not in (1, world_size):
        raise ConfigError("parallel.dp_shard", f"dp_replicate * dp_shard = {p.dp} but the job has {world_size} "
                          "ranks; leave both at 1 (all ranks are data-parallel)")
    p.dp_replicate, p.dp_shard = 1, world_size
    from .parallel.zero import check_config
    check_config(cfg)
    return cfg


def initialize(model: nn.Module = None, config=None, optimizer=None, lr_scheduler=None, model_parameters=None, *,
               args=None, training_data=None, collate_fn=None, config_params=None, dist_init_required=None,
               distributed_port=None, mpu=None, mesh_param=None) -> "ModelEngine":
    """Wrap ``model`` for data-parallel training on every rank of this job (collective).
    Returns the engine, which also unpacks as ``deepspeed.initialize``'s four values:
    ``engine, optimizer, training_dataloader, lr_scheduler = shardlab.initialize(...)``.

    ``config``: a shardlab dict / TOML or JSON path / ``Config``, or a DeepSpeed JSON (dict or
    path). ``optimizer``: None (AdamW from the config), or as DeepSpeed takes it: a torch
    optimizer class or factory, called as ``optimizer(model_parameters)``, or a fresh optimizer
    object (kept, its groups refilled with the engine's tensors; ``model_parameters`` ignored).
    ``lr_scheduler``: None (the config's schedule when the optimizer comes from the config or a
    DeepSpeed JSON has a ``scheduler`` block, else none: the lr is the optimizer's, never written
    by the engine), a scheduler built on that optimizer object, or a factory ``optimizer ->
    scheduler``. ``model_parameters``: as in ``deepspeed.initialize``, the model's parameters or
    torch param-group dicts (each group's settings, e.g. ``weight_decay``, on its parameters);
    default: every trainable parameter, in the config's groups (``train.weight_decay_params``;
    docs/api.md, Parameter groups), in one group under a DeepSpeed JSON (DeepSpeed's default).
    DeepSpeed's keywords (api_deepspeed.py): ``args`` (its ``deepspeed_config`` when no config is
    given; its ``local_rank`` set), ``config_params`` (= config), ``training_data`` + ``collate_fn``
    (DeepSpeed's loader, ``engine.training_dataloader``); ``dist_init_required`` and
    ``distributed_port`` are accepted and unused (the job is the launcher's); ``mpu`` /
    ``mesh_param`` are refused (data-parallel only)."""
    from .launch import init_from_env
    from . import api_deepspeed as ds
    ds.refuse_model_parallel(mpu, mesh_param)
    config = ds.config_from_args(args, config, config_params)
    if model is None or type(model).__name__ == "Namespace":  # DeepSpeed's order is (args, model, ...)
        raise ConfigError("model", "missing" if model is None else "got an argparse Namespace: DeepSpeed's first "
                          "parameter is args, shardlab's is the model; pass DeepSpeed's by keyword, "
                          "initialize(args=args, model=net, ...)")
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"expected a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model", f"{type(model).__name__} has no trainable parameters; pass a module with "
                                   "parameters that require grad")
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("model", "has parameters on the meta device; materialise it (e.g. model.to_empty + "
                                   "init) before shardlab.initialize")
    ready = ds.is_scheduler(lr_scheduler)
    if ready and lr_scheduler.optimizer is not optimizer:
        raise ConfigError("lr_scheduler", "is built on another optimizer than the one passed as optimizer=; pass "
                                          "that optimizer too (as DeepSpeed's callers do), or a factory taking the "
                                          "optimizer, e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)")
    if lr_scheduler is not None and not ready and not callable(lr_scheduler):
        raise ConfigError("lr_scheduler", f"expected a scheduler built on optimizer= or a factory taking the "
                                          f"optimizer, got {type(lr_scheduler).__name__}")
    kind, data = _read(config)
    config, settings = ds.json_settings(data if kind == "deepspeed" else None, optimizer)
    if kind == "shardlab":
        config = data
    ctx = init_from_env(data.train.device if kind == "shardlab" else "auto",
                        data.train.timeout_s if kind == "shardlab" else 60.0)
    ds.set_local_rank(args, ctx.local_rank)
    cfg = resolve_config(config, ctx.world_size)
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device, cfg.parallel.comm_algorithm,
                      check_collectives=cfg.parallel.check_collectives, transport=cfg.parallel.comm_transport,
                      comm_thread=cfg.parallel.comm_thread)
    build, schedule, own_groups = ds.client_optimizer(optimizer, model, model_parameters, cfg, ctx.device)
    if kind == "deepspeed":  # DeepSpeed builds the JSON's scheduler, on your optimizer too, and only that one
        schedule = settings["scheduler"] and lr_scheduler is None  # (_scheduler_from_config; None without a block)
    given = own_groups if own_groups is not None else model_parameters  # DeepSpeed ignores model_parameters then
    if given is None and kind == "deepspeed":  # DeepSpeed's default: module.parameters(), one group
        given = [p for p in model.parameters() if p.requires_grad]
    groups = user_groups(model, given) if given is not None else None
    uniform = kind == "deepspeed" and uniform_peak(data)  # else each group warms to its own lr
    engine = ModelEngine(model, mesh, cfg, build, lr_scheduler, schedule, groups, uniform, settings)
    engine.local_rank, engine.collate_fn = ctx.local_rank, collate_fn
    if training_data is not None:  # DeepSpeed's deepspeed_io(training_data)
        engine.training_dataloader = ds.data_loader(
            training_data, engine.train_micro_batch_size_per_gpu(), engine.global_rank, engine.world_size,
            collate_fn, engine.dataloader_drop_last(), pin_memory=engine.device.type == "cuda")
    elif collate_fn is not None:
        raise ConfigError("collate_fn", "given without training_data; pass the dataset too, or drop it")
    return engine


def _engine(model: nn.Module, mesh: Mesh, cfg: C.Config):
    from .parallel import ddp, fsdp, units, zero
    from .parallel.engine import Engine
    p = cfg.parallel
    if p.zero_stage == 3:
        return fsdp.apply(model, mesh, cfg, units.wrap_policy(model, p.wrap_policy, None))
    if p.zero_stage in (1, 2):
        return zero.apply(model, mesh, cfg)
    return ddp.apply(model, mesh, cfg) if mesh.world_size > 1 else Engine(model, mesh, cfg)


class ModelEngine(EngineCheckpoints, DeepSpeedAccessors):
    """What ``initialize`` returns: forward, backward, step, checkpoints of a user model.

    ``module`` is the user's model (under ZeRO-3 its sharded parameters are attached only
    during forward/backward: read weights with :meth:`full_state_dict`)."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: C.Config, build, lr_scheduler=None,
                 schedule: bool = False, groups=None, uniform_peak: bool = True, settings: dict | None = None):
        self.mesh, self.cfg, self.device = mesh, cfg, mesh.device
        self.settings = settings or json_settings(None, None)[1]  # DeepSpeed's accessors' answers
        model.to(mesh.device)
        sd = model.state_dict(keep_vars=True)
        first: dict[int, str] = {}
        self._names = {k: first.setdefault(id(v), k) for k, v in sd.items()}  # state_dict key -> canonical
        buffers = {n for n, _ in model.named_buffers()}
        self._buffers = [k for k in sd if k in buffers]  # persistent buffers, replicated on every rank
        with torch.no_grad():  # every replica's buffers start from rank 0's (engines broadcast parameters)
            world = mesh.comm("world")
            for k in self._buffers if mesh.world_size > 1 else ():
                world.broadcast(sd[k].data, 0)
        self.module = model
        ids = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}  # before the engine
        tag_groups(model, groups, cfg.train.weight_decay)
        if groups is not None:  # each group's own weight decay (default: the optimizer's), not decay_rule's
            cfg.train.weight_decay_params = "matrices"
        recompute_blocks(model, cfg.parallel.activation_checkpointing)
        self.engine = _engine(model, mesh, cfg)

        def build_groups(engine_groups):
            if groups is None:
                return build(decay_rule(engine_groups, cfg.train))
            return build(regroup(engine_groups, groups, ids, getattr(self.engine, "flats", None),
                                 cfg.train.weight_decay))
        self.optimizer = self.engine.make_optimizer(build_groups)
        for g in self.optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])  # a group's own peak (ds_* schedules without warmup_max_lr)
        ready = is_scheduler(lr_scheduler) or lr_scheduler is None  # an object built on your optimizer, or none
        self.lr_scheduler = lr_scheduler if ready else lr_scheduler(self.optimizer)
        self._schedule = schedule and self.lr_scheduler is None  # else the engine never writes an lr
        self._uniform_peak = uniform_peak
        t = cfg.train
        self.scaler = LossScaler.from_config(t)
        if self.settings["static_scale"] and self.scaler.enabled:  # a DeepSpeed JSON's static fp16.loss_scale:
            s = self.scaler  # overflowed steps are skipped, the scale never moves (DeepSpeed's static scaler)
            s.scale = s.min_scale = self.settings["static_scale"]
            s.growth = s.backoff = 1.0
        self.autocast = autocast_factory(t.precision, mesh.device)
        self.accumulation = cfg.parallel.microbatches
        self.global_steps = 0    # optimizer steps (skipped ones included, as DeepSpeed counts)
        self.global_samples = 0  # train_batch_size() per optimizer step, as DeepSpeed counts
        self.skipped_steps = 0   # optimizer steps not applied (fp16 overflow, non-finite gradient)
        self.micro_steps = 0     # step() calls, DeepSpeed's count (the boundary is its (n + 1) % accumulation)
        self._sched_steps = 0    # the config schedule's own steps (DeepSpeed's scheduler's last_batch_iteration + 1)
        self._backwards = 0      # backward passes since the last optimizer step
        self._fresh = True       # no training forward since the last optimizer step
        self._step_applied = self._no_sync = False
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's, else the micro-step rule
        self._last_loss = None
        self.client_state: dict = {}  # what save_checkpoint(client_state=...) stored, after load_checkpoint
        self.grad_norm: float | None = None  # the last step's, before clipping
        self.training_dataloader = self.collate_fn = None  # DeepSpeed's of initialize(training_data=, collate_fn=)
        self.local_rank = 0
        if self._schedule:
            self._set_lr()
        self.is_compiled = False
        if cfg.parallel.compile and cfg.parallel.compile_scope == "blocks":
            compile_blocks(model)  # each repeated block, the rest eager
            self.is_compiled = True
        elif cfg.parallel.compile:
            self.compile()

    def _set_lr(self) -> None:
        """The config's schedule for the next step, written after each optimizer step as
        DeepSpeed's scheduler writes it (never without a schedule: then the lr is yours)."""
        for g, lr in zip(self.optimizer.param_groups, self.next_lrs()):
            g["lr"] = lr

    def next_lrs(self) -> list[float]:
        """Each param group's lr for the next optimizer step under the config's schedule (what
        DeepSpeed's scheduler reports after a step: ``get_last_lr``): ds_* schedules count the
        applied steps (DeepSpeed steps its scheduler only after a step that was not skipped),
        shardlab's cosine every step; a load without scheduler states keeps this engine's count."""
        t = self.cfg.train
        return [lr_at(self._sched_steps, t, None if self._uniform_peak else g["initial_lr"])
                for g in self.optimizer.param_groups]

    # -- identity ---------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def train(self, mode: bool = True) -> "ModelEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ModelEngine":
        return self.train(False)

    def is_gradient_accumulation_boundary(self) -> bool:
        """DeepSpeed's: ``(micro_steps + 1) % gradient_accumulation_steps == 0``, micro-steps counted
        by ``step()``: True from the forward of the micro-batch that ends an accumulation until its
        ``step()`` (always with accumulation 1), or what ``set_gradient_accumulation_boundary`` set."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.accumulation == 0

    def _syncs(self) -> bool:
        """Whether this micro-batch's backward reduces gradients over the ranks."""
        return self.is_gradient_accumulation_boundary() and not self._no_sync

    # -- forward / backward / step ----------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs, **kwargs):
        """The model's forward under the configured autocast. With gradients enabled it is one
        micro-batch of the step (the boundary's synchronises)."""
        ac = self.autocast() if self.autocast else nullcontext()
        if not torch.is_grad_enabled():
            with ac:
                return self.module(*inputs, **kwargs)
        if self._fresh:
            self.engine.start_step()
            self._fresh = False
        with ac:
            return self.engine.forward(*inputs, sync=self._syncs(), **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss * loss_scale / gradient_accumulation_steps`` (the step's gradient is
        the mean over micro-batches and ranks), then the engine's per-micro-batch hook. As
        DeepSpeed's: ``scale_wrt_gas=False`` leaves out the division by the accumulation steps
        (the micro-batches' gradients are summed), ``retain_graph`` is autograd's, and it returns
        the loss divided as the gradient was (``loss / gradient_accumulation_steps``)."""
        sync, div = self._syncs(), self.accumulation if scale_wrt_gas else 1
        (loss * (self.scaler.scale / div)).backward(retain_graph=retain_graph)
        self.engine.after_backward(sync)
        self._backwards += 1
        self._last_loss = loss.detach()
        return loss / div if div != 1 else loss

    def step(self) -> None:
        """DeepSpeed's: on the accumulation boundary, average gradients, fp16 unscale + overflow
        check, clip (``train.grad_clip``), optimizer and scheduler step, zero gradients; in any
        case count the micro-step. Refused inside ``no_sync()``, as in DeepSpeed."""
        if self._no_sync:
            raise ConfigError("step", "called inside engine.no_sync() (DeepSpeed refuses it too); step after the "
                                      "block, following a backward outside it")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary() and self._backwards:
            self._optimizer_step()
        self.micro_steps += 1

    def _optimizer_step(self) -> None:
        self.engine.sync_grads()
        out = optimizer_step(self.engine, self.optimizer, self.scaler, self.cfg.train.grad_clip,
                             self.mesh.comm("world"), self.device)
        self.grad_norm = float(out["grad_norm"])
        self._step_applied = not (out["overflow"] or out["nonfinite"])  # the train loop's rule for non-finite
        if self._step_applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        if self._step_applied or self.cfg.train.lr_schedule == "cosine":
            self._sched_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._backwards, self._fresh = 0, True
        if self._schedule:  # the next step's lr, set now as DeepSpeed's scheduler step does (get_lr, param_groups)
            self._set_lr()
        self.report_progress()

    def get_lr(self) -> list[float]:
        """Each param group's lr for the next optimizer step (under the config's schedule, set
        after each step as DeepSpeed's scheduler sets it)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    # -- state ------------------------------------------------------------------------------
    def full_state_dict(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` (its own names, unsharded CPU tensors) on rank 0, or on every
        rank with ``everywhere``; other ranks get ``{}``. Collective (call it on every rank)."""
        got = self.engine.full_state(None, everywhere)
        if not got:
            return {}
        out = {}
        for key, canon in self._names.items():
            if key in self._buffers:
                out[key] = self.module.get_buffer(key).detach().cpu().clone()
            elif f"model.{canon}" in got:
                out[key] = got[f"model.{canon}"]
        return out
