"""Shared command-line plumbing: every failure a user can cause ends in one line on stderr
(`error: ...`, exit 2), never a traceback; arguments are checked where they are parsed."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from jaxspec.errors import JaxspecError

DEBUG_ENV = "JAXSPEC_DEBUG"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (argparse prints the usage, then the error)."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def run_main(fn: Callable, argv=None) -> None:
    """Run a tool's main: a JaxspecError is its message, anything unexpected one line naming
    the exception (the traceback with JAXSPEC_DEBUG=1)."""
    try:
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
        detail = " ".join(str(e).split())[:300] or "(no message)"
        _fail(f"{type(e).__name__}: {detail}", unexpected=True)


def _fail(message: str, unexpected: bool = False) -> None:
    message = " ".join(message.split())  # one line, whatever the message held
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


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**32) (jax.random.key keeps only the low 32 bits
    without 64-bit mode: larger seeds would silently repeat smaller ones' samples)."""
    value = _number(text, int)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"a seed is an integer from 0 to 2**32 - 1, got {text}")
    return value


def temperature(text: str) -> float:
    """A finite temperature >= 0 (0 means greedy decoding)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or positive, got {value}")
    return value


def probability(text: str) -> float:
    """A top_p in (0, 1]."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 keeps every token), got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def read_text(path: Path, what: str = "file") -> str:
    """A UTF-8 text file's contents, or a one-line error naming the file."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise JaxspecError(f"no such {what}: {path}") from None
    except IsADirectoryError:
        raise JaxspecError(f"{what} {path} is a folder; pass a file") from None
    except UnicodeDecodeError as e:
        raise JaxspecError(
            f"{what} {path} is not UTF-8 text (byte {e.start}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise JaxspecError(f"cannot read {what} {path}: {e.strerror}") from None
