"""DeepSpeed's checkpoint tags for ``shardlab.initialize``'s engine (docs/api.md, Checkpoint and
resume): ``save_checkpoint(dir, tag)`` saves under ``dir/<tag>/`` and names the tag in
``dir/latest``, as DeepSpeed does (an untagged save's tag is DeepSpeed's ``global_step{N}``);
``load_checkpoint(dir)`` follows ``dir/latest`` when it is there, ``load_checkpoint(dir, tag)``
reads that tag. Only an untagged save with shardlab's ``keep=`` writes ``dir/step_NNNNNNNN``."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

from ..errors import ConfigError

LATEST = "latest"
"""The file in a checkpoint directory naming its newest tag (DeepSpeed's name and content: the tag, as text)."""


def tag_name(tag) -> str:
    """``tag`` (a string or an integer, e.g. DeepSpeed's ``global_step{N}`` or a step number) as a
    directory name; ConfigError for anything that is not one plain name."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise ConfigError("tag", f"must be a string or an integer, got {type(tag).__name__}")
    name = str(tag)
    if not name or name in (".", "..", LATEST) or "/" in name or "\\" in name or name.startswith(".") \
            or any(not c.isprintable() for c in name):
        raise ConfigError("tag", f"{name!r} is not a plain directory name; use letters, digits, '_' or '-' "
                                 "(e.g. global_step100)")
    return name


def save_root(directory, tag) -> Path:
    """Where a save goes: ``directory`` untagged, ``directory/<tag>`` tagged."""
    return Path(directory) if tag is None else Path(directory) / tag_name(tag)


def mark_latest(directory, tag) -> None:
    """Rank 0, after a save: ``directory/latest`` names ``tag`` (written beside, then renamed over);
    a save without a tag (shardlab's ``keep=``) removes it, so the newest ``step_*`` is what an
    untagged load finds."""
    path = Path(directory) / LATEST
    if tag is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{LATEST}.tmp")
    tmp.write_text(tag_name(tag) + "\n")
    os.replace(tmp, path)


def load_root(directory, tag) -> Path:
    """Where a load looks: ``directory/<tag>`` for a tag, else the tag ``directory/latest`` names,
    else ``directory`` itself."""
    d = Path(directory)
    if tag is not None:
        return d / tag_name(tag)
    latest = d / LATEST
    if not latest.is_file():
        return d
    text = latest.read_text().strip()
    try:
        return d / tag_name(text)
    except ConfigError:
        raise ConfigError("tag", f"{latest} names {text!r}, not a tag; pass tag= or delete the file") from None


def find(directory, tag, warn: bool) -> Path | None:
    """The checkpoint a load reads: ``directory`` itself when it is one (a ``step_*`` with its
    index), else the newest valid one under :func:`load_root`; None when there is none, and then
    (``warn``: rank 0) a warning naming why, each damaged checkpoint skipped included, as
    DeepSpeed warns and starts fresh."""
    from .save import INDEX, latest_valid
    d, damaged = load_root(directory, tag), []
    path = d if (d / INDEX).exists() else latest_valid(d, warn=damaged.append)
    if warn:
        if path is None:
            why = ("the directory does not exist" + ("" if d == Path(directory) else f": {d}") if not d.exists()
                   else "it holds no complete checkpoint (a step_NNNNNNNN directory with its index)")
            damaged.append(f"load_checkpoint({str(directory)!r}): nothing loaded, {why}; the engine keeps its "
                           "current weights (a fresh start)")
        for msg in damaged:
            warnings.warn(msg, stacklevel=3)
    return path
