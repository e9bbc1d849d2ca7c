"""Benchmarking every method on the same prompts in one process, AR included.

Methods run interleaved question by question, so slow drifts of the machine hit all of
them alike. Compilation and a warm-up generation per method are excluded from timing.
A row is METHOD[#LABEL][@X][/Y][:DTYPE] (`registry.parse_row`); "hf" is the transformers
peer.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
from tqdm import tqdm

from jaxspec.compile_cache import compiles_are_slow
from jaxspec.data.sources import load_questions, select_questions
from jaxspec.decode import default_products
from jaxspec.divergence import divergences
from jaxspec.drafters.registry import REGISTRY, parse_row, row_source
from jaxspec.errors import JaxspecError
from jaxspec.generate import MIN_PROMPT_BUCKET, bucket
from jaxspec.llama import compute_params
from jaxspec.mesh import make_mesh, parse_mesh
from jaxspec.methods import build_generator, provide_devices, provide_devices_for
from jaxspec.models import DTYPES, load_model
from jaxspec.outputs import atomic_path, write_text
from jaxspec.sampling import Sampling
from jaxspec.text import encode_conversation

PEERS = ("hf",)


def check_rows(rows: list[str]) -> list[str]:
    """The rows to run, "ar" first, each checked (one-line errors for bad names)."""
    if not rows:
        raise JaxspecError("--methods names no rows; give some, e.g. --methods ar,medusa")
    twice = sorted({m for m in rows if rows.count(m) > 1})
    if twice:
        raise JaxspecError(
            f"--methods names {twice[0]} twice; name each row once (another drafter of a "
            "method: a row METHOD#LABEL with --drafter METHOD#LABEL=DIR)"
        )
    for m in rows:
        if m not in PEERS:
            _, _, dtype = parse_row(m)
            if dtype and dtype not in DTYPES:
                raise JaxspecError(f"{m}: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return ["ar"] + [m for m in rows if m != "ar"]


def run_benchmark(
    rows: list[str],
    questions: str,
    *,
    model: Path | None = None,
    limit: int | None = None,
    per_category: int | None = None,
    max_new_tokens: int = 128,
    drafters: dict[str, Path] | None = None,
    single_turn: bool = False,
    sampling: Sampling | None = None,
    seed: int = 0,
    ppd_k: int | None = None,
    dtype: str = "float32",
    products: str | None = None,
    command: str = "",
    mesh: str | None = None,
    one_shape: bool | None = None,
    min_prompt_len: int = 0,
    warm_up_workers: int = 1,
) -> dict:
    """Every row on the questions ('humaneval', 'sharegpt-test' or a Spec-Bench .jsonl) ->
    the result record (per-row and per-category tokens/s, speedup over "ar", mean accepted
    tokens, acceptance by depth, match_ar). drafters: METHOD or METHOD#LABEL (the rows so
    named) -> drafter folder replacing the shipped one; products: how every row's bfloat16
    weights multiply (jaxspec.decode.PRODUCTS; None: the backend's default); mesh:
    "data=D,model=M" to split the model over (jaxspec.mesh; ppd rows: each stage on M);
    one_shape (single_turn only; None: single_turn where compiles are slow, an accelerator):
    every row's programs sized for the longest prompt, so each row compiles once for the
    whole run, not once per prompt bucket, shorter prompts padded; min_prompt_len
    (one_shape): size them for at least this many prompt tokens (runs given the same size
    need the same programs: a later run in the process reuses them, not compiles them
    again); warm_up_workers: rows compiled and
    warmed up at once (threads: XLA compiles outside Python's lock, so a many-core host
    compiles rows side by side)."""
    methods = check_rows(rows)
    shape = parse_mesh(mesh) if mesh else None
    split = shape["model"] if shape else 1
    provide_devices_for([parse_row(m)[0] for m in methods if m not in PEERS], ppd_k, split)
    if shape:
        provide_devices(shape["data"] * shape["model"])
    drafters = drafters or {}
    sampling = sampling or Sampling()
    chosen = select_questions(load_questions(questions), limit, per_category)
    if not chosen:
        raise JaxspecError("no questions selected; check --questions / --limit")
    # float32 rows cast from float32 weights, not from an accelerator's bfloat16 default
    wide = "float32" in {row_dtype(m, dtype) for m in methods}
    stored = load_model(model, dtype="float32" if wide else None, mesh=shape and make_mesh(shape))
    models = {}  # dtype -> the model with its weights cast from the stored ones

    def model_for(name: str):
        row = row_dtype(name, dtype)
        if row not in models:
            models[row] = dataclasses.replace(stored, params=compute_params(stored.params, row))
        return models[row]

    base = model_for("ar")
    if not sampling.greedy and "hf" in methods:
        raise JaxspecError("the hf peer row is greedy only: drop it or set --temperature 0")
    runners = {
        m: Runner(m, model_for(m), sampling, seed, ppd_k, drafters, products) for m in methods
    }
    if one_shape is None:
        one_shape = single_turn and compiles_are_slow()
    if min_prompt_len and not one_shape:
        raise JaxspecError("min_prompt_len sizes the programs of one_shape: set one_shape")
    if one_shape:
        if not single_turn:
            raise JaxspecError("one_shape sizes programs for the first turns: set single_turn")
        longest = max(min_prompt_len, *(len(first_turn_ids(base.tokenizer, q)) for q in chosen))
        for runner in runners.values():
            runner.size_for(longest)
    records, turns = _play(
        runners, base.tokenizer, chosen, max_new_tokens, single_turn, warm_up_workers
    )
    references = {m: match_reference(m, dtype, methods) for m in methods}
    depths = {m: runner.max_depth for m, runner in runners.items()}
    overall, categories = summarize(records, methods, references, depths)
    longest = max(len(r[5]) + len(r[1]) for rows in records.values() for r in rows)
    width = bucket(longest, MIN_PROMPT_BUCKET)  # one width for the run: one compile
    for m in methods if sampling.greedy else ():
        if overall[m]["match_ar"] < 1:  # where its tokens leave AR's, and how near a tie
            generations = [(r[5], r[1]) for r in records[m]]
            reference = [(r[5], r[1]) for r in records[references[m]]]
            overall[m]["divergences"] = divergences(
                generations, reference, model_for(references[m]), width=width
            )
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
        "command": command,
        "model": base.cfg.name,
        "questions": questions,
        "n_questions": len(chosen),
        "n_generations": turns,
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "typical": sampling.typical,
        "dtype": dtype,
        "products": products or default_products(),
        "mesh": mesh,
        "one_shape": one_shape,
        "weight_bytes_per_device": base.bytes_per_device(),
        "drafters": {m: str(folder) for m, folder in drafters.items()},
        "methods": overall,
        "categories": categories,
    }


def first_turn_ids(tokenizer, question) -> list[int]:
    return encode_conversation(tokenizer, [{"role": "user", "content": question.turns[0]}])


def _play(runners: dict, tokenizer, questions, max_new_tokens: int, single_turn: bool,
          warm_up_workers: int = 1):  # fmt: skip
    """Each question's turns as a conversation, row by row -> (records, generations per row)."""
    warm = first_turn_ids(tokenizer, questions[0])
    with ThreadPoolExecutor(max(1, warm_up_workers)) as pool:  # outside the timed region
        list(pool.map(lambda runner: runner.generate(warm, max_new_tokens), runners.values()))
    records = {m: [] for m in runners}
    turns = sum(1 if single_turn else len(q.turns) for q in questions)
    bar = tqdm(total=turns * len(runners), desc="bench", unit="gen", file=sys.stderr)
    for q in questions:
        history = {m: [] for m in runners}
        for turn in q.turns[:1] if single_turn else q.turns:
            for m, runner in runners.items():
                history[m].append({"role": "user", "content": turn})
                prompt_ids = encode_conversation(tokenizer, history[m])
                ids, steps, seconds, accepted = runner.generate(prompt_ids, max_new_tokens)
                reply = tokenizer.decode(ids, skip_special_tokens=True)
                history[m].append({"role": "assistant", "content": reply})
                records[m].append((q.category, ids, steps, seconds, accepted, prompt_ids))
                bar.update()
    bar.close()
    return records, turns


def write_results(result: dict, paths: tuple[Path, Path, Path]) -> None:
    """The record as JSON, its table as markdown and its plot as PNG, each written whole."""
    out_json, out_md, out_png = paths
    write_text(out_json, json.dumps(result, indent=2) + "\n")
    write_text(out_md, markdown(result))
    plot(result, out_png)


class Runner:
    """One row (METHOD[#LABEL][@X][/Y][:DTYPE], `registry.parse_row`, or a peer):
    generate(prompt_ids, n) -> (new ids, steps, seconds excluding compile, drafted tokens
    accepted per verify step); max_depth: its tree's depth (0: one token a step)."""

    def __init__(
        self, name, model, sampling: Sampling | None = None, seed: int = 0, ppd_k=None,
        drafters: dict[str, Path] | None = None, products: str | None = None,
    ):  # fmt: skip
        self.name, self.seed, self.max_depth = name, seed, 0
        if name == "hf":
            from jaxspec.hf_peer import HFPeer

            self.peer = HFPeer(model.cfg, model.params)
        else:
            method, options, _ = parse_row(name)
            if "ppd_k" in REGISTRY[method].options:
                options["ppd_k"] = ppd_k
            drafter_dir = (drafters or {}).get(row_source(name))  # None: the shipped one
            self.generator = build_generator(
                model, method, drafter_dir, sampling=sampling, products=products, **options
            )
            tree = getattr(self.generator, "tree", None)  # PPD has none
            self.max_depth = tree.max_depth if tree is not None else 0

    def size_for(self, prompt_len: int) -> None:
        """Size this row's programs for prompts of at least prompt_len tokens."""
        if self.name != "hf":
            self.generator.min_prompt_len = prompt_len

    def generate(self, prompt_ids, max_new_tokens):
        if self.name == "hf":  # greedy AR: one token a forward pass
            ids, steps, seconds = self.peer.generate(prompt_ids, max_new_tokens)
            return ids, steps, seconds, [0] * max(steps - 1, 0)
        r = self.generator.generate(prompt_ids, max_new_tokens, self.seed)
        return r.token_ids, r.steps, r.prefill_s + r.decode_s, r.accepted


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


def acceptance(accepted: list[int], max_depth: int = 0) -> dict:
    """Drafted tokens accepted per verify step -> "acceptance_by_depth": entry d-1 the
    fraction of steps that accepted >= d drafted tokens (how often depth d was accepted, as
    vLLM's per-position acceptance rate), d = 1 .. max(max_depth, the most accepted);
    "accepted_histogram": entry k the number of steps that accepted exactly k."""
    depth = max([max_depth, *accepted])
    histogram = [0] * (depth + 1)
    for k in accepted:
        histogram[k] += 1
    at_least = [sum(histogram[d:]) for d in range(1, depth + 1)]
    return {
        "acceptance_by_depth": [n / max(len(accepted), 1) for n in at_least],
        "accepted_histogram": histogram,
    }


def summarize(records, methods, references, depths=None):
    """records: method -> list of (category, ids, steps, seconds, accepted per verify step,
    prompt ids); speedups are over "ar", match_ar is against references[method] (the AR
    row of the method's dtype); depths: method -> its tree's depth (acceptance_by_depth's
    length at least; None: as deep as accepted)."""

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
            **acceptance([k for r in rows for k in r[4]], (depths or {}).get(m, 0)),
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
