"""The device campaign in one command (`jaxspec.device_bench`): AR decode against the
memory-bandwidth floor, verify steps over trees of 1-64 nodes, prefill at 2k/8k/32k tokens
(Llama-3-8B shapes, random bfloat16 weights), the default model end to end with every
method, and verify steps at 70B-layer shapes; within a budget of under 8 minutes. Writes
FILE.json and FILE.md, rewritten after every row (a run cut short still leaves them).

    python -m infer.device_bench --out $OUT/device_bench.json      # on a device
    python -m infer.device_bench --dry-run --out /tmp/dry.json     # tiny shapes, CPU, fast

Exits 2 when a part failed (its error is in the file); skipped parts (no model, no
question file, not enough memory, the time cap) are results, not failures.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec.cli import ArgumentParser, positive_float, run_main
from jaxspec.compile_cache import default_dir
from jaxspec.device_bench import PARTS, run_campaign
from jaxspec.device_bench.end_to_end import GROUP_NAMES, SETS, chosen_groups
from jaxspec.errors import JaxspecError
from jaxspec.outputs import check_output_file


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m infer.device_bench", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="FILE.json (FILE.md beside it)")
    p.add_argument("--dry-run", action="store_true", help="every part at tiny shapes")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma list of parts to run, in this order: {', '.join(PARTS)}",
    )
    p.add_argument(
        "--groups",
        help="the default model's groups to run (default: all), comma list of GROUP (in "
        "each set that runs it by default) or SET:GROUP, e.g. humaneval:searched-32 "
        f"(groups: {', '.join(GROUP_NAMES)}; sets: {', '.join(SETS)})",
    )
    p.add_argument(
        "--budget-s",
        type=positive_float,
        help="seconds for all parts (default 450; dry run 600), shared out by part",
    )
    p.add_argument(
        "--bandwidth-gbs",
        type=positive_float,
        help="the device's memory bandwidth (default: from its kind)",
    )
    p.add_argument(
        "--questions",
        type=Path,
        default=Path("../shared/data/spec_bench_question.jsonl"),
        help="Spec-Bench question file (missing: that set is skipped)",
    )
    p.add_argument("--model", type=Path, help="a model instead of the default one")
    p.add_argument(
        "--compile-cache",
        type=Path,
        help="folder keeping compiled programs for later groups and calls (default: "
        "$JAXSPEC_HOME/xla-cache; a dry run keeps none unless given)",
    )
    p.add_argument("--no-compile-cache", action="store_true", help="compile every program")
    return p.parse_args(argv)


def _main(argv) -> None:
    args = parse_args(argv)
    if args.out.suffix != ".json":
        raise JaxspecError(f"--out {args.out}: name a .json file; the markdown goes beside it")
    check_output_file(args.out)
    for existing in (args.out, args.out.with_suffix(".md")):
        if existing.exists() and not args.overwrite:
            raise JaxspecError(f"{existing} exists; pass --overwrite to replace it")
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise JaxspecError(f"--parts {args.parts}: choose among {', '.join(PARTS)}")
    groups = None if args.groups is None else chosen_groups(args.groups)
    if groups and "default_model" not in parts:
        raise JaxspecError("--groups picks groups of the default_model part: add it to --parts")
    cache = args.compile_cache or (None if args.dry_run else default_dir())
    result = run_campaign(
        args.out,
        dry_run=args.dry_run,
        budget_s=args.budget_s,
        parts=parts,
        groups=groups,
        bandwidth_gbs=args.bandwidth_gbs,
        questions=args.questions,
        model=args.model,
        compile_cache=None if args.no_compile_cache else cache,
        command="python -m infer.device_bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    for name, record in result["parts"].items():
        reason = f" ({record['reason']})" if record.get("reason") else ""
        print(f"{name}: {record['status']}, {record['seconds']:.0f} s{reason}")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} in {result['elapsed_s']:.0f} s")
    failed = [n for n, r in result["parts"].items() if r["status"] == "failed"]
    if failed:
        raise JaxspecError(f"parts failed: {', '.join(failed)}; their errors are in {args.out}")


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
