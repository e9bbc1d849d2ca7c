"""jaxspec-bench: every method on the same prompts in one process, AR included.

Methods run interleaved question by question, so slow drifts of the machine hit all of
them alike. Compilation and a warm-up generation per method are excluded from timing.
Writes FILE.json, FILE.md (table) and FILE.png (plot); an existing FILE is replaced only
with --overwrite (the default FILE, bench_results.json, gets a free numbered name instead).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path

import jax
from tqdm import tqdm

from jaxspec.cli import (
    ArgumentParser,
    nonnegative_int,
    positive_int,
    probability,
    run_main,
    seed,
    temperature,
)
from jaxspec.data.sources import load_questions
from jaxspec.errors import JaxspecError
from jaxspec.llama import compute_params
from jaxspec.methods import METHODS, SDSAT_LOOPS, build_generator, check_method, provide_devices
from jaxspec.models import DTYPES, load_model
from jaxspec.outputs import atomic_path, check_output_file, write_text
from jaxspec.sampling import Sampling
from jaxspec.text import encode_conversation

PEERS = ("hf",)
DEFAULT_OUT = Path("bench_results.json")


def parse_args(argv=None):
    p = ArgumentParser(prog="jaxspec-bench", description=__doc__)
    p.add_argument(
        "--methods",
        default="ar",
        help=f"comma list of {', '.join(METHODS + PEERS)}; METHOD@TREE picks a tree "
        "(e.g. medusa@searched-16,firp@searched-16: the same node budget), firp@TREE/N "
        "FIRP's chains on N nodes, sdsat/one-forward SDSAT's one-forward loop (sdsat@TREE/"
        "one-forward with a tree), ppd@LAYER the early-prediction layer",
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
        help="METHOD's rows use the drafter in DIR instead of the shipped one (repeatable)",
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
    p.add_argument("--ppd-k", type=positive_int, default=3, help="ppd rows: sub-processes")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weight dtype of every row; a row named METHOD:DTYPE (e.g. ar:float32) uses its own",
    )
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


def select(questions, limit, per_category):
    if per_category:
        seen = defaultdict(int)
        kept = []
        for q in questions:
            seen[q.category] += 1
            if seen[q.category] <= per_category:
                kept.append(q)
        questions = kept
    return questions[:limit] if limit else questions


def parse_drafters(items: list[str], methods: list[str]) -> dict[str, Path]:
    """--drafter METHOD=DIR options -> {method: DIR}, for methods that have rows here."""
    drafters = {}
    for item in items:
        method, eq, folder = item.partition("=")
        if not eq or not folder:
            raise JaxspecError(f"--drafter {item}: write METHOD=DIR, e.g. chimera=drafters/mine")
        if method not in METHODS or method == "ar":
            raise JaxspecError(f"--drafter {item}: {method!r} is not a method with a drafter")
        if method not in {parse_row(m)[0] for m in methods if m not in PEERS}:
            raise JaxspecError(f"--drafter {item}: no {method} row in --methods")
        drafters[method] = Path(folder)
    return drafters


def parse_row(name: str) -> tuple[str, str, str | None, str]:
    """METHOD[@OPTION][/EXTRA][:DTYPE] -> (method, option, EXTRA or None, dtype); EXTRA is
    FIRP's chained nodes N or SDSAT's loop (one-forward / two-forward)."""
    spec, _, dtype = name.partition(":")
    spec, slash, extra = spec.partition("/")
    method, _, option = spec.partition("@")
    if method == "ar" and option:
        raise JaxspecError(f"{name}: ar decodes without a draft tree; drop @{option}")
    if method == "ppd" and option and not option.isdigit():
        raise JaxspecError(f"{name}: a ppd row's @LAYER is a layer number, e.g. ppd@20")
    if slash and method == "sdsat" and extra not in SDSAT_LOOPS:
        raise JaxspecError(f"{name}: an sdsat row's /LOOP is one of {', '.join(SDSAT_LOOPS)}")
    if slash and method != "sdsat" and (method != "firp" or not extra.isdigit()):
        raise JaxspecError(
            f"{name}: /N (FIRP's pseudo chains on N nodes, N >= 0) applies to firp rows only"
        )
    return method, option, extra if slash else None, dtype


class Runner:
    """One method (optionally METHOD@TREE, firp@TREE/N with chains on N nodes,
    sdsat[@TREE]/LOOP, or ppd@LAYER, then :DTYPE):
    generate(prompt_ids, n) -> (new ids, steps, seconds excluding compile)."""

    def __init__(
        self, name, model, sampling: Sampling | None = None, seed: int = 0, ppd_k=3,
        drafters: dict[str, Path] | None = None,
    ):  # fmt: skip
        self.name, self.seed = name, seed
        if name == "hf":
            from infer.hf_peer import HFPeer

            self.peer = HFPeer(model.cfg, model.params)
        else:
            method, option, extra, _ = parse_row(name)
            drafter_dir = (drafters or {}).get(method)  # None: the shipped drafter
            if method == "ppd":  # ppd@LAYER picks the early-prediction layer
                self.generator = build_generator(
                    model, method, drafter_dir, sampling=sampling, ppd_k=ppd_k,
                    ppd_layer=int(option) if option else None,
                )  # fmt: skip
            else:
                self.generator = build_generator(
                    model, method, drafter_dir, option or None, sampling,
                    firp_chains=int(extra) if extra and method == "firp" else None,
                    sdsat_loop=extra if method == "sdsat" else None,
                )  # fmt: skip

    def generate(self, prompt_ids, max_new_tokens):
        if self.name == "hf":
            return self.peer.generate(prompt_ids, max_new_tokens)
        r = self.generator.generate(prompt_ids, max_new_tokens, self.seed)
        return r.token_ids, r.steps, r.prefill_s + r.decode_s


def row_dtype(name: str, run_dtype: str) -> str:
    """A row's weight dtype: its own (METHOD:DTYPE) or the run's; the hf peer's float32."""
    return "float32" if name in PEERS else name.partition(":")[2] or run_dtype


def match_reference(name: str, run_dtype: str, methods: list[str]) -> str:
    """The AR row a row's outputs are compared with: AR in the row's own dtype when the run
    has it (like for like); AR rows in other dtypes against "ar", to show how far apart
    those models' outputs are."""
    dtype = row_dtype(name, run_dtype)
    if name.partition(":")[0] == "ar" or dtype == run_dtype or f"ar:{dtype}" not in methods:
        return "ar"
    return f"ar:{dtype}"


def summarize(records, methods, references):
    """records: method -> list of (category, ids, steps, seconds); speedups are over "ar",
    match_ar is against references[method] (the AR row of the method's dtype)."""

    def stats(m, idx):
        rows, ar_rows = [records[m][i] for i in idx], [records[references[m]][i] for i in idx]
        tokens = sum(len(r[1]) for r in rows)
        seconds = sum(r[3] for r in rows)
        return {
            "tokens_per_s": tokens / seconds,
            "mean_accepted": tokens / max(sum(r[2] for r in rows), 1),
            "match_ar": sum(r[1] == a[1] for r, a in zip(rows, ar_rows, strict=True)) / len(rows),
            "reference": references[m],
            "new_tokens": tokens,
            "seconds": seconds,
        }

    overall = {m: stats(m, range(len(records["ar"]))) for m in methods}
    categories = {}
    for cat in dict.fromkeys(r[0] for r in records["ar"]):
        idx = [i for i, r in enumerate(records["ar"]) if r[0] == cat]
        categories[cat] = {m: stats(m, idx) for m in methods}
    for table in [overall, *categories.values()]:
        for m in methods:
            table[m]["speedup"] = table[m]["tokens_per_s"] / table["ar"]["tokens_per_s"]
    return overall, categories


def markdown(result) -> str:
    def vs(stats):
        return "" if stats["reference"] == "ar" else f" (vs {stats['reference']})"

    lines = [
        "| method | tokens/s | speedup | mean accepted | match_ar |",
        "|---|---|---|---|---|",
    ]
    for m, s in result["methods"].items():
        lines.append(
            f"| {m} | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}x | "
            f"{s['mean_accepted']:.2f} | {s['match_ar']:.2f}{vs(s)} |"
        )
    if len(result["categories"]) > 1:
        lines += ["", "| category | " + " | ".join(result["methods"]) + " |"]
        lines.append("|---" * (len(result["methods"]) + 1) + "|")
        for cat, per in result["categories"].items():
            cells = [f"{s['tokens_per_s']:.1f} ({s['speedup']:.2f}x)" for s in per.values()]
            lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["methods"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [result["methods"][m]["tokens_per_s"] for m in names], color="tab:blue")
    axes[0].set_ylabel("tokens / s")
    axes[1].bar(names, [result["methods"][m]["mean_accepted"] for m in names], color="tab:green")
    axes[1].set_ylabel("mean accepted tokens / step")
    fig.suptitle(f"{result['model']} on {result['questions']} ({result['machine']})", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _main(argv) -> None:
    args = parse_args(argv)
    out_json, out_md, out_png = output_paths(args.out, args.overwrite)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in PEERS:
            method, _, _, dtype = parse_row(m)
            check_method(method)
            if dtype and dtype not in DTYPES:
                raise JaxspecError(f"{m}: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    methods = ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"]
    drafters = parse_drafters(args.drafter, methods)
    if any(m.startswith("ppd") for m in methods):
        provide_devices(args.ppd_k + 1)
    questions = select(load_questions(args.questions), args.limit, args.per_category)
    if not questions:
        raise JaxspecError("no questions selected; check --questions / --limit")
    stored = load_model(args.model)
    models = {}  # dtype -> the model with its weights cast from the stored ones

    def model_for(name: str):
        dtype = row_dtype(name, args.dtype)
        if dtype not in models:
            models[dtype] = dataclasses.replace(stored, params=compute_params(stored.params, dtype))
        return models[dtype]

    model = model_for("ar")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    if not sampling.greedy and "hf" in methods:
        raise JaxspecError("the hf peer row is greedy only: drop it or set --temperature 0")

    runners = {
        m: Runner(m, model_for(m), sampling, args.seed, args.ppd_k, drafters) for m in methods
    }

    warm = encode_conversation(
        model.tokenizer, [{"role": "user", "content": questions[0].turns[0]}]
    )
    for runner in runners.values():  # compile and warm up outside the timed region
        runner.generate(warm, args.max_new_tokens)

    records = {m: [] for m in methods}
    turns = sum(1 if args.single_turn else len(q.turns) for q in questions)
    bar = tqdm(total=turns * len(methods), desc="bench", unit="gen", file=sys.stderr)
    for q in questions:
        history = {m: [] for m in methods}
        for turn in q.turns[:1] if args.single_turn else q.turns:
            for m, runner in runners.items():
                history[m].append({"role": "user", "content": turn})
                prompt_ids = encode_conversation(model.tokenizer, history[m])
                ids, steps, seconds = runner.generate(prompt_ids, args.max_new_tokens)
                reply = model.tokenizer.decode(ids, skip_special_tokens=True)
                history[m].append({"role": "assistant", "content": reply})
                records[m].append((q.category, ids, steps, seconds))
                bar.update()
    bar.close()

    references = {m: match_reference(m, args.dtype, methods) for m in methods}
    overall, categories = summarize(records, methods, references)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
        "command": "jaxspec-bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": model.cfg.name,
        "questions": args.questions,
        "n_questions": len(questions),
        "n_generations": turns,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "dtype": args.dtype,
        "drafters": {m: str(folder) for m, folder in drafters.items()},
        "methods": overall,
        "categories": categories,
    }
    write_text(out_json, json.dumps(result, indent=2) + "\n")
    write_text(out_md, markdown(result))
    plot(result, out_png)
    print(markdown(result))
    print(f"wrote {out_json}, {out_md}, {out_png}")


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
