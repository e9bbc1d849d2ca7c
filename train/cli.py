"""jaxspec-train METHOD ...: trains a drafter for a base model.

Drafter trainers register here as they land (medusa with the speculative engine, then
firp, chimera, sdsat, ppd); until then the command says which exist.
"""

from __future__ import annotations

import argparse

from jaxspec.cli import run_main
from jaxspec.errors import JaxspecError


def _medusa(argv):
    from train.medusa import main

    main(argv)


def _firp(argv):
    from train.firp import main

    main(argv)


def _chimera(argv):
    from train.chimera import main

    main(argv)


def _sdsat(argv):
    from train.sdsat import main

    main(argv)


def _ppd(argv):
    from train.ppd import main

    main(argv)


# method name -> main(argv)
TRAINERS = {"medusa": _medusa, "firp": _firp, "chimera": _chimera, "sdsat": _sdsat, "ppd": _ppd}
PLANNED = ("medusa", "firp", "chimera", "sdsat", "ppd")


def _main(argv) -> None:
    p = argparse.ArgumentParser(prog="jaxspec-train", description=__doc__)
    p.add_argument("method", help=f"one of {', '.join(PLANNED)}")
    args, rest = p.parse_known_args(argv)
    if args.method not in TRAINERS:
        available = ", ".join(TRAINERS) or "none yet"
        raise JaxspecError(
            f"no trainer for method {args.method!r} in this version (available: {available})"
        )
    TRAINERS[args.method](rest)


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
