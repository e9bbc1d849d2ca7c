"""Before `make` builds .venv: is this interpreter one jaxspec installs on? pyproject.toml's
requires-python says which (jax 0.10 needs 3.11); an older one gets a one-line error
naming the fix, instead of pip failing to find jax. Runs on any Python 3."""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def required(pyproject: str) -> tuple[int, ...]:
    """The lowest Python version of pyproject.toml's `requires-python = ">=X.Y"`."""
    found = re.search(r'^requires-python\s*=\s*">=\s*([0-9.]+)"', pyproject, re.MULTILINE)
    if found is None:
        raise ValueError('pyproject.toml has no requires-python = ">=X.Y" line')
    return tuple(int(part) for part in found.group(1).split("."))


def problem(version: tuple[int, ...], needed: tuple[int, ...]) -> str | None:
    """None if `version` is at least `needed`, else what to say."""
    if tuple(version[: len(needed)]) >= needed:
        return None
    have, need = ".".join(map(str, version[:3])), ".".join(map(str, needed))
    return (f"error: jaxspec needs Python {need} or newer (its jax does); this is Python "
            f"{have}: run make with PYTHON=python{need} (or any newer interpreter)")  # fmt: skip


if __name__ == "__main__":
    message = problem(sys.version_info, required(PYPROJECT.read_text()))
    if message:
        sys.exit(message)
