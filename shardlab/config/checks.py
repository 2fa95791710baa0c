"""Per-field ranges and choices, declared next to each field (``config.f(default, doc, ge=..., ...)``)
and checked here generically, before the cross-field checks of ``validation.validate``.

A refused value is one line naming the field, the value, what is allowed and the field's docstring:
``config error: train.global_batch: got -4; must be >= 1 (Sequences per optimizer step ...)``.
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError, one_of

def _doc(fl) -> str:
    doc = fl.metadata.get("doc", "")
    first = doc.split(". ")[0].rstrip(".")
    return first if len(first) <= 110 else first[:107] + "..."


def allowed(fl) -> str:
    """What the field accepts, e.g. ``>= 1, <= 65536`` or ``one of fp32, bf16``; '' when anything goes."""
    m = fl.metadata
    if m.get("choices") is not None:
        return "one of " + ", ".join(repr(c) if c == "" else str(c) for c in m["choices"])
    parts = [f"{op} {m[k]:g}" if isinstance(m[k], float) else f"{op} {m[k]}"
             for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if m.get(k) is not None]
    if m.get("nonempty"):
        parts.append("not empty")
    return ", ".join(parts)


def check_field(section: str, fl, value) -> None:
    """Raise ConfigError unless ``value`` is within the field's declared range/choices."""
    m, name = fl.metadata, f"{section}.{fl.name}"
    if m.get("choices") is not None:
        one_of(value, tuple(m["choices"]), name)
        return
    if isinstance(value, float) and m.get("finite", True) and not math.isfinite(value):
        raise ConfigError(name, f"got {value!r}; must be a finite number ({allowed(fl) or 'any'}) ({_doc(fl)})")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, ok in (("ge", lambda b: value >= b), ("gt", lambda b: value > b),
                        ("le", lambda b: value <= b), ("lt", lambda b: value < b)):
            if m.get(key) is not None and not ok(m[key]):
                raise ConfigError(name, f"got {value!r}; must be {allowed(fl)} ({_doc(fl)})")
    if m.get("nonempty") and (not value or (isinstance(value, str) and not value.strip())):
        raise ConfigError(name, f"got {value!r}; must not be empty ({_doc(fl)})")
    if isinstance(value, list) and any(not str(v).strip() for v in value):
        raise ConfigError(name, f"got {value!r}; items must not be empty ({_doc(fl)})")


def check_ranges(cfg) -> None:
    """Every field of every section (the config's own dataclass fields) against its declared
    range (first failure raised)."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for fl in dataclasses.fields(obj):
            check_field(section.name, fl, getattr(obj, fl.name))
