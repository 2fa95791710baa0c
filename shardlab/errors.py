"""The error a user can fix: bad input reported as one line naming the field and the fix (exit 2)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting. ``str(err)`` is one line naming the field and the fix."""

    def __init__(self, field_name: str, message: str):
        self.field, self.detail = field_name, message
        super().__init__(f"config error: {field_name}: {message}")
