"""The training loop that runs on every rank: build, parallelize, step, log, evaluate, checkpoint.

``train_rank(ctx, data_dir)`` is the worker that ``shardlab train`` launches on each rank; it
reads the run plan in ``ctx.plan`` (train/plan.py). The loop step by step: docs/training.md.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ..config import Config
from ..distributed.mesh import Mesh
from ..distributed.topology import Topology
from ..models.spec import add_adapters, count_params, get_spec, meta_model
from ..parallel.materialize import model_init_fn
from ..checkpoint.pieces import WithInitial
from ..parallelize import parallelize
from . import anomaly
from ..checkpoint import save as ckpt
from ..checkpoint.async_save import saver
from . import finetune, images
from .data import Loader, TokenData
from .metrics import (MetricsWriter, bounded_mfu, flops_per_token, job_cpu_peak, note_beaten_peak, peak_flops,
                      peak_memory_bytes, recompute_flops_per_token)
from .optim import (LossScaler, autocast_factory, build_adamw, lr_at, optimizer_step, param_dtype,
                    schedule_steps)


def open_data(cfg: Config, data_dir: str):
    """The prepared data of the configured task: a token corpus (lm) or an image dataset (classify)."""
    if get_spec(cfg.model).task == "classify":
        return images.ImageData(data_dir, cfg.data.limit_train, cfg.data.limit_test)
    return TokenData(data_dir)


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
        self.adapter_shapes = {}
        if t.lora_rank:  # freeze the base, adapters on the targeted linears (models/lora.py)
            add_adapters(model, t)
            self.adapter_shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        self.n_params = count_params(model)
        self.engine = parallelize(model, mesh, cfg, init=init)
        self.optimizer = self.engine.make_optimizer(build_adamw(t, self.device))
        topo, c = mesh.topology, mesh.coords
        dp_rank = c["dp_replicate"] * topo.dp_shard + c["dp_shard"]
        self.task = get_spec(cfg.model).task
        if self.task == "classify":
            self.loader = images.ImageLoader(data, t.global_batch, cfg.parallel.microbatches, dp_rank,
                                             topo.size("dp"), t.seed, self.device, param_dtype(t.precision))
        else:
            self.loader = Loader(data, t.seq_len, t.global_batch, cfg.parallel.microbatches,
                                 dp_rank, topo.size("dp"), t.seed, self.device)
        self.scaler = LossScaler.from_config(t)
        self.autocast = autocast_factory(t.precision, self.device)
        self.step = 0
        self.anomaly = anomaly.attach(cfg, self.engine.model, mesh.rank)  # train.detect_anomaly

    # -- one optimizer step ----------------------------------------------------------------
    def train_step(self) -> dict:
        t = self.cfg.train
        lr = lr_at(schedule_steps(self.step, self.scaler, t), t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        micro = self.loader.next_batch()
        if self.anomaly:
            self.anomaly.begin(self.step + 1)
        local = self.engine.forward_backward(micro, self.scaler.scale, self.autocast)
        out = optimizer_step(self.engine, self.optimizer, self.scaler, t.grad_clip, self.mesh.comm("world"),
                             self.device, self.anomaly)
        self.step += 1
        return {"local_loss": local, "lr": lr, "grad_norm": out["grad_norm"],
                "skipped": out["overflow"] | out["nonfinite"], "nonfinite": out["nonfinite"], "anomaly": out["anomaly"]}

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

    # -- checkpoints (checkpoint/save.py: each rank writes and reads its own boxes) ----------
    def save_checkpoint(self, directory: Path, test_hooks: dict | None = None) -> Path | None:
        """Every rank writes its own pieces (no gather); rank 0 writes the index last and commits
        (checkpoint/save.save). Only barriers synchronise, so nothing else is collective.
        ``test_hooks``: the plan's (TEST-ONLY faults of the asynchronous writer)."""
        def meta():
            return {"data": self.loader.state_dict(), "scaler": self.scaler.state_dict(),
                    "layout": self.mesh.topology.describe(), "world_size": self.mesh.world_size,
                    "config": self.cfg.to_dict(), "engine": self.engine.name,
                    **finetune.checkpoint_meta(self.cfg, getattr(self.loader.data, "meta", {}))}

        def pieces():  # a LoRA run on a base: adapters only, the base stays where it is
            out = self.engine.state_pieces(self.optimizer)
            return finetune.drop_frozen(out) if finetune.adapter_only(self.cfg) else out
        return saver(self.cfg.checkpoint.async_save, test_hooks)(directory, self.step, self.mesh, pieces, meta, self.device,
                                                      keep=self.cfg.checkpoint.keep)

    def _with_adapters(self, reader):
        """Adapters a reader lacks (a base without them) read as their seeded initial values."""
        if not self.adapter_shapes:
            return reader
        return WithInitial(reader, model_init_fn(self.cfg.model, self.cfg.train.seed), self.adapter_shapes)

    def load_base(self) -> None:
        """Fine-tuning: the weights of ``checkpoint.base`` (each rank reads its boxes); step 0,
        fresh optimizer state, data from the start."""
        reader = finetune.base_reader(self.cfg)
        try:
            self.engine.load_pieces(self._with_adapters(reader), self.optimizer)
        finally:
            reader.close()

    def load_checkpoint(self, path: Path) -> None:
        """Read this rank's boxes (saved under any layout and world size), the data cursor, the
        loss scale and, when the world size is unchanged, this rank's RNG states. A checkpoint
        without optimizer state, data cursor or loss scale (``shardlab checkpoint import``) starts
        those fresh."""
        from ..models.pretrained import with_base
        reader = self._with_adapters(with_base(ckpt.Reader(path)))
        self.engine.load_pieces(reader, self.optimizer)
        meta = reader.meta
        if "data" in meta:  # absent from an imported checkpoint (checkpoint import): data from the start
            self.loader.load_state_dict(meta["data"])
        if "scaler" in meta:
            self.scaler.load_state_dict(meta["scaler"])
        ckpt.restore_rank_rng(reader, self.rank, self.mesh.world_size, self.device)
        self.step = int(reader.step)


def resolve(out: dict) -> dict:
    """A step's device-side results (the fused optimizer's path) as host values, read once the
    step is done."""
    for key, kind in (("grad_norm", float), ("nonfinite", bool), ("skipped", bool)):
        if isinstance(out[key], torch.Tensor):
            out[key] = kind(out[key])
    return out


def _agree_on_resume(mesh, step: int) -> None:
    """Every rank resumes from the same step. Under torchrun each rank made its own plan, and a
    lookup that overlapped rank 0's clean-up of an interrupted save could differ: fail loudly
    (torchrun's restart then looks again) rather than train ranks from different states."""
    if mesh.world_size > 1:
        s = torch.tensor([step, -step], dtype=torch.float64, device=mesh.comm("world").control_device(mesh.device))
        mesh.comm("world").all_reduce(s, op="max")
        if s[0] != -s[1]:
            raise RuntimeError(f"ranks disagree on the checkpoint to resume (steps {int(-s[1])} to {int(s[0])}); "
                               "an interrupted save was being cleaned up: restart the run")


def train_rank(ctx, data_dir: str) -> dict:
    """Worker run on every rank by ``shardlab train`` (``ctx.plan``: the run plan). Returns rank 0's summary."""
    cfg = ctx.plan.config
    run = _Run(ctx, data_dir)
    run.start()
    while run.tr.step < cfg.train.steps:
        out = run.timed_step()
        step = run.tr.step
        if out["anomaly"] and cfg.train.nonfinite == "stop":
            run.stopped = f"stopped at step {step}: {out['anomaly']}; the step was not applied"
            break
        if out["anomaly"]:
            anomaly.report_skipped(run.writer, step, out["anomaly"])
        if out["nonfinite"] and cfg.train.nonfinite == "stop":
            run.stopped = (f"stopped at step {step}: the loss or the gradients are not finite (gradient norm "
                           f"{out['grad_norm']}); the step was not applied. Lower train.lr, or set "
                           "train.nonfinite = \"skip\" to skip such steps"
                           + ("" if cfg.train.detect_anomaly == "off" else " (train.detect_anomaly: no module made an inf/nan "
                              "out of finite values; the loss, the norm or the reduction across ranks did)"))
            break
        if step % cfg.logging.log_every == 0 or step == cfg.train.steps:
            run.log(out)
        if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == cfg.train.steps:
            run.evaluate()
        ctx.after_step(step)  # TEST-ONLY fault injection (a no-op unless the launcher armed it)
        every = cfg.checkpoint.every
        if cfg.checkpoint.save and ((every and step % every == 0) or step == cfg.train.steps):
            run.tr.save_checkpoint(run.ck_dir, ctx.plan.test_hooks)
            if ctx.on_checkpoint:  # Ray Train: every rank reports its own shard files
                ctx.on_checkpoint(run.ck_dir / f"{ckpt.PREFIX}{step:08d}", step)
        run.after_step()
    ckpt.finish_saves(run.mesh)  # an asynchronous save in flight: wait, raise if it failed
    return run.finish()


class _Run:
    """The named steps of :func:`train_rank`: set up (mesh, data, model, resume, peak FLOP/s),
    one timed step, a metrics record over the window since the last one, evaluation, summary."""

    def __init__(self, ctx, data_dir: str):
        plan = ctx.plan
        self.cfg = cfg = plan.config
        t, log = cfg.train, cfg.logging
        self.mesh = mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device, cfg.parallel.comm_algorithm,
                                      check_collectives=cfg.parallel.check_collectives, transport=plan.transport,
                                      flight_dir=str(plan.run_dir / "flight"),  # dumps on failure (docs/faults.md)
                                      comm_thread=cfg.parallel.comm_thread)
        self.data = open_data(cfg, data_dir)
        self.run_dir, self.ck_dir = plan.run_dir, plan.checkpoint_dir
        is_main = mesh.rank == 0
        path = plan.resume_from  # looked up once, in the parent
        _agree_on_resume(mesh, plan.resume_step)
        self.resumed_from = str(path) if path else None
        # resuming or fine-tuning: no initial values to draw, a checkpoint or the base is read next
        self.tr = Trainer(cfg, mesh, self.data, init=path is None and not cfg.checkpoint.base)
        if path is not None:
            self.tr.load_checkpoint(path)
        elif cfg.checkpoint.base:
            self.tr.load_base()
        self.writer = MetricsWriter(self.run_dir, log.tensorboard) if is_main else None
        self.fpt = flops_per_token(cfg.model, t.seq_len, t)  # LoRA: no weight gradient for frozen weights
        self.recompute_fpt = recompute_flops_per_token(cfg) if is_main else None  # hardware FLOPs added
        self.total_peak, self.peak_label = _peak(cfg, mesh)
        self.val_batches = self.tr.loader.val_batches(t.eval_batches)
        self.bar = None
        if is_main and log.progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=t.steps, initial=self.tr.step, desc="train", dynamic_ncols=True, leave=True)
        self.lines = is_main and log.progress and self.bar is None  # a log or a pipe: a line per record
        self.profiler = _profiler(log.profile_steps, self.run_dir, mesh.rank, mesh.device) if log.profile_steps else None
        self.memtrace = None  # profiled steps: memory per rank over them (analysis/memtrace.py)
        if log.profile_steps:
            from ..analysis.memtrace import Recorder
            self.memtrace, self.memtrace_left = Recorder(mesh.device, mesh.rank).__enter__(), log.profile_steps
        self.tokens_per_step = t.global_batch * self.tr.loader.tokens_per_sample  # classify: images per step
        self.window_time, self.window_steps, self.times = 0.0, 0, []
        self.last = {"loss": float("nan"), "val_loss": float("nan"), "accuracy": None}
        self.stopped = None  # why training stopped early (a non-finite loss), else None
        self.snap = mesh.ledger.snapshot()

    def start(self) -> None:
        if self.writer:
            mesh = self.mesh
            self.writer.write({"kind": "start", "step": self.tr.step, "params": self.tr.n_params,
                               "layout": mesh.topology.describe(), "world_size": mesh.world_size,
                               "flops_per_token": self.fpt, "peak_flops": self.total_peak,
                               "peak_label": self.peak_label, "unigram_baseline": self.data.unigram_entropy,
                               "resumed_from": self.resumed_from})

    def timed_step(self) -> dict:
        cuda = self.mesh.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.mesh.device)
        t0 = time.perf_counter()
        if self.memtrace:
            self.memtrace.mark(f"step {self.tr.step}")
        out = self.tr.train_step()
        if self.memtrace:
            self._memtrace_step()
        if cuda:
            torch.cuda.synchronize(self.mesh.device)
        dt = time.perf_counter() - t0
        resolve(out)
        self.window_time += dt
        self.window_steps += 1
        self.times.append(dt)
        if self.profiler:
            self.profiler.step()
        return out

    def _memtrace_step(self):
        self.memtrace_left -= 1
        if self.memtrace_left <= 0:
            _draw_memtrace(self.memtrace, self.run_dir, self.mesh.rank)
            self.memtrace = None

    def log(self, out: dict) -> None:
        """One metrics record over the steps since the last one (throughput, MFU, bytes sent)."""
        tr, mesh, n = self.tr, self.mesh, self.window_steps
        loss = tr.engine.global_loss(out["local_loss"])
        tps = self.tokens_per_step * n / self.window_time
        moved = mesh.ledger.since(self.snap)
        rec = {"kind": "train", "step": tr.step, "loss": loss, "lr": out["lr"], "grad_norm": out["grad_norm"],
               "tokens_per_s": tps, "step_time_s": self.window_time / n,
               "mfu": bounded_mfu(self.fpt * tps, self.total_peak, self.peak_label)[0],
               "comm_bytes_per_step": sum(e.bytes_sent for e in moved.values()) / n,
               "peak_mem_bytes": peak_memory_bytes(mesh.device)[0], "loss_scale": tr.scaler.scale,
               "skipped_steps": tr.scaler.skipped}
        if self.cfg.model.n_experts:  # tokens per expert, dropped fraction (last step), all-to-all bytes
            from ..parallel.expert import moe_metrics
            moe = moe_metrics(tr.engine.model, moved)
            moe["moe/all_to_all_bytes"] = moe.get("moe/all_to_all_bytes", 0) / n
            rec.update(moe)
        self.window_time, self.window_steps = 0.0, 0
        self.last["loss"] = loss
        if self.writer:
            self.writer.write(rec)
        if self.bar:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
        elif self.lines:
            print(f"train: step {tr.step}/{self.cfg.train.steps} loss {loss:.3f} tok/s {tps:,.0f}", file=sys.stderr, flush=True)

    def evaluate(self) -> None:
        self.last["val_loss"], self.last["accuracy"] = self.tr.evaluate(self.val_batches), self.tr.accuracy()
        if self.writer:
            self.writer.write({"kind": "val", "step": self.tr.step, "val_loss": self.last["val_loss"],
                               "accuracy": self.last["accuracy"]})

    def after_step(self) -> None:
        if self.window_steps == 0:  # a record was written: count bytes after eval/checkpoint traffic
            self.snap = self.mesh.ledger.snapshot()
        if self.bar:
            self.bar.update(1)

    def finish(self) -> dict:
        if self.bar:
            self.bar.close()
        if self.profiler:
            self.profiler.stop()
        if self.memtrace:  # fewer steps ran than were profiled
            _draw_memtrace(self.memtrace, self.run_dir, self.mesh.rank)
            self.memtrace = None
        tr, mesh, cfg = self.tr, self.mesh, self.cfg
        steady = self.times[len(self.times) // 5:] or self.times
        mean_dt = sum(steady) / len(steady) if steady else float("nan")
        mfu, label = bounded_mfu(self.fpt * self.tokens_per_step / mean_dt, self.total_peak, self.peak_label)
        if label != self.peak_label:  # the run beat the probed peak: it becomes the cached peak
            note_beaten_peak(mesh, self.fpt * self.tokens_per_step / mean_dt, cfg.train.precision)
        hfu = (bounded_mfu((self.fpt + self.recompute_fpt) * self.tokens_per_step / mean_dt, self.total_peak, label)[0]
               if self.recompute_fpt and self.total_peak else None)  # PaLM's HFU: recomputation counted
        summary = {"steps": tr.step, "task": tr.task, "loss": self.last["loss"], "val_loss": self.last["val_loss"],
                   "accuracy": self.last["accuracy"], "unigram_baseline": self.data.unigram_entropy,
                   "tokens_per_s": self.tokens_per_step / mean_dt,
                   "mfu": mfu, "hfu": hfu, "peak_label": label, "params": tr.n_params, "layout": mesh.topology.describe(),
                   "run_dir": str(self.run_dir), "checkpoint_dir": str(self.ck_dir) if cfg.checkpoint.save else None,
                   "peak_mem_bytes": peak_memory_bytes(mesh.device)[0], "resumed_from": self.resumed_from,
                   "stopped": self.stopped,
                   "ledger": mesh.ledger.as_dict()}
        if self.writer:
            self.writer.write(dict(summary, kind="summary", step=tr.step, ledger=None))
            self.writer.close()
        return summary


def _peak(cfg: Config, mesh: Mesh) -> tuple[float | None, str]:
    """(peak FLOP/s of the whole job, label): configured, the device table, or a CPU matmul probe."""
    peak, label = peak_flops(mesh.device, cfg.train.precision)
    if cfg.logging.peak_flops:
        peak, label = cfg.logging.peak_flops, "configured"
    elif peak is None and mesh.device.type == "cpu":
        return job_cpu_peak(mesh, cfg.train.precision)  # measured once per machine, cached
    return (peak * mesh.world_size if peak else None), label


def _draw_memtrace(rec, run_dir: Path, rank: int):
    """Stop the rank's memory recorder and draw its timeline: profile/memory-rank<R>.png."""
    from ..analysis.memtrace import draw
    rec.__exit__(None, None, None)
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    draw([rec.trace], str(out / f"memory-rank{rank}.png"), f"rank {rank}: memory over the profiled steps")


def _all_threads():
    """Kineto's option to record every thread's operators, so the collectives of a thread started
    before the profiler (``parallel.comm_thread``'s) appear in the trace; None where this torch
    lacks it (docs/training.md, "Overlap")."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def _profiler(steps: int, run_dir: Path, rank: int, device: torch.device):
    from torch.profiler import ProfilerActivity, profile, schedule
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                   experimental_config=_all_threads(),
                   on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"rank{rank}.json")))
    prof.start()
    return prof
