"""The one exception type that command-line tools turn into a one-line message, and the
helpers that phrase it."""

from __future__ import annotations

import numbers
import os
from pathlib import Path


class JaxspecError(Exception):
    """A user-facing error: the message names the problem and the fix."""


def option(name: str) -> str:
    """How an error names an option that the Python API and the tools both take:
    `top_k (--top-k)`."""
    return f"{name} (--{name.replace('_', '-')})"


def given_path(value, what: str) -> Path | None:
    """A path the user gave (str or os.PathLike, `~` expanded) as a Path; None as None. An
    empty string or another type is an error: `what` names the argument."""
    if value is None:
        return None
    if isinstance(value, str) and not value:
        raise JaxspecError(f"{what} is empty: pass a path, or None for the default")
    if not isinstance(value, (str, os.PathLike)):
        raise JaxspecError(f"{what} must be a path (str or Path), got {type(value).__name__}")
    return Path(value).expanduser()


def is_whole(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
