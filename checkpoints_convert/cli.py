"""jaxspec-convert [SRC] --out DIR [--to {jaxspec,hf}] [--dtype D] [--if-missing] [--overwrite]"""

from __future__ import annotations

import time
from pathlib import Path

from jaxspec.checkpoint import DEFAULT_MODEL_NAME, default_model_dir, is_checkpoint
from jaxspec.cli import ArgumentParser, run_main
from jaxspec.errors import JaxspecError
from jaxspec.models import DTYPES
from jaxspec.outputs import check_output_dir


def parse_args(argv=None):
    p = ArgumentParser(
        prog="jaxspec-convert",
        description="Convert an HF folder (safetensors) or a .gguf file into a jaxspec "
        "checkpoint, or a jaxspec checkpoint back to HF (--to hf). With no SRC, converts "
        "the packaged default model (SmolLM2-135M-Instruct) into the user cache.",
    )
    p.add_argument("src", nargs="?", type=Path, help="HF folder, .gguf file or jaxspec checkpoint")
    p.add_argument(
        "--out", type=Path, help="output folder (default: the user cache for SRC-less runs)"
    )
    p.add_argument("--to", choices=("jaxspec", "hf"), default="jaxspec", help="output format")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="write the weights in this dtype, cast tensor by tensor (default: as stored; a "
        "GGUF's dequantised to float32, twice the size of bfloat16)",
    )
    p.add_argument(
        "--if-missing", action="store_true", help="do nothing if OUT already holds a checkpoint"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty OUT, replacing files of the same names (never allowed: "
        "an OUT that is, holds or lies inside SRC)",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    run_main(_main, argv)


def _main(argv) -> None:
    from jaxspec.convert import convert
    from jaxspec.convert.default_model import packaged_gguf

    args = parse_args(argv)
    src = args.src or packaged_gguf()
    out = args.out or (default_model_dir() if args.src is None else None)
    if out is None:
        raise JaxspecError("--out DIR is required when SRC is given")
    if args.if_missing and args.to == "jaxspec" and is_checkpoint(out):
        print(f"checkpoint already at {out}")
        return
    own = args.src is None and args.out is None  # the cache folder, not a user's
    if own and args.to != "jaxspec":
        raise JaxspecError(
            f"--to {args.to} without SRC needs --out DIR: the model cache holds the default "
            "model as a jaxspec checkpoint, which every tool reads"
        )
    if own and args.dtype and is_checkpoint(out) and not args.overwrite:
        raise JaxspecError(
            f"the model cache already holds the default model ({out}); --dtype {args.dtype} "
            "would replace it for every tool: pass --out DIR for a copy in that dtype (tools "
            "cast the weights when they load them: --dtype there), or --overwrite"
        )
    # The default model's folder is jaxspec's own cache: a conversion cut short is redone.
    what = "--out" if args.out else "the model cache ($JAXSPEC_HOME)"
    check_output_dir(out, [src], overwrite=args.overwrite or own, what=what)
    start = time.perf_counter()
    convert(src, out, args.to, name=None if args.src else DEFAULT_MODEL_NAME, dtype=args.dtype)
    print(f"converted {src} -> {out} ({args.to}) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
