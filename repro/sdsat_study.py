"""SDSAT reproduction on the default model (REPRODUCTION.md), one part per run:

    python -m repro.sdsat_study k          # Figs. 3-4: accept rate and tokens/s vs k (greedy)
    python -m repro.sdsat_study sampling   # Table 4's nucleus rows: trees of depth k+1, top-W

Each part runs `jaxspec-bench` on HumanEval prompts (AR and SDSAT at every k side by side,
interleaved prompt by prompt) with the shipped adapter, and writes
repro/results/sdsat/<part>.json and .png. A loop of k adaptive tokens emits
n = (depth-1 token, always the model's own) + (accepted adaptive drafts) + (bonus), so the
paper's accept rate (accepted adaptive drafts / k) is (n - 2) / k in greedy decoding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infer import bench
from infer.common import load_model
from repro.plots import run_part

OUT = Path(__file__).resolve().parent / "results" / "sdsat"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m repro.sdsat_study", description=__doc__)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--ks", default="1,2,3,4,5,6,8,10,13", help="adaptive tokens per loop")
    p.add_argument("--limit", type=int, default=12, help="HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--width", type=int, default=3, help="sampling trees: top-W per depth")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def run_bench(args, methods: list[str], name: str, extra: tuple[str, ...] = ()) -> dict:
    out = args.out / "bench" / f"{name}.json"
    bench._main([
        "--methods", ",".join(methods), "--questions", "humaneval", "--limit", str(args.limit),
        "--max-new-tokens", str(args.max_new_tokens), "--out", str(out), *extra,
    ])  # fmt: skip
    return json.loads(out.read_text())


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
    ks = [int(k) for k in args.ks.split(",")]
    result = run_bench(args, ["ar"] + [f"sdsat@chain-{k + 1}" for k in ks], "k")
    summary = per_k(result, ks, lambda k: f"chain-{k + 1}")
    plot_k({"greedy": summary}, args.out / "k.png")
    return summary


def part_sampling(args, model) -> dict:
    ks = [int(k) for k in args.ks.split(",")]
    methods = ["ar"] + [f"sdsat@comb-{k + 1}-{args.width}" for k in ks]
    summaries = {}
    for temperature in (0.2, 1.0):
        extra = ("--temperature", str(temperature), "--top-p", "0.95")
        result = run_bench(args, methods, f"sampling-t{temperature}", extra)
        summaries[f"t={temperature}"] = per_k(result, ks, lambda k: f"comb-{k + 1}-{args.width}")
    plot_k(summaries, args.out / "sampling.png")
    return {"width": args.width, "top_p": 0.95, **summaries}


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


PARTS = {"k": part_k, "sampling": part_sampling}


def main(argv=None) -> None:
    run_part(PARTS, parse_args(argv), load_model())


if __name__ == "__main__":
    main()
