"""SDSAT reproduction on the default model (REPRODUCTION.md), one part per run:

    python -m repro.sdsat_study k          # Figs. 3-4: accept rate and tokens/s vs k (greedy)
    python -m repro.sdsat_study sampling   # Figs. 3-4 / Table 4's nucleus rows: k = 5..13
                                           # adaptive tokens, top-10 per position, top_k 10
    python -m repro.sdsat_study quality    # Table 1's question for mode (a): HumanEval pass@1
                                           # and ShareGPT test perplexity, before and after
    python -m repro.sdsat_study trees      # the shipped adapter's top-1..5 accuracy per depth
                                           # on the test split and the trees searched from it

The first two run `jaxspec-bench` on HumanEval prompts (AR and SDSAT at every k side by side,
interleaved prompt by prompt) with the shipped adapter, and writes
repro/results/sdsat/<part>.json and .png. A loop of k adaptive tokens emits
n = (depth-1 token, always the model's own) + (accepted adaptive drafts) + (bonus), so the
paper's accept rate (accepted adaptive drafts / k) is (n - 2) / k in greedy decoding.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench import run_benchmark, write_results
from jaxspec.checkpoint import jaxspec_home
from jaxspec.data.sources import humaneval_problems, sharegpt_split
from jaxspec.errors import JaxspecError
from jaxspec.humaneval import pass_at_1
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import forward
from jaxspec.models import DTYPES, load_model
from jaxspec.sampling import Sampling
from repro.plots import plot_topk, run_part
from train.features import conversation_ids
from train.model_stamp import claimed_folder

OUT = Path(__file__).resolve().parent / "results" / "sdsat"
GREEDY_KS = "1,2,3,4,5,6,8,10,13"
SAMPLING_KS = "5,7,9,11,13"  # the paper's nucleus sampling runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m repro.sdsat_study", description=__doc__)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument(
        "--ks",
        help=f"adaptive tokens per loop (default: k {GREEDY_KS}; sampling, as the paper: "
        f"{SAMPLING_KS})",
    )
    p.add_argument("--limit", type=int, default=12, help="HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--width", type=int, default=10, help="sampling trees: top-W per depth (paper: 10)"
    )
    p.add_argument("--top-k", type=int, default=10, help="sampling: top_k (paper: 10)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights of every row")
    p.add_argument("--full-model", type=Path, help="quality: the mode (a) checkpoint "
                   "(default: $JAXSPEC_HOME/models/<model>-sdsat-full)")  # fmt: skip
    p.add_argument("--problems", type=int, default=164, help="quality: HumanEval problems")
    p.add_argument("--ppl-seqs", type=int, default=40, help="quality: test conversations")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def run_bench(args, methods: list[str], name: str, sampling: Sampling | None = None) -> dict:
    """jaxspec-bench's rows on HumanEval; the record is also written to OUT/bench/NAME.*"""
    out = args.out / "bench" / f"{name}.json"
    result = run_benchmark(
        methods, "humaneval", limit=args.limit, max_new_tokens=args.max_new_tokens,
        sampling=sampling, dtype=args.dtype,
    )  # fmt: skip
    write_results(result, (out, out.with_suffix(".md"), out.with_suffix(".png")))
    return result


def per_k(result: dict, ks: list[int], tree) -> dict:
    rows = {}
    for k in ks:
        s = result["methods"][f"sdsat@{tree(k)}"]
        rows[k] = {
            "tokens_per_s": round(s["tokens_per_s"], 2),
            "speedup": round(s["speedup"], 3),
            "tokens_per_loop": round(s["mean_accepted"], 3),
            "accept_rate": round((s["mean_accepted"] - 2) / k, 3),
            "match_ar": s["match_ar"],
        }
    return {"ar_tokens_per_s": round(result["methods"]["ar"]["tokens_per_s"], 2), "k": rows}


def part_k(args, model) -> dict:
    ks = [int(k) for k in (args.ks or GREEDY_KS).split(",")]
    result = run_bench(args, ["ar"] + [f"sdsat@chain-{k + 1}" for k in ks], "k")
    summary = per_k(result, ks, lambda k: f"chain-{k + 1}")
    plot_k({"greedy": summary}, args.out / "k.png")
    return summary


def part_sampling(args, model) -> dict:
    ks = [int(k) for k in (args.ks or SAMPLING_KS).split(",")]
    methods = ["ar"] + [f"sdsat@comb-{k + 1}-{args.width}" for k in ks]
    summaries = {}
    for temperature in (0.2, 1.0):
        sampling = Sampling(temperature, args.top_k, 0.95)
        result = run_bench(args, methods, f"sampling-t{temperature}", sampling)
        summaries[f"t={temperature}"] = per_k(result, ks, lambda k: f"comb-{k + 1}-{args.width}")
    plot_k(summaries, args.out / "sampling.png")
    return {"width": args.width, "top_p": 0.95, "top_k": args.top_k, **summaries}


def part_trees(args, model) -> dict:
    """Top-1..5 accuracy of the shipped adapter's drafts per depth (40 ShareGPT test
    answers, as its card) and `searched-N` trees from it (the shipped drafter.json's)."""
    from jaxspec.drafters.store import load_drafter
    from jaxspec.methods import make_drafter, shipped_drafter
    from train import sdsat as sdsat_train
    from train.features import self_answers

    settings, dparams, _ = load_drafter(shipped_drafter(model.cfg, "sdsat"), "sdsat", model.cfg)
    drafter = make_drafter("sdsat", model.cfg, settings)
    root = claimed_folder(model)
    test = self_answers(model, root, "test", 40, 128, 192)
    evaluation = sdsat_train.evaluate(drafter, model.params, dparams, test, settings.window)
    trees = sdsat_train.sdsat_trees(evaluation["topk_per_depth"])
    plot_topk({"sdsat": evaluation["topk_per_depth"]}, ["sdsat"], args.out / "trees.png", "depth")
    return {**evaluation, "trees": trees}


def plot_k(summaries: dict, path: Path) -> None:
    """Accept rate (left) and tokens/s with AR's as a dashed line (right) against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for i, (label, summary) in enumerate(summaries.items()):
        ks = sorted(summary["k"], key=int)
        rows = [summary["k"][k] for k in ks]
        ks = [int(k) for k in ks]
        left.plot(ks, [r["accept_rate"] for r in rows], marker="o", label=label)
        right.plot(ks, [r["tokens_per_s"] for r in rows], marker="o", label=f"SDSAT {label}")
        right.axhline(summary["ar_tokens_per_s"], ls="--", color=f"C{i}", label=f"AR {label}")
    left.set(xlabel="adaptive tokens k", ylabel="accept rate")
    right.set(xlabel="adaptive tokens k", ylabel="tokens / s")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def perplexity(model, seqs: list[list[int]]) -> float:
    """exp(mean next-token NLL) of `model` over token sequences (one compiled shape)."""
    width = max(len(s) for s in seqs)
    nll = count = 0.0
    for s in seqs:
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(s)] = s
        logits, _, _ = _logits(model.params, tokens, cfg=model.cfg)
        logp = jax.nn.log_softmax(logits[0, : len(s) - 1])
        nll -= float(jnp.take_along_axis(logp, jnp.asarray(s[1:])[:, None], 1).sum())
        count += len(s) - 1
    return float(np.exp(nll / count))


@partial(jax.jit, static_argnames=("cfg",))
def _logits(params, tokens, *, cfg):
    B, T = tokens.shape
    return forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), None,
                   causal_mask(B, T))  # fmt: skip


def part_quality(args, model) -> dict:
    full_dir = args.full_model or jaxspec_home() / "models" / f"{model.cfg.folder_name}-sdsat-full"
    if not full_dir.is_dir():
        raise JaxspecError(
            f"no mode (a) model at {full_dir}; train one with `jaxspec-train sdsat --mode full`"
        )
    tuned = load_model(full_dir)
    seqs = []
    for conversation in sharegpt_split("test"):
        ids = conversation_ids(model.tokenizer, conversation, 256)
        if ids:
            seqs.append(ids)
        if len(seqs) == args.ppl_seqs:
            break
    problems = humaneval_problems()[: args.problems]
    result = {}
    for name, m in (("original", model), ("sdsat-full", tuned)):
        result[name] = {"sharegpt_test_perplexity": round(perplexity(m, seqs), 3),
                        **pass_at_1(m, problems)}  # fmt: skip
    result["problems"], result["ppl_seqs"] = len(problems), len(seqs)
    return result


PARTS = {"k": part_k, "sampling": part_sampling, "quality": part_quality, "trees": part_trees}


def main(argv=None) -> None:
    run_part(PARTS, parse_args(argv), load_model())


if __name__ == "__main__":
    main()
