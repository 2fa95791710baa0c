"""``shardlab`` command line. With launch.py, the only module that reads argv or the environment.

Subcommands live in their own modules; each exposes ``configure(parser)`` and ``main(args) -> int``.
Add a command by adding one line to COMMANDS.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "train": ("shardlab.commands.train_cmd", "train a model: shardlab train CONFIG --nproc N [--section.key=value ...]"),
    "config": ("shardlab.commands.config_cmd", "show the resolved config: shardlab config show CONFIG"),
    "bench": ("shardlab.commands.bench_comm", "time collectives, own vs backend: shardlab bench comm --nproc N"),
    "verify": ("shardlab.commands.verify_cmd", "parity matrix: every layout that fits N ranks vs one process (float64)"),
    "checkpoint": ("shardlab.commands.checkpoint_cmd", "inspect, verify, export or import a sharded checkpoint: "
                   "shardlab checkpoint inspect|verify|export|import DIR [--to PATH] [--format hf]"),
    "plot": ("shardlab.commands.plot_cmd", "draw loss curves of a run: shardlab plot RUN_DIR"),
    "schedule": ("shardlab.commands.schedule_cmd", "simulate and draw a pipeline schedule: shardlab schedule --pp 4 --microbatches 8 --schedule 1f1b"),
    "launch": ("shardlab.commands.launch_cmd", "run a script as N local ranks with torchrun's environment: "
               "shardlab launch --nproc N script.py [args ...]"),
    "generate": ("shardlab.commands.generate_cmd", "text from a pretrained model: shardlab generate "
                 "smollm2|MODEL.gguf|HF_DIR|CHECKPOINT --prompt TEXT [--tp N --chat --max-new-tokens N "
                 "--temperature T --top-k K --seed S]"),
    "doctor": ("shardlab.commands.doctor_cmd", "what this machine can run (versions, devices, backends, a 2-rank probe): "
               "shardlab doctor [--json]"),
    "memory": ("shardlab.commands.memory_cmd", "per-rank memory of the configured layout (predicted), ZeRO formula and a real run: shardlab memory CONFIG --nproc N"),
    "plan": ("shardlab.commands.plan_cmd", "rank the layouts of a model on a cluster by predicted tokens/s: "
             "shardlab plan llama-8b --gpus 64 --gpu h100 [--gpus-per-node 8 --global-batch B --seq S --top 5 --plot out.png]"),
}


TAKES_OVERRIDES = {"train", "config", "verify", "memory", "launch"}
"""Commands that read ``--section.key=value`` config overrides (launch passes them to the script)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (the usage block it printed is in --help), exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardlab", description="Every parallelism of large-model "
                     "training, from torch.distributed primitives.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _options=p._option_string_actions)
        importlib.import_module(module).configure(p)
    return parser


def check_unknown_options(command: str, extra: list[str], options) -> None:
    """An argument argparse did not know that is no ``--section.key=value`` override (no dot in its
    name: a mistyped option such as ``--nprocs`` or ``doctor --jsn``) is named with the command's
    closest option, rather than taken for a malformed override."""
    from .config import ConfigError
    from .errors import did_you_mean
    for arg in extra:
        name = arg.split("=")[0]
        if name.startswith("--") and "." not in name:
            known = sorted(o for o in options if o.startswith("--") and o != "--help")
            hint = did_you_mean(name, known) or f"; its options: {' '.join(known)}"
            tail = "; config overrides are written --section.key=value" if command in TAKES_OVERRIDES else ""
            raise ConfigError(name, f"unknown option of shardlab {command}{hint}{tail}")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, ``kill``) turned into the Ctrl-C path: the launcher's
    ``finally`` stops the ranks instead of leaving them to notice their parent's death."""


def _on_sigterm(signum, frame):
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup must not be interrupted again
    raise Terminated()


def _one_line_warning(shown, message, category, filename, lineno, file=None, line=None):
    """A UserWarning of a command (a config key ignored, ...) as one line, not Python's
    "file:line: UserWarning:" with the source line under it; others as Python shows them."""
    if issubclass(category, UserWarning) and type(category) is type and category.__module__ == "builtins":
        print(f"warning: {message}", file=sys.stderr if file is None else file)
    else:
        shown(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Output piped into a reader that stops early (``| head``)
    ends the command quietly (status 141, as if killed by SIGPIPE), without a traceback. SIGTERM
    stops the ranks and ends with one line, status 143."""
    import signal
    import threading
    import warnings
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        with warnings.catch_warnings():
            shown = warnings.showwarning
            warnings.showwarning = functools.partial(_one_line_warning, shown)
            code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except Terminated:
        print("shardlab: terminated (SIGTERM); the ranks were stopped", file=sys.stderr)
        return 143
    except BrokenPipeError:
        import os
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):  # nothing more may reach the closed pipe at exit
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError):
                pass
        return 141
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    from .config import ConfigError, parse_overrides
    from .errors import BAD_INPUT
    from .launch import WorkerError

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Unknown --section.key=value arguments are config overrides.
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    args.overrides = extra
    try:
        check_unknown_options(args.command, extra, args._options)
        parse_overrides(extra)  # whatever argparse did not know must be a --section.key=value override
        if extra and args.command not in TAKES_OVERRIDES:  # never silently ignored
            raise ConfigError(extra[0].split("=")[0], f"shardlab {args.command} takes no --section.key=value "
                                                      f"overrides (only {', '.join(sorted(TAKES_OVERRIDES))} do)")
        return int(importlib.import_module(args._module).main(args) or 0)
    except ConfigError as e:
        if isinstance(e.__context__, BrokenPipeError):  # a command's OSError handler caught the pipe
            raise e.__context__ from None
        print(str(e), file=sys.stderr)
        return 2
    except WorkerError as e:
        first = str(e).split("\n")[1] if "\n" in str(e) else ""
        if sys.stderr.isatty():  # a rank's progress bar may hold the line: start the message on a clean one
            sys.stderr.write("\r\033[K")
        if first.startswith(BAD_INPUT):  # bad input found by a rank
            print(f"shardlab: {e.who}: {first.split(': ', 1)[1]}", file=sys.stderr)
            return 2
        print(f"shardlab: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        if isinstance(e, Terminated):
            raise
        print("shardlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
