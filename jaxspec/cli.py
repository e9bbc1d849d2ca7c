"""Shared command-line plumbing: every failure a user can cause ends in one line on stderr
(`error: ...`, exit 2), never a traceback; arguments are checked where they are parsed."""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable

from jaxspec.drafters.registry import MAX_PPD_K
from jaxspec.errors import JaxspecError

DEBUG_ENV = "JAXSPEC_DEBUG"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (argparse prints the usage, then the error)."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def run_main(fn: Callable, argv=None) -> None:
    """Run a tool's main: a JaxspecError is its message, anything unexpected one line naming
    the exception (the traceback with JAXSPEC_DEBUG=1); a warning is one line too (printed,
    so pytest.warns around a tool's main sees none)."""
    try:
        with warnings.catch_warnings():
            if not os.environ.get(DEBUG_ENV):
                warnings.showwarning = _show_warning
            fn(argv)
    except JaxspecError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit:
        raise
    except BrokenPipeError:  # `jaxspec-generate ... | head`: the reader left
        sys.stderr.close()
        sys.exit(1)
    except MemoryError:
        _fail("out of memory; try a smaller --max-len, tree or batch", unexpected=True)
    except Exception as e:  # noqa: BLE001 - the one place that turns any failure into a line
        if os.environ.get(DEBUG_ENV):
            raise
        detail = _one_line(e)[:300] or "(no message)"
        _fail(f"{type(e).__name__}: {detail}", unexpected=True)


def _one_line(text) -> str:
    """str(text) on one line, whatever it held (newlines, runs of spaces)."""
    return " ".join(str(text).split())


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {_one_line(message)}", file=file or sys.stderr)


def _fail(message: str, unexpected: bool = False) -> None:
    message = _one_line(message)
    if unexpected:
        message += f" (run with {DEBUG_ENV}=1 for the traceback)"
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# Argument types: argparse turns their ArgumentTypeError into a one-line usage error.


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _bounded(kind: type, low, high=None, *, low_open=False, says: str) -> Callable:
    """An argparse type: a finite `kind` in [low, high] (low excluded when `low_open`)."""

    def parse(text: str):
        value = _number(text, kind)
        if value < low or (low_open and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{says}, got {value}")
        return value

    return parse


positive_int = _bounded(int, 1, says="must be at least 1")
nonnegative_int = _bounded(int, 0, says="must be 0 or more")
positive_float = _bounded(float, 0, low_open=True, says="must be positive")
nonnegative_float = _bounded(float, 0, says="must be 0 or more")
temperature = _bounded(float, 0, says="must be 0 (greedy) or positive")
probability = _bounded(float, 0, 1, low_open=True, says="must be in (0, 1]")
ppd_k = _bounded(int, 1, MAX_PPD_K, says=f"must be from 1 to {MAX_PPD_K}")
# The bound of sampling.check_seed, checked here without importing jax.
seed = _bounded(int, 0, 2**32 - 1, says="a seed is an integer from 0 to 2**32 - 1")


def mesh_flag(text: str) -> str:
    """A mesh "data=D,model=M", checked, kept as written (run records and cards show it)."""
    from jaxspec.mesh import parse_mesh

    try:
        parse_mesh(text)
    except JaxspecError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--mesh ")) from None
    return text
