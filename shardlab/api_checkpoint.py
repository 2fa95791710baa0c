"""The checkpoint half of ``shardlab.initialize``'s engine (api.ModelEngine): sharded saves and
loads through checkpoint/save.py, DeepSpeed's tags (checkpoint/tags.py), ``client_state`` and
partial loads (docs/api.md, Checkpoint and resume)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .checkpoint import save as ckpt, tags
from .distributed.regions import Piece
from .errors import ConfigError


class EngineCheckpoints:
    """Mixed into api.ModelEngine: uses its ``engine``, ``mesh``, ``module``, ``optimizer``,
    ``lr_scheduler``, ``scaler``, ``cfg``, ``device``, ``global_steps``, ``micro_steps`` and the
    persistent buffers' names ``_buffers``."""

    def _buffer_pieces(self) -> list[Piece]:
        if self.mesh.rank != 0:
            return []
        out = []
        for k in self._buffers:
            b = self.module.get_buffer(k).detach()
            out.append(Piece(f"buffer.{k}", tuple(b.shape), (0,) * b.dim(), b))
        return out

    def save_checkpoint(self, directory, tag=None, client_state: dict | None = None, *,
                        keep: int | None = None) -> Path:
        """Sharded checkpoint ``<directory>/step_NNNNNNNN`` (checkpoint/save.py): every rank
        writes its pieces, rank 0 commits atomically. Collective. Returns the checkpoint's path on
        every rank (truthy, as DeepSpeed's ``True`` on every rank; with ``async_save`` the path it
        will have once committed: :meth:`wait_checkpoint`).
        ``tag`` (DeepSpeed's): save under ``<directory>/<tag>/`` and name it in ``<directory>/latest``.
        ``client_state``: your own JSON values (epoch, data position, ...), as DeepSpeed's; rank
        0's is saved, and ``engine.client_state`` holds it after :meth:`load_checkpoint`."""
        root = tags.save_root(directory, tag)
        if client_state is not None and not isinstance(client_state, dict):
            raise ConfigError("client_state", f"must be a dict, got {type(client_state).__name__}")
        try:
            client = json.loads(json.dumps(client_state or {}))
        except (TypeError, ValueError) as e:
            raise ConfigError("client_state", f"must be JSON values (numbers, strings, lists, dicts): {e}; "
                                              "save tensors as a model buffer or your own file") from None
        if self.micro_steps and self.mesh.rank == 0:  # DeepSpeed saves here too (an epoch of an odd number of batches)
            warnings.warn(f"save_checkpoint in the middle of gradient accumulation ({self.micro_steps} of "
                          f"{self.accumulation} micro-batches): it holds the state after step {self.global_steps}; "
                          "the gradients of those micro-batches are not in it (as in DeepSpeed)", stacklevel=2)

        def meta():
            return {"api": {"global_steps": self.global_steps, "scaler": self.scaler.state_dict(),
                            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                            "client_state": client},
                    "layout": self.mesh.topology.describe(), "world_size": self.mesh.world_size,
                    "config": self.cfg.to_dict(), "engine": self.engine.name}
        from .checkpoint.async_save import saver
        path = saver(self.cfg.checkpoint.async_save)(
            root, self.global_steps, self.mesh, lambda: self.engine.state_pieces(self.optimizer) +
            self._buffer_pieces(), meta, self.device, keep=keep or self.cfg.checkpoint.keep,
            on_commit=lambda: tags.mark_latest(directory, tag))  # rank 0, once committed (async: later)
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

    def load_checkpoint(self, directory, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> tuple:
        """Resume from ``directory`` (a ``step_NNNNNNNN`` checkpoint, or the newest valid one
        inside it; with ``tag``, or a ``latest`` file naming one, inside ``directory/<tag>``):
        parameters, optimizer state, buffers, loss scale, step count, scheduler and, with the same
        world size, this rank's RNG. Returns ``(path, client_state)``, ``(None, None)`` when there
        is none, as DeepSpeed's (before 2026-12-07: the path alone). Waits for an asynchronous save
        in flight first (collective then). As DeepSpeed's:
        ``load_module_only`` reads the weights and buffers alone (a warm start: the step count,
        optimizer, scheduler and RNG stay this engine's); ``load_optimizer_states`` /
        ``load_lr_scheduler_states`` = False leave those two as they are."""
        ckpt.finish_saves(self.mesh)  # a save of this process still in flight commits (and names latest) first
        path = tags.find(directory, tag, warn=self.mesh.rank == 0)
        if path is None:
            return None, None
        with ckpt.Reader(path) as reader:
            optimizer = self.optimizer if load_optimizer_states and not load_module_only else None
            self.engine.load_pieces(reader, optimizer)
            with torch.no_grad():
                for k in self._buffers:
                    if reader.has(f"buffer.{k}"):
                        b = self.module.get_buffer(k)
                        b.copy_(reader.read(f"buffer.{k}").to(b.device, b.dtype))
            meta = reader.meta.get("api", {})
            self.client_state = meta.get("client_state") or {}
            if not load_module_only:
                self.global_steps = int(meta.get("global_steps", reader.step))
                if "scaler" in meta:
                    self.scaler.load_state_dict(meta["scaler"])
                if load_lr_scheduler_states and self.lr_scheduler is not None and meta.get("lr_scheduler"):
                    self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
                ckpt.restore_rank_rng(reader, self.mesh.rank, self.mesh.world_size, self.device)
        self.micro_steps = 0
        if self._schedule:  # the config's schedule at the loaded step count
            self._set_lr()
        return path, self.client_state
