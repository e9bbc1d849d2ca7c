"""jaxspec-bench: every method on the same prompts in one process, AR included
(`jaxspec.bench.run_benchmark`: rows interleaved question by question, compilation and a
warm-up excluded from timing). Writes FILE.json, FILE.md (table) and FILE.png (plot); an
existing FILE is replaced only with --overwrite (the default FILE, bench_results.json,
gets a free numbered name instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec import METHODS
from jaxspec.bench import PEERS, check_rows, markdown, run_benchmark, write_results
from jaxspec.cli import (
    ArgumentParser,
    mesh_flag,
    nonnegative_int,
    positive_int,
    ppd_k,
    probability,
    run_main,
    seed,
    temperature,
)
from jaxspec.decode import PRODUCTS
from jaxspec.drafters.registry import REGISTRY, row_source
from jaxspec.errors import JaxspecError
from jaxspec.models import DTYPES
from jaxspec.outputs import check_output_file
from jaxspec.sampling import Sampling

DEFAULT_OUT = Path("bench_results.json")


def parse_args(argv=None):
    p = ArgumentParser(prog="jaxspec-bench", description=__doc__)
    p.add_argument(
        "--methods",
        default="ar",
        help=f"comma list of {', '.join(METHODS + PEERS)}; METHOD@TREE picks a tree "
        "(e.g. medusa@searched-16,firp@searched-16: the same node budget), firp@TREE/N "
        "FIRP's chains on N nodes, sdsat/one-forward SDSAT's one-forward loop (sdsat@TREE/"
        "one-forward with a tree), ppd@LAYER the early-prediction layer, METHOD@dynamic-N+R "
        "R retrieved continuations joining the dynamic tree (medusa, firp, chimera, eagle)",
    )
    p.add_argument(
        "--questions",
        required=True,
        help="PATH.jsonl (Spec-Bench format), humaneval or sharegpt-test",
    )
    p.add_argument("--limit", type=positive_int, help="use the first N questions")
    p.add_argument(
        "--per-category", type=positive_int, help="use the first N questions of each category"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--model", type=Path)
    p.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="METHOD=DIR",
        help="METHOD's rows use the drafter in DIR instead of the shipped one (repeatable); "
        "METHOD#LABEL=DIR: only the rows named METHOD#LABEL, e.g. medusa#mine@searched-32 "
        "beside medusa@searched-32",
    )
    p.add_argument(
        "--out",
        type=Path,
        help=f"results FILE.json; the table and plot go beside it as FILE.md and FILE.png "
        f"(default: {DEFAULT_OUT}, or a numbered name when that exists)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the --out files when they exist"
    )
    p.add_argument(
        "--single-turn", action="store_true", help="only the first turn of each question"
    )
    p.add_argument(
        "--temperature", type=temperature, default=0.0, help="0: greedy (match_ar is then exact)"
    )
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument(
        "--top-k", type=nonnegative_int, default=0, help="sample among the k likeliest (0: all)"
    )
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument(
        "--typical",
        action="store_true",
        help="drafted rows verify with Medusa's typical acceptance (NOT lossless; needs "
        "--temperature > 0)",
    )
    p.add_argument("--ppd-k", type=ppd_k, help="ppd rows: sub-processes (default 3)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weight dtype of every row; a row named METHOD:DTYPE (e.g. ar:float32) uses its own",
    )
    p.add_argument(
        "--products", choices=PRODUCTS,
        help="how every row's bfloat16 weights multiply: exact, plain-prefill or plain (one "
        "bfloat16 pass in the prefill, or everywhere); default plain-prefill on a GPU, "
        "else exact",
    )  # fmt: skip
    p.add_argument(
        "--mesh", type=mesh_flag,
        help="data=D,model=M: split the model over devices (tensor parallel over model; on CPU "
        "the D*M virtual devices are set up for you; ppd rows: each stage split M ways)",
    )  # fmt: skip
    return p.parse_args(argv)


def output_paths(out: Path | None, overwrite: bool) -> tuple[Path, Path, Path]:
    """(FILE.json, FILE.md, FILE.png), checked before any work: writable, never a folder,
    and no existing file replaced unless `overwrite`."""
    if out is None:
        out, n = DEFAULT_OUT, 1
        while any(p.exists() for p in _derived(out)) and not overwrite:
            n += 1
            out = DEFAULT_OUT.with_name(f"{DEFAULT_OUT.stem}-{n}.json")
    if out.suffix != ".json":
        raise JaxspecError(
            f"--out {out}: name the results .json file (e.g. {out.with_suffix('.json')}); the "
            "table and plot are written beside it as .md and .png"
        )
    paths = _derived(out)
    for path in paths:
        check_output_file(path)
        if path.exists() and not overwrite:
            raise JaxspecError(f"{path} exists; pass --overwrite to replace it, or another --out")
    return paths


def _derived(out: Path) -> tuple[Path, Path, Path]:
    return out, out.with_suffix(".md"), out.with_suffix(".png")


def parse_drafters(items: list[str], methods: list[str]) -> dict[str, Path]:
    """--drafter METHOD[#LABEL]=DIR options -> {METHOD[#LABEL]: DIR}, each naming rows here;
    every labelled row has one."""
    drafters = {}
    sources = {row_source(m) for m in methods if m not in PEERS}
    for item in items:
        source, eq, folder = item.partition("=")
        if not eq or not folder:
            raise JaxspecError(f"--drafter {item}: write METHOD=DIR, e.g. chimera=drafters/mine")
        method = source.partition("#")[0]
        if method not in REGISTRY or not REGISTRY[method].drafter_folder:
            raise JaxspecError(f"--drafter {item}: {method!r} is not a method with a drafter")
        if source not in sources:
            raise JaxspecError(f"--drafter {item}: no {source} row in --methods")
        if source in drafters:
            raise JaxspecError(f"--drafter {source} is given twice; give each row one drafter "
                               f"(a second one: a row {method}#LABEL with --drafter "
                               f"{method}#LABEL=DIR)")  # fmt: skip
        drafters[source] = Path(folder)
    unnamed = sorted(s for s in sources if "#" in s and s not in drafters)
    if unnamed:
        raise JaxspecError(f"{unnamed[0]} rows: name their drafter with --drafter {unnamed[0]}=DIR")
    return drafters


def _main(argv) -> None:
    args = parse_args(argv)
    paths = output_paths(args.out, args.overwrite)
    rows = check_rows([m.strip() for m in args.methods.split(",") if m.strip()])
    result = run_benchmark(
        rows, args.questions, model=args.model, limit=args.limit,
        per_category=args.per_category, max_new_tokens=args.max_new_tokens,
        drafters=parse_drafters(args.drafter, rows), single_turn=args.single_turn,
        sampling=Sampling(args.temperature, args.top_k, args.top_p, args.typical), seed=args.seed,
        ppd_k=args.ppd_k, dtype=args.dtype, products=args.products, mesh=args.mesh,
        command="jaxspec-bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    )  # fmt: skip
    write_results(result, paths)
    print(markdown(result))
    print(f"wrote {', '.join(map(str, paths))}")


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
