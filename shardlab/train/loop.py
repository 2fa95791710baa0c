"""The training loop that runs on every rank: build, parallelize, step, log, evaluate, checkpoint.

``train_rank(ctx, cfg, data_dir)`` is the worker that ``shardlab train`` launches on each rank.
Per step: set the LR, take this rank's micro-batches, ``engine.forward_backward`` (gradient
accumulation and synchronisation are the engine's business), unscale/check overflow (fp16),
clip the global gradient norm, AdamW step. Metrics every ``log_every`` steps.

The architecture's ``task`` (models/spec.py) picks the data: ``lm`` token windows (train/data.py),
``classify`` images and labels (train/images.py; test accuracy reported, a "token" is an image).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..distributed.mesh import Mesh
from ..distributed.topology import Topology
from ..models.spec import count_params, get_spec, meta_model
from ..parallelize import parallelize
from . import checkpoint as ckpt
from . import images
from .data import Loader, TokenData
from .metrics import MetricsWriter, cpu_probe_flops, flops_per_token, peak_flops, peak_memory_bytes
from .optim import LossScaler, autocast_factory, build_adamw, lr_at, param_dtype


def open_data(cfg: Config, data_dir: str):
    """The prepared data of the configured task: a token corpus (lm) or an image dataset (classify)."""
    if get_spec(cfg.model).task == "classify":
        return images.ImageData(data_dir, cfg.data.limit_train, cfg.data.limit_test)
    return TokenData(data_dir)


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.logging.run_dir) / "checkpoints"


class Trainer:
    """Everything one rank holds during training. Built by :func:`train_rank`; usable directly in tests."""

    def __init__(self, cfg: Config, mesh: Mesh, data, init: bool = True):
        """``init=False``: allocate without drawing initial values (a checkpoint is loaded next)."""
        self.cfg, self.mesh, self.rank = cfg, mesh, mesh.rank
        t = cfg.train
        torch.manual_seed(t.seed)
        self.device = mesh.device
        # Built on the meta device: each rank materialises only what its layout gives it.
        model = meta_model(cfg.model, dtype=param_dtype(t.precision))
        self.n_params = count_params(model)
        self.engine = parallelize(model, mesh, cfg, init=init)
        self.optimizer = self.engine.make_optimizer(build_adamw(t, self.device))
        topo = mesh.topology
        c = mesh.coords
        dp_rank = c["dp_replicate"] * topo.dp_shard + c["dp_shard"]
        self.task = get_spec(cfg.model).task
        if self.task == "classify":
            self.loader = images.ImageLoader(data, t.global_batch, cfg.parallel.microbatches, dp_rank,
                                             topo.size("dp"), t.seed, self.device, param_dtype(t.precision))
        else:
            self.loader = Loader(data, t.seq_len, t.global_batch, cfg.parallel.microbatches,
                                 dp_rank, topo.size("dp"), t.seed, self.device)
        self.scaler = LossScaler(t.precision == "fp16", t.loss_scale_init, t.loss_scale_window)
        self.autocast = autocast_factory(t.precision, self.device)
        self.step = 0

    # -- one optimizer step ----------------------------------------------------------------
    def train_step(self) -> dict:
        t = self.cfg.train
        lr = lr_at(self.step, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        micro = self.loader.next_batch()
        local = self.engine.forward_backward(micro, self.scaler.scale, self.autocast)
        # fp16: unscale exactly the gradient tensors this rank owns (flat shards, buckets, TP/EP
        # shards, its pipeline stage), before clipping; one world all-reduce of the overflow flag.
        overflow = self.scaler.unscale_and_check(self.engine.grads(), self.mesh.comm("world"), self.device)
        gnorm = float("nan")
        if not overflow:
            gnorm = self.engine.clip_grads(t.grad_clip)
            self.optimizer.step()
        self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"local_loss": local, "lr": lr, "grad_norm": gnorm, "skipped": overflow}

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean validation loss, the model in eval mode (no dropout)."""
        total, model = 0.0, self.engine.model
        was_training = model.training
        model.eval()
        try:
            for micro in batches:
                total += self.engine.global_loss(self.engine.evaluate(micro, self.autocast))
        finally:
            model.train(was_training)
        return total / len(batches)

    def accuracy(self) -> float | None:
        """classify: top-1 accuracy over the whole test split (collective); lm: None."""
        return images.accuracy(self.engine, self.loader, autocast=self.autocast) if self.task == "classify" else None

    # -- checkpoints (train/checkpoint.py: each rank writes and reads its own boxes) ----------
    def save_checkpoint(self, directory: Path) -> Path | None:
        """Every rank writes its own pieces (no gather); rank 0 writes the index last and commits.
        Only barriers synchronise (they run on the mesh's device), so nothing else is collective."""
        world = self.mesh.comm("world")
        if self.rank == 0:
            ckpt.prepare(directory, self.step)
        world.barrier()
        ckpt.write_rank(ckpt.staging_dir(directory, self.step), self.rank,
                        self.engine.state_pieces(self.optimizer), ckpt.rng_tensors(self.device))
        world.barrier()
        path = None
        if self.rank == 0:
            meta = {"data": self.loader.state_dict(), "scaler": self.scaler.state_dict(),
                    "layout": self.mesh.topology.describe(), "world_size": self.mesh.world_size,
                    "config": self.cfg.to_dict(), "engine": self.engine.name}
            path = ckpt.commit(directory, self.step, self.mesh.world_size, meta, keep=self.cfg.checkpoint.keep)
        world.barrier()
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Read this rank's boxes (saved under any layout and world size), the data cursor, the
        loss scale and, when the world size is unchanged, this rank's RNG states."""
        reader = ckpt.Reader(path)
        self.engine.load_pieces(reader, self.optimizer)
        meta = reader.meta
        self.loader.load_state_dict(meta["data"])
        self.scaler.load_state_dict(meta["scaler"])
        if reader.world_size == self.mesh.world_size:
            ckpt.restore_rng({k: v for k in ("rng.cpu", "rng.cuda")
                              if (v := reader.extra(self.rank, k)) is not None}, self.device)
        self.step = int(reader.step)


def train_rank(ctx, cfg: Config, data_dir: str) -> dict:
    """Worker run on every rank by ``shardlab train``. Returns rank 0's summary."""
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    mesh.algorithm = cfg.parallel.comm_algorithm
    data = open_data(cfg, data_dir)
    t, log = cfg.train, cfg.logging
    run_dir, ck_dir = Path(log.run_dir), checkpoint_dir(cfg)
    is_main = mesh.rank == 0
    path = ckpt.latest_valid(ck_dir, warn=print if is_main else (lambda *_: None)) if cfg.checkpoint.resume else None
    tr = Trainer(cfg, mesh, data, init=path is None)  # resuming: no initial values to draw
    resumed_from = None
    if path is not None:
        tr.load_checkpoint(path)
        resumed_from = str(path)
    writer = MetricsWriter(run_dir, log.tensorboard) if is_main else None
    fpt = flops_per_token(cfg.model, t.seq_len)
    peak, peak_label = peak_flops(mesh.device, t.precision)
    if log.peak_flops:
        peak, peak_label = log.peak_flops, "configured"
    elif peak is None and mesh.device.type == "cpu":
        probe = torch.tensor(cpu_probe_flops(), dtype=torch.float64)
        peak = float(mesh.comm("world").all_reduce(probe)) / mesh.world_size  # per-rank mean
        peak_label = "cpu matmul probe (measured, not a datasheet peak)"
    total_peak = peak * mesh.world_size if peak else None
    val_batches = tr.loader.val_batches(t.eval_batches)
    bar = None
    if is_main and log.progress:
        from tqdm import tqdm
        bar = tqdm(total=t.steps, initial=tr.step, desc="train", dynamic_ncols=True, leave=True)
    if writer:
        writer.write({"kind": "start", "step": tr.step, "params": tr.n_params, "layout": mesh.topology.describe(),
                      "world_size": mesh.world_size, "flops_per_token": fpt, "peak_flops": total_peak,
                      "peak_label": peak_label, "unigram_baseline": data.unigram_entropy,
                      "resumed_from": resumed_from})
    profiler = _profiler(log.profile_steps, run_dir, mesh.rank, mesh.device) if log.profile_steps else None
    tokens_per_step = t.global_batch * tr.loader.tokens_per_sample  # classify: images per step
    window_time, window_steps, times = 0.0, 0, []
    last = {"loss": float("nan"), "val_loss": float("nan"), "accuracy": None}
    snap = mesh.ledger.snapshot()
    while tr.step < t.steps:
        if mesh.device.type == "cuda":
            torch.cuda.synchronize(mesh.device)
        t0 = time.perf_counter()
        out = tr.train_step()
        if mesh.device.type == "cuda":
            torch.cuda.synchronize(mesh.device)
        dt = time.perf_counter() - t0
        window_time += dt
        window_steps += 1
        times.append(dt)
        if profiler:
            profiler.step()
        step = tr.step
        if step % log.log_every == 0 or step == t.steps:
            loss = tr.engine.global_loss(out["local_loss"])
            tps = tokens_per_step * window_steps / window_time
            moved = mesh.ledger.since(snap)
            rec = {"kind": "train", "step": step, "loss": loss, "lr": out["lr"], "grad_norm": out["grad_norm"],
                   "tokens_per_s": tps, "step_time_s": window_time / window_steps,
                   "mfu": fpt * tps / total_peak if total_peak else None,
                   "comm_bytes_per_step": sum(e.bytes_sent for e in moved.values()) / window_steps,
                   "peak_mem_bytes": peak_memory_bytes(mesh.device)[0], "loss_scale": tr.scaler.scale,
                   "skipped_steps": tr.scaler.skipped}
            if cfg.model.n_experts:  # tokens per expert, dropped fraction (last step), all-to-all bytes
                from ..parallel.expert import moe_metrics
                moe = moe_metrics(tr.engine.model, moved)
                moe["moe/all_to_all_bytes"] = moe.get("moe/all_to_all_bytes", 0) / window_steps
                rec.update(moe)
            window_time, window_steps = 0.0, 0
            last["loss"] = loss
            if writer:
                writer.write(rec)
            if bar:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            last["val_loss"], last["accuracy"] = tr.evaluate(val_batches), tr.accuracy()
            if writer:
                writer.write({"kind": "val", "step": step, "val_loss": last["val_loss"], "accuracy": last["accuracy"]})
        if cfg.checkpoint.save and ((cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == t.steps):
            tr.save_checkpoint(ck_dir)
        if window_steps == 0:  # a record was written: start counting bytes after eval/checkpoint traffic
            snap = mesh.ledger.snapshot()
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    if profiler:
        profiler.stop()
    steady = times[len(times) // 5:] or times
    mean_dt = sum(steady) / len(steady) if steady else float("nan")
    summary = {"steps": tr.step, "task": tr.task, "loss": last["loss"], "val_loss": last["val_loss"],
               "accuracy": last["accuracy"],
               "unigram_baseline": data.unigram_entropy, "tokens_per_s": tokens_per_step / mean_dt,
               "mfu": fpt * tokens_per_step / mean_dt / total_peak if total_peak else None,
               "peak_label": peak_label, "params": tr.n_params, "layout": mesh.topology.describe(),
               "run_dir": str(run_dir), "checkpoint_dir": str(ck_dir) if cfg.checkpoint.save else None,
               "peak_mem_bytes": peak_memory_bytes(mesh.device)[0], "resumed_from": resumed_from,
               "ledger": mesh.ledger.as_dict()}
    if writer:
        writer.write(dict(summary, kind="summary", step=tr.step, ledger=None))
        writer.close()
    return summary


def _profiler(steps: int, run_dir: Path, rank: int, device: torch.device):
    from torch.profiler import ProfilerActivity, profile, schedule
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"rank{rank}.json")))
    prof.start()
    return prof
