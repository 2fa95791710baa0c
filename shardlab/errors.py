"""The error a user can fix: bad input reported as one line naming the field and the fix (exit 2),
and the small checks every layer uses to raise it (the bottom of the import graph: no shardlab
imports, so config, models and each parallel module can check their own settings)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting. ``str(err)`` is one line naming the field and the fix."""

    def __init__(self, field_name: str, message: str):
        self.field, self.detail = field_name, message
        super().__init__(f"config error: {field_name}: {message}")


BAD_INPUT = ("CheckpointError:", "ConfigError:")
"""First words of a rank's error that mean bad input (one line, exit 2), not a crash."""


def require(cond: bool, field_name: str, message: str) -> None:
    """Raise ConfigError(field_name, message) unless ``cond``."""
    if not cond:
        raise ConfigError(field_name, message)


def at_least(value, low, field_name: str, hint: str = "") -> None:
    """ConfigError(field_name, "must be >= low, got value[; hint]") when ``value < low``: the
    commands' counts (--nproc, --steps, --seq, ...; docs/configuration.md, Command-line counts)."""
    if value < low:
        raise ConfigError(field_name, f"must be >= {low}, got {value}" + (f"; {hint}" if hint else ""))


def output_file(path, field_name: str, suffix: str = ".png") -> None:
    """A file a command writes at its end, checked before its work starts (a bad path used to end
    a finished run in a traceback, its result unwritten): not a directory, in an existing folder,
    named with ``suffix``."""
    import os
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(field_name, f"{path} is a directory; give a file, e.g. {os.path.join(path, 'out' + suffix)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(field_name, f"{path}: the folder {folder} does not exist; create it or write elsewhere")
    if not str(path).lower().endswith(suffix):
        raise ConfigError(field_name, f"{path}: give a {suffix} file")


def writable_dir(path, field_name: str, write: bool = True) -> None:
    """A directory a command creates (or, with ``write``, writes into), checked before its work
    starts: a file there, a file on its way, or a folder it cannot create in used to end a run in
    a rank's traceback, after its training, the half-made run directory then blocking the retry."""
    import os
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(field_name, f"{path} is a file; give a directory")
    up = path
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise ConfigError(field_name, f"{path}: {up} is a file; give a directory path")
    if (write or up != path) and not os.access(up, os.W_OK | os.X_OK):
        raise ConfigError(field_name, f"{path}: cannot write in {up}; give a directory you can write to")


def did_you_mean(name: str, options) -> str:
    import difflib
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def one_of(value, options, field_name: str) -> None:
    if value not in options:  # the suggestion only when it fails: validate runs once per planned layout
        raise ConfigError(field_name, f"unknown value {value!r}{did_you_mean(str(value), [str(o) for o in options])}; "
                                      f"choose one of {', '.join(map(str, options))}")
