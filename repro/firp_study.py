"""python -m repro.firp_study PART: FIRP's analyses (paper §4.2) on the default model.

Each part writes `<out>/<part>.json` and `<out>/<part>.png`:
- accuracy (Fig. 3): per-step top-1..5 agreement with the base model's greedy tokens on
  the test split: the FIRP drafter, the Medusa drafter, and early-exit maps (the same
  linear maps decoded straight by the lm_head, skipping the remaining layers).
- cosine (Fig. 4): cosine similarity between pseudo states and the real states they
  stand for, after every layer from the map's layer to the last.
- layers (Figs. 5-6): step-1 accuracy with the map at each sweep layer; then step-2
  accuracy at each layer above a fixed step 1.
- masked (Fig. 7): step-2 accuracy when the second pseudo state sees the first (chained,
  FIRP) or not (masked).
- trees (Table 3): mean accepted tokens per step at 16/32/64-node trees searched from each
  drafter's accuracy, FIRP vs Medusa, generating greedily on Spec-Bench questions.
- sizes (Fig. 1a, draft size): parameters and float32 drafter-file bytes of FIRP and of
  Medusa in the paper's form (every head its own vocabulary projection) and in ours (heads
  share the frozen lm_head), each saved with the same code the trainers use; plus the
  shipped files' sizes.

Ablation maps are trained here with `jaxspec-train firp` at a small budget (--steps per
map, default 150, vs 300 for the shipped drafter) on the same data, all sharing one cached
real pass over the --sweep layers; compare ablations with each other, not with the shipped
drafter.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoint import jaxspec_home
from jaxspec.drafters.firp import pseudo_forward
from jaxspec.drafters.store import load_drafter
from jaxspec.methods import make_drafter, shipped_drafter
from jaxspec.models import load_model
from repro.plots import plot_topk, run_part
from train import firp as firp_train
from train.model_stamp import claimed_folder

OUT = Path(__file__).resolve().parent / "results" / "firp"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m repro.firp_study", description=__doc__)
    p.add_argument("part", choices=("accuracy", "cosine", "layers", "masked", "trees", "sizes"))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--steps", type=int, default=150, help="updates per map for ablations")
    p.add_argument("--train-seqs", type=int, default=800, help="as the shipped drafter")
    p.add_argument("--test-seqs", type=int, default=40)
    p.add_argument("--sweep", default="5,10,15,20,25", help="step-1 layers (layers part)")
    p.add_argument("--questions", help="Spec-Bench .jsonl (trees part)")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    return p.parse_args(argv)


def work_dir(model) -> Path:
    return claimed_folder(model) / "firp"


def train_variant(args, layers, variant, tag, steps=None, pass_layers=None) -> dict:
    """Trains maps at `layers` (a small ablation run) -> its report."""
    steps = steps or args.steps
    pass_layers = pass_layers or args.sweep
    out = work_dir_for_ablation(tag)
    flags = ["--layers", ",".join(map(str, layers)), "--variant", variant, "--out", str(out),
             "--overwrite", "--steps", str(steps), "--train-seqs", str(args.train_seqs),
             "--test-seqs", str(args.test_seqs), "--pass-layers", pass_layers]  # fmt: skip
    if (out / "report.json").is_file():
        report = json.loads((out / "report.json").read_text())
        if report.get("steps_per_firp_step") == steps:
            return report
    firp_train.train(flags)
    return json.loads((out / "report.json").read_text())


def work_dir_for_ablation(tag: str) -> Path:
    return jaxspec_home() / "repro" / "firp" / tag


def test_pass(model, args, layers):
    work = work_dir(model)
    return firp_train.real_pass(model, work.parent, work, "test", args.test_seqs, 128, 192, layers)


def shipped(model, method):
    settings, params, _ = load_drafter(shipped_drafter(model.cfg, method), method, model.cfg)
    return make_drafter(method, model.cfg, settings), params


@partial(jax.jit, static_argnames=("drafter",))
def medusa_hits(base, params, last, anchors, *, drafter):
    h = jnp.take_along_axis(last, anchors[:, :, None], axis=1)
    ranks = jax.lax.top_k(drafter.head_logits(base, params, h), 5)[1]  # [B,A,K,5]
    hits = []
    for k in range(drafter.n_heads):
        target = jnp.argmax(firp_train.teacher_logits(base, drafter.cfg, last, anchors, k + 1), -1)
        hits.append((jnp.cumsum(ranks[:, :, k] == target[..., None], -1) > 0).sum((0, 1)))
    return jnp.stack(hits)


def medusa_accuracy(model, cache, n_steps) -> np.ndarray:
    """Medusa heads on the same test anchors as FIRP's evaluation."""
    drafter, params = shipped(model, "medusa")
    hits, count = 0.0, 0
    for rows, anchors in firp_train.eval_anchors(cache, n_steps):
        last = jnp.asarray(cache.arrays["last"][rows], jnp.float32)
        hits = hits + np.asarray(
            medusa_hits(model.params, params, last, jnp.asarray(anchors), drafter=drafter)
        )
        count += anchors.size
    return (hits / count)[:n_steps]


def part_accuracy(args, model) -> dict:
    firp, params = shipped(model, "firp")
    cache = test_pass(model, args, firp.layers)
    result = {
        "firp": firp_train.evaluate(model, params["maps"], firp.layers, cache).tolist(),
        "medusa": medusa_accuracy(model, cache, firp.n_steps).tolist(),
        # The shipped drafter's budget (300 updates per map) and cached pass.
        "early-exit": train_variant(
            args, firp.layers, "early-exit", "early-exit", 300, ",".join(map(str, firp.layers))
        )["test_topk_accuracy"],
        "layers": list(firp.layers),
    }
    plot_topk(result, ["firp", "medusa", "early-exit"], args.out / "accuracy.png", "step")
    return result


@partial(jax.jit, static_argnames=("cfg", "layers"))
def pseudo_by_layer(base, maps, batch, anchors, *, cfg, layers):
    """-> {layer count: [B,m,D] pseudo states (the m joined by then, step-major)} from
    the first map's layer to the last layer."""
    counts = tuple(range(layers[0], cfg.n_layers + 1))
    _, collected = pseudo_forward(
        base, cfg, maps, layers, batch["keys"], batch["values"], batch["states"], anchors,
        collect=counts,
    )  # fmt: skip
    return collected


def part_cosine(args, model) -> dict:
    """Real states per layer come from one full pass over a few test answers."""
    from jaxspec.drafters.firp import real_context

    firp, params = shipped(model, "firp")
    cache = test_pass(model, args, firp.layers)
    L, K, A = model.cfg.n_layers, firp.n_steps, 32
    rng = np.random.default_rng(0)
    low, high = firp_train.valid_anchor_range(cache.data, K)
    sums, counts = np.zeros((K, L + 1)), np.zeros((K, L + 1))
    layer_counts = tuple(range(firp.layers[0], L + 1))
    real_pass = jax.jit(partial(real_context, cfg=model.cfg, layers=layer_counts))
    for row in np.flatnonzero(high >= low)[:16]:
        rows = np.array([row])
        anchors = jnp.asarray(firp_train.sample_anchors(rng, low[rows], high[rows], A))
        tokens = jnp.asarray(cache.data["tokens"][rows])
        _, _, real = real_pass(model.params, tokens=tokens)
        batch = cache.batch(rows, firp.layers)
        pseudo = pseudo_by_layer(
            model.params, params["maps"], batch, anchors, cfg=model.cfg, layers=firp.layers
        )
        for count, h in pseudo.items():
            for i in range(K):
                if (i + 1) * A > h.shape[1] or count < firp.layers[i]:
                    continue
                p = h[0, i * A : (i + 1) * A]  # [A,D] step i+1
                r = real[count][0, np.asarray(anchors[0]) + i + 1]  # [A,D]
                cos = (p * r).sum(-1) / (jnp.linalg.norm(p, axis=-1) * jnp.linalg.norm(r, axis=-1))
                sums[i, count] += float(cos.sum())
                counts[i, count] += A
    cosine = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    result = {
        "layers": list(firp.layers),
        "cosine": [[None if np.isnan(x) else round(float(x), 4) for x in row] for row in cosine],
    }
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i in range(K):
        ax.plot(
            range(L + 1), cosine[i], marker=".", label=f"step {i + 1} (map at {firp.layers[i]})"
        )
    ax.set(xlabel="layer", ylabel="cosine(pseudo, real)", title="FIRP pseudo states refine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "cosine.png", dpi=120)
    return result


def part_layers(args, model) -> dict:
    sweep = [int(x) for x in args.sweep.split(",")]
    step1 = {t: train_variant(args, (t,), "firp", f"step1-{t}")["test_topk_accuracy"][0]
             for t in sweep}  # fmt: skip
    first = 15 if 15 in sweep else sweep[len(sweep) // 2]
    above = [t for t in sweep if t > first]  # the cached pass holds the sweep layers
    step2 = {t: train_variant(args, (first, t), "firp", f"step2-{first}-{t}")[
        "test_topk_accuracy"][1] for t in above}  # fmt: skip
    result = {"step1": step1, "step2_first_layer": first, "step2": step2}
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, data, title in (
        (axes[0], step1, "step 1"),
        (axes[1], step2, f"step 2 (step 1 at {first})"),
    ):
        xs = sorted(data)
        for k in (0, 2, 4):
            ax.plot(xs, [data[x][k] for x in xs], marker="o", label=f"top-{k + 1}")
        ax.set(xlabel="prediction layer", ylabel="accuracy", title=title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "layers.png", dpi=120)
    return result


def part_masked(args, model) -> dict:
    firp, _ = shipped(model, "firp")
    layers = firp.layers[:2]
    result = {
        "layers": list(layers),
        "chained": train_variant(args, layers, "firp", "chained")["test_topk_accuracy"][1],
        "masked": train_variant(args, layers, "unchained", "masked")["test_topk_accuracy"][1],
    }
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name in ("chained", "masked"):
        ax.plot(range(1, 6), result[name], marker="o", label=name)
    ax.set(xlabel="top-k", ylabel="step-2 accuracy", title="second step: sees step 1 or not")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "masked.png", dpi=120)
    return result


def part_trees(args, model) -> dict:
    from jaxspec.data.sources import load_questions, select_questions
    from jaxspec.methods import build_generator
    from jaxspec.text import encode_prompt

    if not args.questions:
        raise SystemExit("the trees part needs --questions PATH.jsonl (Spec-Bench)")
    questions = select_questions(load_questions(args.questions), None, args.per_category)
    prompts = [encode_prompt(model.tokenizer, q.turns[0]) for q in questions]
    result = {}
    for method in ("medusa", "firp"):
        for tree in ("searched-16", "searched-32", "searched-64"):
            gen = build_generator(model, method, tree=tree)
            runs = [gen.generate(p, args.max_new_tokens) for p in prompts]
            tokens, steps = sum(r.new_tokens for r in runs), sum(r.steps for r in runs)
            result.setdefault(method, {})[tree] = round(tokens / steps, 3)
            print(method, tree, result[method][tree], flush=True)
    plot_trees(result, args.out / "trees.png")
    return result


def plot_trees(result: dict, path) -> None:
    """result[method]["searched-N"]: tokens per step -> tokens per step vs N, per method."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, by_tree in result.items():
        nodes = [int(name.split("-")[1]) for name in by_tree]
        ax.plot(nodes, list(by_tree.values()), marker="o", label=method)
    ax.set(xlabel="tree nodes", ylabel="tokens per step", title="Table 3", xticks=[16, 32, 64])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def part_sizes(args, model) -> dict:
    """Parameters and file bytes (float32, drafter.safetensors) of each drafter kind, with
    as many heads/steps as the shipped drafters, saved to a scratch folder and measured."""
    import tempfile

    from jaxspec.drafters.firp import FirpDrafter
    from jaxspec.drafters.medusa import MedusaDrafter
    from jaxspec.drafters.settings import DrafterSettings
    from jaxspec.drafters.store import WEIGHTS, save_drafter

    firp_settings = load_drafter(shipped_drafter(model.cfg, "firp"), "firp", model.cfg)[0]
    medusa_settings = load_drafter(shipped_drafter(model.cfg, "medusa"), "medusa", model.cfg)[0]
    heads = medusa_settings.n_heads
    kinds = {
        f"firp ({len(firp_settings.layers)} maps)": FirpDrafter(
            model.cfg, firp_settings.layers
        ).init(),
        f"medusa, paper ({heads} heads, own vocabulary projections)": MedusaDrafter(
            model.cfg, heads, own_lm_head=True
        ).init(model.params),
        f"medusa, ours ({heads} heads sharing the lm_head)": MedusaDrafter(model.cfg, heads).init(
            model.params
        ),
    }
    result = {"built": {}, "shipped_bytes": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name, params in kinds.items():
            folder = Path(scratch) / str(len(result["built"]))
            save_drafter(folder, "size", DrafterSettings(), params, model.cfg, "")
            result["built"][name] = {
                "parameters": sum(int(np.size(x)) for x in jax.tree.leaves(params)),
                "file_bytes": (folder / WEIGHTS).stat().st_size,
            }
    for method in ("firp", "medusa", "chimera", "sdsat"):
        path = shipped_drafter(model.cfg, method) / WEIGHTS
        if path.is_file():
            result["shipped_bytes"][method] = path.stat().st_size
    plot_sizes(result["built"], args.out / "sizes.png")
    return result


def plot_sizes(built: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.6))
    names = list(built)
    mib = [built[n]["file_bytes"] / 2**20 for n in names]
    ax.barh(names, mib)
    for y, x in enumerate(mib):
        ax.text(x, y, f" {x:.1f}", va="center")
    ax.set(xscale="log", xlim=(1, 4000), xlabel="drafter file, MiB (float32)", title="Fig. 1a")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PARTS = {
    "accuracy": part_accuracy,
    "cosine": part_cosine,
    "layers": part_layers,
    "masked": part_masked,
    "trees": part_trees,
    "sizes": part_sizes,
}


def main(argv=None) -> None:
    run_part(PARTS, parse_args(argv), load_model())


if __name__ == "__main__":
    main()
