"""python -m repro.chimera_study PART: Chimera's analyses (paper §4.3-4.4) on the default model.

Each part writes `<out>/<part>.json` and `<out>/<part>.png`:
- accuracy (Table 5): per-head top-1..5 agreement with the base model's greedy tokens on
  the test split, the shipped Chimera drafter vs the shipped Medusa drafter.
- ngram (Table 7): the encoder over n-grams, n in --ngrams (default 1 to 5, as the paper),
  and a decoder layer over the embeddings in its place (the model's first layer, frozen
  and fine-tuned).
- residual (Fig. 6): heads on [h ; encoder] (residual) vs on the encoder alone.
- distill: with and without the MSE distillation term (weight --distill-weight).
- timeshare (Table 6): per verify step, the share of time spent verifying vs drafting,
  measured by timing the step with the drafter and with drafting removed.
- cache: the trigram cache's hit rate and its effect on step time (sizes 0, 4096, 65536,
  empty or pre-filled with the most frequent answer trigrams of the training data)
  generating answers to the first question of each Spec-Bench category (--questions).
- bound: tokens per step that the measured head accuracies allow: for Medusa, Chimera
  (the accuracy part's result) and FIRP (its drafter's measured accuracy), the expected
  tokens per step of the searched tree at 2-64 nodes and of the tree holding every top-5
  path (no tree of top-5 guesses does better), under the tree search's independence
  assumption.

Ablations are trained here with `jaxspec-train chimera` at a small budget (--steps,
default 250, vs 1500 for the shipped drafter) on the same data; compare ablations with
each other, not with the shipped drafter.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxspec.checkpoint import jaxspec_home
from jaxspec.drafters.store import load_drafter
from jaxspec.methods import make_drafter, shipped_drafter
from jaxspec.models import load_model
from jaxspec.tree import expected_tokens_per_step, per_rank_accuracy, search_tree
from repro.plots import plot_topk, run_part
from train import chimera as chimera_train
from train import medusa as medusa_train
from train.features import answer_features
from train.model_stamp import claimed_folder

OUT = Path(__file__).resolve().parent / "results" / "chimera"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m repro.chimera_study", description=__doc__)
    p.add_argument("part", choices=tuple(PARTS))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--steps", type=int, default=250, help="updates per ablation run")
    p.add_argument("--train-seqs", type=int, default=800, help="as the shipped drafter")
    p.add_argument("--test-seqs", type=int, default=60)
    p.add_argument("--ngrams", default="1,2,3,4,5", help="n-gram sizes (ngram part)")
    p.add_argument("--distill-weight", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=30, help="timed steps (timeshare)")
    p.add_argument("--questions", help="Spec-Bench .jsonl (cache part)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    return p.parse_args(argv)


def shipped(model, method, for_generation=True):
    """The shipped drafter; for generation as `jaxspec-generate` uses it (with its draft
    vocabulary, if any), else with the weights alone (accuracy over the whole vocabulary)."""
    settings, params, _ = load_drafter(shipped_drafter(model.cfg, method), method, model.cfg)
    drafter = make_drafter(method, model.cfg, settings)
    if for_generation:
        params = drafter.prepare(model.params, params, settings)
    return drafter, params


def test_features(model, args):
    root = claimed_folder(model)
    return answer_features(model, root, "test", args.test_seqs, 128, 192)


def train_variant(args, tag: str, flags: list[str]) -> dict:
    """A small ablation run (cached by tag) -> its report."""
    out = jaxspec_home() / "repro" / "chimera" / tag
    report_file = out / "report.json"
    if report_file.is_file():
        report = json.loads(report_file.read_text())
        if report.get("steps") == args.steps:
            return report
    report = chimera_train.train(
        ["--out", str(out), "--overwrite", "--steps", str(args.steps), "--train-seqs",
         str(args.train_seqs), "--test-seqs", str(args.test_seqs), "--batch", "8", "--rows",
         "32", *flags]
    )  # fmt: skip
    report_file.write_text(json.dumps(report, indent=2))
    return report


def part_accuracy(args, model) -> dict:
    features = test_features(model, args)
    chimera, c_params = shipped(model, "chimera", for_generation=False)
    medusa, m_params = shipped(model, "medusa", for_generation=False)
    result = {
        "chimera": chimera_train.evaluate(chimera, model.params, c_params, features).tolist(),
        "medusa": medusa_train.evaluate(medusa, model.params, m_params, features, "self").tolist(),
    }
    plot_topk(result, ["chimera", "medusa"], args.out / "accuracy.png")
    return result


def part_ngram(args, model) -> dict:
    result = {}
    for n in map(int, args.ngrams.split(",")):
        report = train_variant(args, f"ngram-{n}", ["--ngram", str(n)])
        result[f"{n}-gram"] = report["test_topk_accuracy"]
    for bottom in ("transformer-frozen", "transformer"):
        report = train_variant(args, bottom, ["--bottom", bottom])
        result[bottom] = report["test_topk_accuracy"]
    plot_topk(result, list(result), args.out / "ngram.png")
    return result


def part_residual(args, model) -> dict:
    result = {
        "residual": train_variant(args, "ngram-3", ["--ngram", "3"])["test_topk_accuracy"],
        "no residual": train_variant(args, "no-residual", ["--no-residual"])["test_topk_accuracy"],
    }
    plot_topk(result, list(result), args.out / "residual.png")
    return result


def part_distill(args, model) -> dict:
    w = str(args.distill_weight)
    result = {
        "without": train_variant(args, "ngram-3", ["--ngram", "3"])["test_topk_accuracy"],
        f"MSE weight {w}": train_variant(args, f"distill-{w}", ["--distill", w])[
            "test_topk_accuracy"
        ],
    }
    plot_topk(result, list(result), args.out / "distill.png")
    return result


def part_timeshare(args, model) -> dict:
    """Time one verify step with Chimera drafting and with drafting removed (NoDrafter on
    the same tree): the difference is the drafting time."""
    from jaxspec.decode import NoDrafter, SpeculativeGenerator
    from jaxspec.text import encode_prompt
    from jaxspec.tree import TreeSpec

    chimera, params = shipped(model, "chimera")
    settings = load_drafter(shipped_drafter(model.cfg, "chimera"), "chimera", model.cfg)[0]
    prompt = encode_prompt(model.tokenizer, "Explain how a bicycle gear works.")
    ar = SpeculativeGenerator(model.cfg, model.params)
    ar.generate(prompt, 8)
    runs = [ar.generate(prompt, args.repeats) for _ in range(3)]
    result = {"ar_ms_per_step": round(min(r.decode_s / (r.steps - 1) for r in runs) * 1e3, 2)}
    for tree_name in ("chain-1", "searched-8", "searched-16"):
        paths = settings.trees.get(tree_name, [[0]])
        tree = TreeSpec(paths)
        times = {}
        for label, drafter, dparams in (("step", chimera, params), ("verify", NoDrafter(), None)):
            gen = SpeculativeGenerator(model.cfg, model.params, drafter, dparams, tree)
            gen.generate(prompt, 8)  # compile and warm up
            runs = [gen.generate(prompt, args.repeats) for _ in range(3)]
            times[label] = min(r.decode_s / (r.steps - 1) for r in runs)  # prefill excluded
        share = 1 - times["verify"] / times["step"]
        result[tree_name] = {
            "ms_per_step": round(times["step"] * 1e3, 2),
            "ms_verify_only": round(times["verify"] * 1e3, 2),
            "draft_share": round(share, 3),
        }
        print(tree_name, result[tree_name], flush=True)
    result["device"] = jax.devices()[0].device_kind
    result["measured"] = time.strftime("%Y-%m-%d")
    return result


def part_cache(args, model) -> dict:
    import dataclasses

    from jaxspec.data.sources import load_questions, select_questions
    from jaxspec.decode import SpeculativeGenerator
    from jaxspec.text import encode_prompt
    from jaxspec.tree import tree_preset

    if not args.questions:
        raise SystemExit("the cache part needs --questions PATH.jsonl (Spec-Bench)")
    prompts = [
        encode_prompt(model.tokenizer, q.turns[0])
        for q in select_questions(load_questions(args.questions), None, 1)
    ]
    settings, raw, data = load_drafter(shipped_drafter(model.cfg, "chimera"), "chimera", model.cfg)
    chimera = make_drafter("chimera", model.cfg, settings)
    train_f = answer_features(model, claimed_folder(model), "train",
                              args.train_seqs, 128, 192)  # fmt: skip
    frequent = chimera_train.frequent_ngrams(train_f, chimera.ngram, 65536)
    result = {}
    for size, prefill in ((0, 0), (4096, 0), (65536, 0), (4096, 4096), (65536, 65536)):
        drafter = dataclasses.replace(chimera, cache_size=size)
        params = drafter.prepare(
            model.params, raw, {**data, "cache_prefill": np.asarray(frequent[:prefill])}
        )
        gen = SpeculativeGenerator(model.cfg, model.params, drafter, params, tree_preset("chain-1"))
        gen.generate(prompts[0], 8)  # compile and warm up
        seconds = steps = hits = lookups = 0
        for prompt in prompts:
            run = gen.generate(prompt, args.max_new_tokens)
            seconds, steps = seconds + run.decode_s, steps + run.steps - 1
            if size:
                h, n = (int(x) for x in gen.drafter_state.lookups)
                hits, lookups = hits + h, lookups + n
        name = f"{size} pre-filled with {prefill}" if prefill else str(size)
        result[name] = {
            "ms_per_step": round(1e3 * seconds / steps, 2),
            "hit_rate": round(hits / lookups, 3) if size else None,
        }
        print(name, result[name], flush=True)
    return result


def part_bound(args, model) -> dict:
    path = args.out / "accuracy.json"
    if not path.is_file():
        raise SystemExit(f"the bound part reads {path}: run the accuracy part first")
    accuracy = json.loads(path.read_text())
    firp = load_drafter(shipped_drafter(model.cfg, "firp"), "firp", model.cfg)
    accuracy["firp"] = firp.data["test_topk_accuracy"].tolist()
    result = {}
    for name, topk in accuracy.items():
        depth, k = np.shape(topk)
        every_path = sum(k**d for d in range(depth + 1))  # nodes of the full top-k tree
        per_rank = per_rank_accuracy(topk)
        result[name] = {
            str(n): round(expected_tokens_per_step(search_tree(per_rank, n), topk), 3)
            for n in (2, 8, 16, 32, 64, every_path)
        }
    plot_bound(result, args.out / "bound.png")
    return result


def plot_bound(result: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, by_nodes in result.items():
        ax.plot([int(n) for n in by_nodes], list(by_nodes.values()), marker="o", label=name)
    ax.set(xscale="log", xlabel="tree nodes", ylabel="expected tokens per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PARTS = {
    "accuracy": part_accuracy,
    "ngram": part_ngram,
    "residual": part_residual,
    "distill": part_distill,
    "timeshare": part_timeshare,
    "cache": part_cache,
    "bound": part_bound,
}


def main(argv=None) -> None:
    run_part(PARTS, parse_args(argv), load_model())


if __name__ == "__main__":
    main()
