"""PPD reproduction on the default model (REPRODUCTION.md), one part per run:

    python -m repro.ppd_study match      # Table 2 + Tables 6-8: p_correct by layer, k, head,
                                         # category and token position (greedy answers)
    python -m repro.ppd_study decoding   # Table 5: greedy vs top-k vs top-p answers
    python -m repro.ppd_study tradeoff   # Figs. 3-4 from the measured match rates
    python -m repro.ppd_study latency    # measured vs predicted vs simulated per-token latency
    python -m repro.ppd_study templates  # Table 2 again, prompts in the paper's Table 1 formats
    python -m repro.ppd_study templates-chat  # the same formats as the chat template's user turn

p_correct: the token the model produced next is among the top-k early predictions at
layer d̄ (1/3, 1/2, 2/3, 5/6 and 0.93 of the 30 layers), untrained (final norm + lm_head)
and with the shipped heads. Prompts: the first --per-category Spec-Bench questions of
summarization, qa and translation (--questions, the Spec-Bench file).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.store import load_drafter
from jaxspec.methods import build_generator, provide_devices, shipped_drafter
from jaxspec.models import load_model
from jaxspec.ppd import head_name
from jaxspec.ppd_theory import (
    compute_per_time_unit,
    compute_per_token,
    expected_latency,
    trace_cost,
)
from jaxspec.sampling import Sampling
from jaxspec.text import encode_prompt
from repro.plots import run_part
from train.ppd import KS, layer_states, match_hits

OUT = Path(__file__).resolve().parent / "results" / "ppd"
CATEGORIES = ("summarization", "qa", "translation")
POSITION_BINS = ((0, 16), (16, 32), (32, 64), (64, 128))
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m repro.ppd_study", description=__doc__)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--questions", type=Path, default=SPEC_BENCH)
    p.add_argument("--per-category", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--layers", default="10,15,20,25,28")
    p.add_argument("--k", type=int, default=3, help="latency: sub-processes")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def prompts_by_category(args, model) -> dict[str, list[list[int]]]:
    from jaxspec.data.sources import load_questions

    questions = load_questions(str(args.questions))
    return {
        cat: [encode_prompt(model.tokenizer, q.turns[0]) for q in questions
              if q.category == cat][: args.per_category]
        for cat in CATEGORIES
    }  # fmt: skip


# The paper's Table 1 prompt formats (raw text, no chat template) and answer lengths, each
# filled from the Spec-Bench category standing in for its dataset: rag (a passage, then the
# question on the last line) for SQuAD, summarization ("Summarize: " + article) for CNN/DM,
# translation (German -> English) for WMT EN-FR, whose two examples are turned around.
SQUAD = (
    "We have provided context information below.\n"
    "———————\n{context}\n———————\n"
    "### Given this information, please answer the question: {question}\n### Assistant:"
)
WMT = (
    "### Instruction: Translate German sentence into English.\n"
    "German: Das klingt für mich nach einem typischen Rugbyclub.\n"
    "English: Sounds like a typical rugby club to me. #\n"
    "German: An einer englischen Universität vielleicht…\n"
    "English: At an English university, perhaps… #\n"
    "German: {source}\nEnglish:"
)
CNN_DM = "# Article\n{context}\n# Summarize the article\n### Assistant:"


def paper_prompt(category: str, question: str) -> str:
    """A Spec-Bench question of `category` in the paper's format for the task it stands in for."""
    if category == "rag":
        context, _, asked = question.rpartition("\n")
        return SQUAD.format(context=context, question=asked)
    if category == "summarization":
        return CNN_DM.format(context=question.removeprefix("Summarize: "))
    return WMT.format(source=question.removeprefix("Translate German to English: "))


PAPER_TASKS = {"rag": ("SQuAD", 16), "summarization": ("CNN/DM", 128),
               "translation": ("WMT", 128)}  # fmt: skip


def shipped_heads(model) -> dict:
    folder = shipped_drafter(model.cfg, "ppd")
    return load_drafter(folder, "ppd", model.cfg)[1]["heads"] if folder.is_dir() else {}


def match_rates(model, heads, prompts, outputs, layers) -> dict:
    """-> per layer, head (untrained/trained), k: p_correct overall and per position bin."""
    hits = {layer: [] for layer in layers}  # per sequence [2, R, len(KS)]
    positions = []
    for prompt, out in zip(prompts, outputs, strict=True):
        seq = np.asarray(prompt + out, np.int32)[None]
        rows = np.arange(len(prompt) - 1, len(seq[0]) - 1, dtype=np.int32)[None]
        states, _ = layer_states(model.params, seq, rows, cfg=model.cfg, layers=layers)
        got = match_hits(model.params, {head_name(la): heads.get(head_name(la)) for la in layers},
                         states, jnp.asarray(seq[:, 1:][:, rows[0]]), cfg=model.cfg)  # fmt: skip
        for layer in layers:
            hits[layer].append(np.asarray(got[layer])[:, 0])
        positions.append(np.arange(rows.shape[1]))
    pos = np.concatenate(positions)
    result = {}
    for layer in layers:
        h = np.concatenate(hits[layer], axis=1)  # [2, N, len(KS)]
        result[str(layer)] = {
            name: {
                f"k={k}": {
                    "all": round(float(h[i, :, j].mean()), 4),
                    **{f"tokens {lo}-{hi - 1}": round(float(h[i, (pos >= lo) & (pos < hi), j]
                                                            .mean()), 4)
                       for lo, hi in POSITION_BINS if ((pos >= lo) & (pos < hi)).any()},
                }
                for j, k in enumerate(KS)
            }
            for i, name in enumerate(("untrained", "trained"))
            if i == 0 or heads
        }  # fmt: skip
    return result


def answers(model, prompts, max_new, sampling=None) -> list[list[int]]:
    gen = SpeculativeGenerator(model.cfg, model.params, sampling=sampling)
    return [r.token_ids for r in gen.generate_batch(prompts, max_new)]


def part_match(args, model) -> dict:
    layers = tuple(int(x) for x in args.layers.split(","))
    heads = shipped_heads(model)
    result = {"layers": list(layers), "n_layers": model.cfg.n_layers, "categories": {}}
    for cat, prompts in prompts_by_category(args, model).items():
        outputs = answers(model, prompts, args.max_new_tokens)
        result["categories"][cat] = match_rates(model, heads, prompts, outputs, layers)
    return result


def part_templates(args, model, chat: bool = False) -> dict:
    """part_match with the paper's prompt formats and answer lengths (PAPER_TASKS): the raw
    text, as the paper prompts its model, or (`chat`) as the user turn of the chat template
    (the instruction-tuned model often ends a raw-text answer at once)."""
    from jaxspec.data.sources import load_questions

    layers = tuple(int(x) for x in args.layers.split(","))
    heads = shipped_heads(model)
    questions = load_questions(str(args.questions))
    result = {"layers": list(layers), "n_layers": model.cfg.n_layers, "categories": {}}
    for cat, (task, new_tokens) in PAPER_TASKS.items():
        texts = [paper_prompt(cat, q.turns[0]) for q in questions if q.category == cat]
        texts = texts[: args.per_category]
        prompts = [encode_prompt(model.tokenizer, t, chat=chat) for t in texts]
        outputs = answers(model, prompts, new_tokens)
        result["categories"][cat] = {
            "stands_in_for": task, "new_tokens": new_tokens, "example_prompt": texts[0],
            "answer_tokens": sum(map(len, outputs)),
            **match_rates(model, heads, prompts, outputs, layers),
        }  # fmt: skip
    return result


def part_decoding(args, model) -> dict:
    layers = (15, 20)
    heads = shipped_heads(model)
    settings = {"greedy": Sampling(), "top-k 10": Sampling(1.0, top_k=10),
                "top-p 0.9": Sampling(1.0, top_p=0.9)}  # fmt: skip
    prompts = [p for ps in prompts_by_category(args, model).values() for p in ps]
    return {
        name: match_rates(model, heads, prompts,
                          answers(model, prompts, args.max_new_tokens, s), layers)
        for name, s in settings.items()
    }  # fmt: skip


def part_tradeoff(args, model) -> dict:
    """Fig. 3 (normalised latency vs compute per time unit) and Fig. 4 (vs compute per
    token) at d̄ = d/2 from match.json's measured rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    match = json.loads((args.out / "match.json").read_text())
    d = match["n_layers"]
    layer = str(d // 2)
    curves = {}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for cat, per_layer in match["categories"].items():
        for head, per_k in per_layer[layer].items():
            ks = [int(k[2:]) for k in per_k]
            ps = [per_k[f"k={k}"]["all"] for k in ks]
            latency = [expected_latency(d, d / 2, 10**6, p) / (d * 10**6) for p in ps]
            curve = {"k": ks, "p_correct": ps, "normalised_latency": latency,
                     "compute_per_time_unit": [compute_per_time_unit(k, p)
                                               for k, p in zip(ks, ps, strict=True)],
                     "compute_per_token": [compute_per_token(k, p)
                                           for k, p in zip(ks, ps, strict=True)]}  # fmt: skip
            curves[f"{cat} {head}"] = curve
            for ax, x in zip(axes, ("compute_per_time_unit", "compute_per_token"), strict=True):
                ax.plot(curve[x], latency, marker="o", label=f"{cat} ({head})")
    axes[0].set(xlabel="compute resources per time unit", ylabel="latency per token / AR")
    axes[1].set(xlabel="compute per token / AR", ylabel="latency per token / AR")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"PPD trade-off at layer {layer} of {d}, measured p_correct", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "tradeoff.png", dpi=120)
    plt.close(fig)
    return {"layer": int(layer), "curves": curves}


def part_latency(args, model) -> dict:
    """PPD (k sub-processes on virtual CPU devices) vs AR on the same prompts: measured
    seconds per token next to Theorem 4.1 with the match study's p_correct (match.json,
    the mean over its categories) and the time-unit simulation of this run's own match
    trace, both turned into seconds with AR's measured seconds per layer."""
    prompts = [p for ps in prompts_by_category(args, model).values() for p in ps]
    d = model.cfg.n_layers
    ar = build_generator(model, "ar")
    ppd = build_generator(model, "ppd", ppd_k=args.k)
    match = json.loads((args.out / "match.json").read_text())["categories"]
    head = "trained" if ppd.head is not None else "untrained"
    p_study = float(np.mean([m[str(ppd.layer)][head][f"k={args.k}"]["all"]
                             for m in match.values()]))  # fmt: skip
    ar.generate(prompts[0], 8)
    ppd.generate(prompts[0], 8)  # compile both outside the timing
    rows = []
    for prompt in prompts:
        a = ar.generate(prompt, args.max_new_tokens)
        ppd.generate(prompt, args.max_new_tokens)  # compiles for this cache length
        p = ppd.generate(prompt, args.max_new_tokens)
        assert p.token_ids == a.token_ids, "PPD output differs from greedy"
        matches = ppd.last_stats.matches
        ell = len(p.token_ids)
        layer_s = a.decode_s / max(len(a.token_ids) - 1, 1) / d  # AR's seconds per layer
        sim, _ = trace_cost(d, ppd.layer, matches, args.k)
        rows.append({
            "tokens": ell,
            "match_rate": round(float(np.mean(matches)) if matches else 0.0, 4),
            "ar_s_per_token": a.decode_s / max(ell - 1, 1),
            "ppd_measured_s_per_token": p.decode_s / max(ell - 1, 1),
            "predicted_s_per_token": expected_latency(d, ppd.layer, ell, p_study) * layer_s / ell,
            "simulated_s_per_token": sim * layer_s / ell,
        })  # fmt: skip
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    return {"k": args.k, "layer": ppd.layer, "head": head, "p_correct_study": p_study,
            "n_layers": d, "mean": mean, "prompts": rows}  # fmt: skip


PARTS = {"match": part_match, "decoding": part_decoding, "tradeoff": part_tradeoff,
         "latency": part_latency, "templates": part_templates,
         "templates-chat": partial(part_templates, chat=True)}  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    provide_devices(args.k + 1)
    run_part(PARTS, args, load_model())


if __name__ == "__main__":
    main()
