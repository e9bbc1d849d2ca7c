"""The last part of every drafter trainer's evaluation: accepted tokens per step of the
drafter it wrote, measured by greedy speculative decoding of held-out test-split prompts,
and added to the drafter's card."""

from __future__ import annotations

from pathlib import Path

from jaxspec.drafters.settings import DrafterSettings
from jaxspec.methods import build_generator, default_tree
from jaxspec.outputs import write_text

PROMPTS = 10
NEW_TOKENS = 64


def held_out_prompts(test: dict, n: int = PROMPTS) -> list[list[int]]:
    """Prompts from test-split sequences {"tokens" [N,T], "lengths" [N], optional "starts"
    [N]}: each answer's prompt, or without answers the first half of the sequence."""
    ends = test["starts"] if "starts" in test else test["lengths"] // 2
    return [test["tokens"][i, : ends[i]].tolist() for i in range(min(n, len(ends)))]


def trees_to_measure(settings: DrafterSettings) -> list[str]:
    """The drafter's default tree and the largest tree searched for it."""
    own = sorted(settings.trees, key=lambda name: len(settings.trees[name]))
    return list(dict.fromkeys([default_tree(settings), *own[-1:]]))


def measure_acceptance(
    model, method: str, drafter_dir: Path, settings: DrafterSettings, test: dict
):
    """-> {tree: mean accepted tokens per step}, greedy, NEW_TOKENS per prompt; the
    measurement is appended to drafter_dir/CARD.md."""
    prompts = held_out_prompts(test)
    measured = {}
    for tree in trees_to_measure(settings):
        generator = build_generator(model, method, drafter_dir, tree)
        results = [generator.generate(p, NEW_TOKENS) for p in prompts]
        steps = sum(r.steps for r in results)
        measured[tree] = round(sum(r.new_tokens for r in results) / max(steps, 1), 3)
    rows = "".join(f"| `{tree}` | {value:.2f} |\n" for tree, value in measured.items())
    section = f"""
## Accepted tokens measured by the trainer

Greedy decoding of {len(prompts)} held-out test-split prompts, {NEW_TOKENS} new tokens each,
right after training (mean accepted tokens per step, the bonus token included):

| tree | tokens per step |
|---|---|
{rows}"""
    card = Path(drafter_dir) / "CARD.md"
    write_text(card, card.read_text().rstrip("\n") + "\n" + section)
    return measured
