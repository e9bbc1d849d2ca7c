"""Shared command-line plumbing: user errors become one line, not a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from jaxspec.errors import JaxspecError


def run_main(fn: Callable, argv=None) -> None:
    try:
        fn(argv)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
