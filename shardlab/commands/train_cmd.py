"""``shardlab train CONFIG --nproc N [--resume] [--profile N] [--dry-run] [--section.key=value ...]``.

Validates the config before any process starts, makes the run plan (train/plan.py: the resume
checkpoint looked up once), prepares the data once in this process (the tokenised corpus, or
checks the image files for a ``classify`` architecture), launches N ranks (or runs in place under
torchrun), and prints where the logs, the plot and the checkpoints went.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from .. import config as C
from .. import launch, launch_ray
from ..errors import at_least, writable_dir
from ..models.spec import get_spec
from ..train import checks, data, finetune, images  # noqa: F401  (checks: registers every config check)
from .. import launch_restart as restart
from ..train.loop import train_rank
from ..train.plan import RunPlan, checkpoint_dir, make_plan


def configure(parser):
    parser.add_argument("config", nargs="?", help="TOML / JSON / DeepSpeed JSON config (see configs/)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local ranks to spawn (default: the product of the parallel degrees)")
    parser.add_argument("--resume", action="store_true", help="resume from the newest valid checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over where an earlier run lives: its metrics, plots and checkpoints are removed "
                             "first (without it, a run directory holding a run is refused)")
    parser.add_argument("--profile", type=int, default=None, metavar="N",
                        help="write a torch.profiler Chrome trace per rank for N steps")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="override train.device")
    parser.add_argument("--run-dir", default=None, help="override logging.run_dir")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="after a rank failure, restart from the newest valid checkpoint, at most K times")
    parser.add_argument("--elastic", default=None, metavar="MIN:MAX",
                        help="plain data parallel: when a restart fails again at start, go on with fewer "
                             "ranks, down to MIN (docs/faults.md)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check everything that is checked before a launch (config, degrees, --resume, "
                             "restart and Ray options), print the plan and exit; nothing starts")
    launch_ray.add_flags(parser)


def resolve(args) -> tuple[C.Config, int, object]:
    """The validated config, the world size and the opened ``checkpoint.base`` (or None)."""
    if args.nproc is not None:
        at_least(args.nproc, 1, "--nproc", "omit it for the product of the parallel degrees")
    cfg = C.load(args.config, args.overrides, world_size=launch.torchrun_world_size() or args.nproc)
    base = finetune.resolve_base(cfg)  # the model section comes from the base
    if args.resume:
        cfg.checkpoint.resume = True
    if args.profile is not None:
        cfg.logging.profile_steps = args.profile
    if args.device:
        cfg.train.device = args.device
    if args.run_dir is not None:
        if not args.run_dir.strip():  # was ignored: the run went to the config's run_dir
            raise C.ConfigError("--run-dir", "is empty; give a directory, or drop it for logging.run_dir")
        cfg.logging.run_dir = args.run_dir
    nproc = launch.torchrun_world_size() or args.nproc or cfg.parallel.world_size
    C.spread_over(cfg, nproc).validate(world_size=nproc)  # degrees not given: data parallel over the ranks
    return cfg, nproc, base


def backend_note(device: str, nproc: int) -> str:
    """The line saying so when the local launcher falls back to gloo on GPUs (more ranks than
    GPUs: NCCL needs one GPU per rank), '' otherwise."""
    import torch
    if device == "cpu" or not torch.cuda.is_available():
        return ""
    backend, _ = launch.choose_backend(device, nproc)
    gpus = torch.cuda.device_count()
    if backend != "gloo":
        return ""
    return (f"shardlab: {nproc} ranks on {gpus} GPU(s): the ranks share GPUs, so the process group is gloo "
            "(NCCL needs one GPU per rank); groups whose ranks share one GPU communicate through CUDA IPC "
            "(parallel.comm_transport auto), the others over gloo; use --nproc <= the GPU count for NCCL"
            + ("" if launch.mps_running() else
               "; CUDA MPS is not running: with it (nvidia-cuda-mps-control -d) the ranks' kernels share the "
               "GPU at once and its all-reduce ran 1.8-2.5x faster on an H100 (docs/gpu.md)"))


def absolute_paths(cfg: C.Config) -> None:
    """Resolve every path of ``cfg`` once, here in the parent, against this working directory:
    ranks, Ray workers (which run in their own directories) and background checkpoint writers
    get absolute paths. Words that are not paths (``shakespeare``, ``smollm2``) stay as they are."""
    cfg.data.cache_dir = str(Path(cfg.data.cache_dir).resolve())
    cfg.logging.run_dir = str(Path(cfg.logging.run_dir).resolve())
    if cfg.checkpoint.dir:
        cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir).resolve())
    for section, key in (("data", "dataset"), ("checkpoint", "base")):
        value = getattr(getattr(cfg, section), key)
        if value and Path(value).exists():
            setattr(getattr(cfg, section), key, str(Path(value).resolve()))


def memory_warning(cfg: C.Config, nproc: int) -> str:
    """CPU ranks of a language model on this machine: one line when their model state alone
    (parameters, gradients, optimizer states: the ZeRO formula over the data-parallel ranks, split
    over tp x pp) exceeds the memory available here; '' otherwise. The parameters counted are the
    matmuls' (``matmul_params_per_token`` with 2 MLP matrices; MoE: the active experts only), so it
    is a lower bound of the peak and never cries wolf; and it is arithmetic (no model is built).
    The whole peak: ``shardlab memory CONFIG --no-run``."""
    import torch
    from ..analysis.measured_memory import formula
    from ..models.decoder import matmul_params_per_token
    from .doctor_cmd import meminfo
    if (cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
            or get_spec(cfg.model).task != "lm"):
        return ""
    p, psi = cfg.parallel, matmul_params_per_token(cfg.model, ffn_matrices=2)
    prec = "fp64" if cfg.train.precision == "fp64" else "mixed" if cfg.train.param_dtype else "fp32"
    n = p.dp_shard * p.cp if p.zero_stage == 3 else p.dp * p.cp
    need = nproc * formula(psi, n, p.zero_stage, prec, 0 if cfg.train.lora_rank else psi).total / (p.tp * p.pp)
    avail = meminfo().get("MemAvailable", 0)
    if not avail or need <= avail:
        return ""
    who = "the rank's" if nproc == 1 else f"the {nproc} ranks'"
    return (f"shardlab: warning: {who} model state alone is at least {need / 2**30:,.1f} GiB, more than "
            f"the {avail / 2**30:,.1f} GiB available here: expect them to be killed for memory (signal 9); the "
            f"whole peak per rank: shardlab memory CONFIG --no-run --nproc {nproc}")


def start_notes(cfg: C.Config, nproc: int, ray_opts) -> None:
    """The warnings of a local start (ranks sharing GPUs, model state beyond this machine's
    memory) on stderr; none for Ray, whose workers run elsewhere. A dry run prints the same."""
    for note in (() if ray_opts else (backend_note(cfg.train.device, nproc), memory_warning(cfg, nproc))):
        if note:
            print(note, file=sys.stderr)


def check_dataset(cfg: C.Config) -> None:
    """--dry-run: the corpus or image files exist (a real start checks them when it prepares the
    data, which a dry run skips: tokenising takes a while)."""
    if get_spec(cfg.model).task == "classify":
        images.prepare(cfg.data)
    else:
        from ..train.data import corpus_files
        corpus_files(cfg.data.dataset)


def check_resume(plan: RunPlan) -> None:
    """With ``--resume``, refuses (exit 2) instead of silently starting over: when the checkpoint
    directory does not exist (a mistyped path), or checkpoints exist but none is usable (the
    plan's resume checkpoint is None; a directory without checkpoints yet is a fresh start)."""
    from ..checkpoint.save import CheckpointError, Reader, list_checkpoints
    directory = plan.checkpoint_dir
    if not plan.config.checkpoint.resume:
        return
    if not directory.is_dir() and not restart.may_start_fresh():  # torchrun --max-restarts K: a fresh start
        raise C.ConfigError("--resume", f"checkpoint directory {directory} does not exist (check "
                                        "checkpoint.dir / logging.run_dir); drop --resume for a fresh start")
    found = list_checkpoints(directory)
    if plan.resume_from is not None:
        from ..checkpoint.pieces import model_mismatch
        reader = Reader(plan.resume_from)
        try:
            why = model_mismatch(reader, plan.config)
            seq = reader.meta.get("config", {}).get("train", {}).get("seq_len")  # the data cursor counts its windows
        finally:
            reader.close()
        if seq and seq != plan.config.train.seq_len:
            raise C.ConfigError("train.seq_len", f"{plan.resume_from} was written with seq_len={seq}; resume with "
                                                 f"--train.seq_len={seq}, or start a new run with --run-dir DIR")
        if why:
            raise C.ConfigError("--resume", f"{plan.resume_from} is of another model: {why}; resume with the settings it "
                                            "was saved with, or start a new run with --run-dir DIR")
    if found and plan.resume_from is None:
        try:
            Reader(found[-1]).close()
            why = "damaged"
        except CheckpointError as e:
            why = str(e)
        raise C.ConfigError("--resume", f"no usable checkpoint in {directory} (newest: {why}); restore or "
                                        "remove the damaged checkpoints, or run without --resume")


# What a run writes into logging.run_dir, beside its checkpoints (--overwrite removes these only).
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "tensorboard", "flight", "profile", "ray")


def earlier_run(plan: RunPlan) -> tuple[str, Path, str] | None:
    """(field, directory, what) of an earlier run where this one would write: checkpoints in the
    checkpoint directory, else a metrics.jsonl in the run directory; None when there is none."""
    from ..checkpoint.save import list_checkpoints
    found = list_checkpoints(plan.checkpoint_dir)
    if found:
        field = "checkpoint.dir" if plan.config.checkpoint.dir else "logging.run_dir"
        return field, plan.checkpoint_dir, f"checkpoints up to {found[-1].name}"
    written = [n for n in ("metrics.jsonl", "summary.json", "loss.png") if (plan.run_dir / n).exists()]
    if written:  # files this run would overwrite
        return "logging.run_dir", plan.run_dir, f"{written[0]}, no checkpoint"
    return None


def check_fresh_start(plan: RunPlan, overwrite: bool) -> None:
    """Without --resume, refuses (exit 2) to start over where an earlier run lives: its checkpoints
    would be overwritten or pruned and its metrics mixed with this run's. --overwrite allows it."""
    if overwrite and plan.config.checkpoint.resume:
        raise C.ConfigError("--overwrite", "starts over, --resume (checkpoint.resume) continues the run; pass one")
    found = None if plan.config.checkpoint.resume or overwrite else earlier_run(plan)
    if found:
        field, where, what = found
        resume = "--resume to continue it, " if what.startswith("checkpoints") else ""
        new = "--run-dir DIR" if field == "logging.run_dir" else "--checkpoint.dir=DIR"
        raise C.ConfigError(field, f"{where} holds an earlier run ({what}); pass {resume}--overwrite to replace "
                                   f"it, or {new} for a new run")


def start_over(plan: RunPlan) -> None:
    """--overwrite (rank 0, before training): remove the earlier run's outputs (RUN_OUTPUTS,
    ``replica_*``) and checkpoints, with one line saying so; other files stay. Where no earlier
    run is found (earlier_run) nothing is removed."""
    import shutil
    from ..checkpoint.save import list_checkpoints
    found = earlier_run(plan)
    if found is None:  # nothing of an earlier run: folders named like its outputs may be yours
        return
    gone = [p for p in (*(plan.run_dir / n for n in RUN_OUTPUTS), *plan.run_dir.glob("replica_*"),
                        *list_checkpoints(plan.checkpoint_dir)) if p.exists()]
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if found:
        print(f"shardlab: --overwrite: removed the earlier run in {found[1]} ({found[2]})", file=sys.stderr)


def clean_interrupted(directory: Path) -> None:
    """Before training (rank 0): remove what interrupted saves left in the checkpoint directory,
    with one line saying so (checkpoint/save.remove_interrupted)."""
    from ..checkpoint.save import remove_interrupted
    removed = remove_interrupted(directory)
    if removed:
        print(f"shardlab: removed {len(removed)} unfinished checkpoint save(s) of an interrupted run: "
              + ", ".join(str(p) for p in removed), file=sys.stderr)


def _finished(plan: RunPlan, quiet: bool = False) -> bool:
    """--resume of a run whose newest checkpoint is already at train.steps: say so in one line."""
    steps = plan.config.train.steps
    if plan.resume_from is None or plan.resume_step < steps:
        return False
    if not quiet:
        print(f"shardlab: nothing to do: the run already finished ({plan.resume_from} is at step "
              f"{plan.resume_step}, train.steps = {steps}); raise --train.steps to train further")
    return True


def main(args) -> int:
    cfg, nproc, base = resolve(args)
    restarts, elastic = _restart_args(args, cfg, nproc)
    if restart.torchrun_restart(cfg):  # a torchrun restart resumes (--resume implied, --overwrite not again)
        args.overwrite = False
    _replica_args(args, cfg)
    ray_opts = _ray_options(args, cfg, restarts, elastic, nproc)
    main_rank = not launch.under_torchrun() or launch.torchrun_rank() == 0
    if main_rank and not args.dry_run:  # first: it may restore the only copy of a step
        clean_interrupted(checkpoint_dir(cfg))
    # the one lookup of the newest valid checkpoint of this start (under torchrun, on every rank)
    plan = make_plan(cfg, test_hooks=launch.test_env(), warn=(lambda m: print(m, file=sys.stderr)) if main_rank and not args.dry_run else lambda *_: None)
    if main_rank or args.dry_run:
        for field, path, write in (("logging.run_dir", plan.run_dir, True), ("data.cache_dir", cfg.data.cache_dir, False),
                                   ("checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir", plan.checkpoint_dir, True)):
            writable_dir(path, field, write)  # a cache made before may be read-only
        check_resume(plan)
        check_fresh_start(plan, args.overwrite)
    launch.check_device(cfg.train.device)  # before a dry run's plan too
    if args.dry_run:
        check_dataset(cfg)
        start_notes(cfg, nproc, ray_opts)  # what a real start would warn of, before it starts
        resuming = f", resuming from {plan.resume_from}" if plan.resume_from else ""
        print(f"shardlab: dry run: {Path(args.config).name if args.config else 'defaults'} on {nproc} rank(s), layout "
              f"{_layout(cfg)}, {cfg.train.steps} steps, {'Ray' if ray_opts else 'local'} launcher{resuming}; run dir "
              f"{cfg.logging.run_dir}; nothing started")
        return 0
    if _finished(plan, quiet=not main_rank):
        return 0
    if args.overwrite and main_rank:
        start_over(plan)
    if main_rank:
        restart.note_torchrun_restart(plan, nproc)  # a line and a restart record, as --max-restarts writes
    absolute_paths(cfg)  # messages above name the paths as written; what starts below gets them absolute
    plan = replace(plan, resume_from=plan.resume_from and plan.resume_from.resolve())
    if get_spec(cfg.model).task == "classify":
        data_dir = images.prepare(cfg.data)
    else:
        data_dir = finetune.prepare_tokens(cfg, base)
        data.check_prepared(data_dir, cfg)  # one batch of windows fits: said here, not by a rank
    if not launch.under_torchrun():
        print(f"shardlab: training {Path(args.config).name if args.config else 'defaults'} on {nproc} "
              f"rank(s), layout {cfg.parallel.world_size and _layout(cfg)}", file=sys.stderr)
        start_notes(cfg, nproc, ray_opts)

    def start(p, n):
        t = p.config.train
        if ray_opts:  # Ray Train workers; restarts are Ray's (FailureConfig(max_failures=K))
            return launch_ray.run(train_rank, n, str(data_dir), device=t.device, timeout_s=t.timeout_s, threads=t.threads,
                                  opts=ray_opts, report_checkpoints=p.config.checkpoint.save, plan=p)
        return launch.run(train_rank, n, str(data_dir), device=t.device, timeout_s=t.timeout_s, threads=t.threads, plan=p)
    if cfg.train.fault_tolerance == "replica":  # live recovery of replica groups (docs/faults.md)
        from .. import launch_replicas
        return launch_replicas.train(plan, nproc, str(data_dir))
    if (restarts or elastic) and not ray_opts:
        results = restart.run_with_restarts(plan, nproc, start, restarts, elastic)
    else:
        results = start(plan, nproc)
    summary = results[0]
    if summary is None or not main_rank:
        return 0
    if summary.get("stopped"):
        print(f"shardlab: {summary['stopped']}", file=sys.stderr)
        return 1
    _report(cfg, summary)
    return 0


def _restart_args(args, cfg, nproc) -> tuple[int, tuple[int, int] | None]:
    """(--max-restarts, --elastic range or None), checked before anything starts."""
    at_least(args.max_restarts, 0, "--max-restarts")
    elastic = restart.parse_elastic(args.elastic) if args.elastic else None
    if (args.max_restarts or elastic) and launch.under_torchrun():
        raise C.ConfigError("--max-restarts", "under torchrun, restarts are torchrun's (--max-restarts there)")
    if elastic and not args.max_restarts:
        raise C.ConfigError("--elastic", "needs --max-restarts K >= 1 (a smaller world is a restart)")
    restart.check_elastic(cfg, nproc, elastic)
    return args.max_restarts, elastic


def _replica_args(args, cfg) -> None:
    """train.fault_tolerance = replica: what it cannot run with, refused before anything starts."""
    if cfg.train.fault_tolerance != "replica":
        return
    from ..train.heal import check
    live = "with train.fault_tolerance=replica a failed replica is replaced live while the others train on"
    if args.max_restarts:
        raise C.ConfigError("--max-restarts", f"not with train.fault_tolerance=replica ({live}); drop --max-restarts, "
                                              "or set --train.fault_tolerance=off for whole-job restarts")
    if args.launcher == "ray" or launch.under_torchrun():
        raise C.ConfigError("train.fault_tolerance", "replica recovery runs under shardlab's own launcher only; "
                                                     "drop --launcher ray / torchrun, or set --train.fault_tolerance=off")
    check(cfg)


def _ray_options(args, cfg, restarts, elastic, nproc):
    """--launcher ray: its options, checked before anything starts (None for the local launcher)."""
    if args.launcher == "ray":
        if launch.under_torchrun():
            raise C.ConfigError("--launcher", "under torchrun the ranks are already started; drop --launcher ray")
        if elastic:
            raise C.ConfigError("--elastic", "not with --launcher ray (Ray Train restarts the same world size)")
        if cfg.checkpoint.async_save:
            raise C.ConfigError("checkpoint.async_save", "Ray Train's checkpoint reporting needs finished saves; "
                                                        "set --checkpoint.async_save=false with --launcher ray")
    return launch_ray.options(args, restarts, str(Path(cfg.logging.run_dir).resolve() / "ray"), nproc)


def _layout(cfg) -> str:
    from ..distributed.topology import Topology
    return Topology.from_config(cfg.parallel).describe()


def _report(cfg, s) -> None:
    run_dir = Path(s["run_dir"])
    plot = None
    try:
        from ..train.plot import plot_run
        plot = plot_run(run_dir)
    except Exception as e:  # a plot must never fail a finished run
        print(f"shardlab: could not draw the loss plot: {e}", file=sys.stderr)
    mfu = f"{100 * s['mfu']:.1f}% ({s['peak_label']})" if s.get("mfu") else f"n/a ({s['peak_label']})"
    classify = s.get("task") == "classify"
    lines = [
        "",
        f"done: {s['steps']} steps, {s['params']:,} parameters, layout {s['layout']}",
        f"  train loss {s['loss']:.4f}   validation loss {s['val_loss']:.4f}   "
        + (f"test accuracy {100 * s['accuracy']:.2f}%   class-prior baseline {s['unigram_baseline']:.4f} nats/image"
           if classify else f"unigram baseline {s['unigram_baseline']:.4f} nats/token"),
        f"  {s['tokens_per_s']:,.0f} {'images' if classify else 'tokens'}/s   MFU {mfu}"
        + (f"   HFU {100 * s['hfu']:.1f}% (recomputed forwards counted)" if s.get("hfu") else ""),
        f"  metrics:     {run_dir / 'metrics.jsonl'}  (TensorBoard: {run_dir / 'tensorboard'})",
        f"  plot:        {plot if plot else 'not drawn'}",
        f"  checkpoints: {s['checkpoint_dir'] or 'disabled'}",
    ]
    if cfg.logging.profile_steps and (run_dir / "profile").is_dir():
        from ..analysis.overlap import report
        lines.append(f"  profile:     {run_dir / 'profile'} (Chrome traces; {report(run_dir / 'profile')})")
    if s.get("resumed_from"):
        lines.append(f"  resumed from {s['resumed_from']}")
    # written first: a reader that stops early (| head) ends the print, and the run kept no summary
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in s.items() if k != "ledger"}, indent=1))
    print("\n".join(lines))
