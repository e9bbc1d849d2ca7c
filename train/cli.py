"""jaxspec-train METHOD ...: trains a drafter for a base model."""

from __future__ import annotations

import importlib

from jaxspec.cli import ArgumentParser, run_main
from jaxspec.errors import JaxspecError

# method name -> module whose main(argv) trains it (imported only when chosen)
TRAINERS = {name: f"train.{name}" for name in ("medusa", "firp", "chimera", "sdsat", "ppd")}


def _main(argv) -> None:
    # No help of its own once a method is named: `jaxspec-train firp --help` is firp's.
    p = ArgumentParser(prog="jaxspec-train", description=__doc__, add_help=False)
    p.add_argument("method", nargs="?", help=f"one of {', '.join(TRAINERS)}")
    args, rest = p.parse_known_args(argv)
    if args.method is None:
        if {"-h", "--help"} & set(rest):
            p.print_help()
            return
        raise JaxspecError(f"name a method to train: jaxspec-train {{{','.join(TRAINERS)}}} ...")
    if args.method not in TRAINERS:
        raise JaxspecError(
            f"no trainer for method {args.method!r} (available: {', '.join(TRAINERS)})"
        )
    importlib.import_module(TRAINERS[args.method]).main(rest)


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
