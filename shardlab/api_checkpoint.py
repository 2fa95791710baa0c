"""The checkpoint half of ``shardlab.initialize``'s engine (api.ModelEngine): sharded saves and
loads through checkpoint/save.py with DeepSpeed's signatures and tags (checkpoint/tags.py; an
untagged save is ``global_step{N}``), ``client_state``, partial and non-strict loads (docs/api.md,
Checkpoint and resume)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .checkpoint import save as ckpt, tags
from .distributed.regions import Piece
from .errors import ConfigError
from .train.optim import schedule_steps


class EngineCheckpoints:
    """Mixed into api.ModelEngine: uses its ``engine``, ``mesh``, ``module``, ``optimizer``,
    ``lr_scheduler``, ``scaler``, ``cfg``, ``device``, its counts (``global_steps``,
    ``global_samples``, ``skipped_steps``, the schedule's ``_sched_steps``, ``_backwards``), the
    parameters' canonical names ``_names`` and the persistent buffers' names ``_buffers``."""

    def _buffer_pieces(self) -> list[Piece]:
        if self.mesh.rank != 0:
            return []
        out = []
        for k in self._buffers:
            b = self.module.get_buffer(k).detach()
            out.append(Piece(f"buffer.{k}", tuple(b.shape), (0,) * b.dim(), b))
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, *, keep: int | None = None) -> Path:
        """Sharded checkpoint ``<save_dir>/<tag>/step_NNNNNNNN`` (checkpoint/save.py): every rank
        writes its pieces, rank 0 commits atomically. Collective. Returns the checkpoint's path on
        every rank (truthy, as DeepSpeed's ``True`` on every rank; with ``async_save`` the path it
        will have once committed: :meth:`wait_checkpoint`). As DeepSpeed's: ``tag`` defaults to
        ``global_step{global_steps}``; ``save_latest`` names it in ``<save_dir>/latest``; older
        saves are never deleted; ``exclude_frozen_parameters`` leaves out the parameters that do
        not require grad (a load keeps its own for them: ``load_module_strict=False``);
        ``client_state``: your own JSON values (epoch, data position, ...); rank 0's is saved,
        and ``engine.client_state`` holds it after :meth:`load_checkpoint`. ``keep`` (shardlab's,
        untagged only): ``<save_dir>/step_NNNNNNNN`` instead, the newest ``keep`` kept."""
        if tag is None and keep is None:  # with keep=, shardlab's own layout (step_NNNNNNNN in save_dir, pruned)
            tag = f"global_step{self.global_steps}"
        root = tags.save_root(save_dir, tag)
        if client_state is not None and not isinstance(client_state, dict):
            raise ConfigError("client_state", f"must be a dict, got {type(client_state).__name__}")
        try:
            client = json.loads(json.dumps(client_state or {}))
        except (TypeError, ValueError) as e:
            raise ConfigError("client_state", f"must be JSON values (numbers, strings, lists, dicts): {e}; "
                                              "save tensors as a model buffer or your own file") from None
        if self._backwards and self.mesh.rank == 0:  # DeepSpeed saves here too (an epoch of an odd number of batches)
            warnings.warn(f"save_checkpoint in the middle of gradient accumulation ({self._backwards} of "
                          f"{self.accumulation} micro-batches): it holds the state after step {self.global_steps}; "
                          "the gradients of those micro-batches are not in it (as in DeepSpeed)", stacklevel=2)
        frozen = {f"model.{self._names[n]}" for n, p in self.module.named_parameters()
                  if exclude_frozen_parameters and not p.requires_grad}

        def meta():
            return {"api": {"global_steps": self.global_steps, "scaler": self.scaler.state_dict(),
                            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                            "client_state": client, "global_samples": self.global_samples,
                            "skipped_steps": self.skipped_steps, "schedule_steps": self._sched_steps,
                            "param_groups": _group_settings(self.optimizer)},
                    "layout": self.mesh.topology.describe(), "world_size": self.mesh.world_size,
                    "config": self.cfg.to_dict(), "engine": self.engine.name}
        from .checkpoint.async_save import saver
        path = saver(self.cfg.checkpoint.async_save)(
            root, self.global_steps, self.mesh, lambda: [p for p in self.engine.state_pieces(self.optimizer)
                                                          if p.key not in frozen] + self._buffer_pieces(),
            meta, self.device, keep=keep or self.cfg.checkpoint.keep,  # untagged: the newest keep; a tag: itself
            on_commit=lambda: save_latest and tags.mark_latest(save_dir, tag))  # rank 0, once committed
        return Path(path) if path is not None else Path(root) / ckpt._step_name(self.global_steps)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: the whole model's ``state_dict`` (your names, buffers included) written by
        rank 0 with ``torch.save`` to ``save_dir/save_filename``, its floating-point tensors in
        the training's 16-bit dtype under bf16 / fp16 (the dtype DeepSpeed's module holds then)
        and fp32 otherwise; ``exclude_frozen_parameters`` leaves out parameters that do not
        require grad. Collective. Returns True. Under ZeRO-3 it is gathered whatever
        ``stage3_gather_16bit_weights_on_model_save`` says (DeepSpeed saves nothing and returns
        False when that is false)."""
        state = self.full_state_dict()
        if self.mesh.rank == 0:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.train.precision)
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            out = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
                   for k, v in state.items() if not (exclude_frozen_parameters and k in frozen)}
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save(out, tmp)
            tmp.replace(path)  # a reader never sees half a file
        return True

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    def wait_checkpoint(self) -> None:
        """With ``checkpoint.async_save``: wait for the save in flight and raise (on every rank)
        if it failed. Collective; call it before the end of the program."""
        ckpt.finish_saves(self.mesh)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn=None) -> tuple:
        """Resume from ``load_dir`` (a ``step_NNNNNNNN`` checkpoint, or the newest valid one
        inside it; with ``tag``, or a ``latest`` file naming one, inside ``load_dir/<tag>``):
        parameters, optimizer state (with its groups' lr and other settings, as torch's
        ``load_state_dict``), buffers, loss scale, step and sample counts, scheduler and, with the
        same world size, this rank's RNG. Returns ``(path, client_state)``, ``(None, None)`` when
        there is none, as DeepSpeed's. Waits for an asynchronous save in flight first (collective
        then). As DeepSpeed's: ``load_module_only`` reads the weights and buffers alone (a warm
        start); ``load_optimizer_states`` / ``load_lr_scheduler_states`` = False leave those as
        they are (the schedule's own step count too: a fresh engine warms up again);
        ``load_module_strict=False`` keeps this engine's values of parameters the checkpoint lacks
        (saved with ``exclude_frozen_parameters``), True refuses them; ``custom_load_fn`` is refused
        (these checkpoints are sharded pieces, not a state_dict for your function)."""
        if custom_load_fn is not None:
            raise ConfigError("custom_load_fn", "shardlab checkpoints are sharded pieces, not a module state_dict to "
                                                "hand to your function; leave it None and adjust engine.module after")
        ckpt.finish_saves(self.mesh)  # a save of this process still in flight commits (and names latest) first
        path = tags.find(load_dir, tag, warn=self.mesh.rank == 0)
        if path is None:
            return None, None
        with ckpt.Reader(path) as reader:
            missing = [k for k in dict.fromkeys(f"model.{self._names[n]}" for n, _ in self.module.named_parameters())
                       if not reader.has(k)]
            if missing and load_module_strict:
                raise ConfigError("load_module_strict", f"{path} has no {', '.join(m[6:] for m in missing[:3])}"
                                  f"{' ...' if len(missing) > 3 else ''} (saved with exclude_frozen_parameters?); pass "
                                  "load_module_strict=False to keep this engine's values of them")
            source = _with_current(reader, self.engine.full_state(None, everywhere=True), missing) if missing else reader
            optimizer = self.optimizer if load_optimizer_states and not load_module_only else None
            self.engine.load_pieces(source, optimizer)
            with torch.no_grad():
                for k in self._buffers:
                    if reader.has(f"buffer.{k}"):
                        b = self.module.get_buffer(k)
                        b.copy_(reader.read(f"buffer.{k}").to(b.device, b.dtype))
            meta = reader.meta.get("api", {})
            self.client_state = meta.get("client_state") or {}
            if not load_module_only:
                self._load_counts(meta, reader.step, optimizer is not None, load_lr_scheduler_states)
                ckpt.restore_rank_rng(reader, self.mesh.rank, self.mesh.world_size, self.device)
        self.zero_grad()  # micro-batches before the load are not part of any step
        self._backwards, self._fresh = 0, True
        return path, self.client_state

    def _load_counts(self, meta: dict, step: int, optimizer: bool, scheduler: bool) -> None:
        self.global_steps = int(meta.get("global_steps", step))
        self.global_samples = int(meta.get("global_samples", self.global_steps * self.train_batch_size()))
        if "scaler" in meta:
            self.scaler.load_state_dict(meta["scaler"])
        self.skipped_steps = int(meta.get("skipped_steps", self.scaler.skipped))
        groups = meta.get("param_groups")
        if optimizer and groups and len(groups) == len(self.optimizer.param_groups):
            for g, saved in zip(self.optimizer.param_groups, groups):
                g.update({k: tuple(v) if isinstance(g[k], tuple) else v for k, v in saved.items() if k in g})
        if scheduler:
            if self.lr_scheduler is not None and meta.get("lr_scheduler"):
                self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            self._sched_steps = int(meta.get("schedule_steps", schedule_steps(self.global_steps, self.scaler,
                                                                              self.cfg.train)))
            if self._schedule and optimizer and not groups:  # a checkpoint without the groups' lr: the schedule's
                self._set_lr()


def _group_settings(optimizer) -> list[dict]:
    """Each param group's numbers (lr, initial_lr, betas, weight_decay, ...), which torch's
    optimizer ``state_dict`` restores; not its flags (foreach, fused: this engine's device's)."""
    def number(v):
        return not isinstance(v, bool) and isinstance(v, (int, float))
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()
             if number(v) or (isinstance(v, (list, tuple)) and v and all(map(number, v)))}
            for g in optimizer.param_groups]


def _with_current(reader, current: dict, missing: list[str]):
    """``reader`` with this engine's own values (``current``: its full state) for the parameters
    the checkpoint lacks (``missing``), through checkpoint/pieces.py ``WithInitial``."""
    from .checkpoint.pieces import WithInitial

    def box(name, shape, offsets, sizes, dtype, device):
        return current[f"model.{name}"][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].to(dtype)
    return WithInitial(reader, box, {k[len("model."):]: tuple(current[k].shape) for k in missing})
