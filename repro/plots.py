"""What the reproduction scripts share: running a part, plots."""

from __future__ import annotations

import json

import numpy as np


def run_part(parts: dict, args, model) -> None:
    """Run part `args.part` and write its result to <args.out>/<part>.json (and print it)."""
    args.out.mkdir(parents=True, exist_ok=True)
    result = parts[args.part](args, model)
    (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def plot_topk(result: dict, names: list[str], path, unit: str = "head") -> None:
    """result[name]: top-1..5 accuracy per head/step [K,5] -> one panel per head/step."""
    import matplotlib.pyplot as plt

    K = len(result[names[0]])
    fig, axes = plt.subplots(1, K, figsize=(3.2 * K, 3.2), sharey=True)
    for i, ax in enumerate(np.atleast_1d(axes)):
        for name in names:
            ax.plot(range(1, 6), result[name][i], marker="o", label=name)
        ax.set(title=f"{unit} {i + 1}", xlabel="top-k")
    np.atleast_1d(axes)[0].set_ylabel("agreement with greedy")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
