"""Accepted tokens measured after training (train/acceptance.py): new tokens over all
decoding steps, for the drafter's default and largest trees, written to its card."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import train.acceptance as acceptance
from jaxspec.drafters.settings import DrafterSettings


def test_acceptance_is_new_tokens_per_step_over_all_prompts(tmp_path, monkeypatch):
    built = []

    def build_generator(model, method, drafter_dir, tree):
        built.append(tree)
        per_step = {"mine": 2, "big": 8}[tree]

        def generate(prompt, new_tokens):  # 8 tokens per prompt token, per_step a step
            return SimpleNamespace(new_tokens=8 * len(prompt), steps=8 * len(prompt) // per_step)

        return SimpleNamespace(generate=generate)

    monkeypatch.setattr(acceptance, "build_generator", build_generator)
    settings = DrafterSettings(trees={"small": [[0]], "big": [[0], [1]]}, cpu_tree="mine",
                               gpu_tree="mine")  # fmt: skip
    test = {"tokens": np.arange(24).reshape(3, 8), "lengths": np.full(3, 8),
            "starts": np.array([1, 2, 4])}  # fmt: skip
    (tmp_path / "CARD.md").write_text("# Card\n\n")
    # new tokens 8+16+32 = 56 over 4+8+16 = 28 steps (mine) and 1+2+4 = 7 steps (big)
    assert acceptance.measure_acceptance(None, "m", tmp_path, settings, test) == {
        "mine": 2.0, "big": 8.0
    }  # fmt: skip
    assert built == ["mine", "big"]
    card = (tmp_path / "CARD.md").read_text()
    assert card.startswith("# Card\n\n## Accepted tokens measured by the trainer\n")
    assert "Greedy decoding of 3 held-out" in card
    assert "| `mine` | 2.00 |\n| `big` | 8.00 |\n" in card
