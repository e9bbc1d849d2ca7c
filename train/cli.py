"""jaxspec-train METHOD ...: trains a drafter for a base model."""

from __future__ import annotations

import importlib

from jaxspec.cli import ArgumentParser, run_main
from jaxspec.errors import JaxspecError

# the methods, each trained by main(argv) of this package's module of that name (imported
# only when chosen)
TRAINERS = ("medusa", "firp", "chimera", "sdsat", "ppd", "eagle")


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
    importlib.import_module(f".{args.method}", __package__).main(rest)


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
