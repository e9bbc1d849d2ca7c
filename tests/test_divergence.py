"""Where a row's tokens leave AR's: the first difference, and AR's top-2 margin there."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jaxspec import bench
from jaxspec.bench import run_benchmark
from jaxspec.divergence import divergences, first_difference, top2_margin
from jaxspec.models import load_model


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one ended first
    assert first_difference([], [4]) == 0


@pytest.mark.parametrize("n", [3, 16, 21])
def test_top2_margin_is_hf_logits_top_two_gap(tiny_ckpt, n):
    ckpt, hf = tiny_ckpt
    model = load_model(ckpt)
    ids = [int(t) for t in np.random.default_rng(n).integers(3, 101, n)]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert top2_margin(model, ids) == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert top2_margin(model, ids, width=64) == pytest.approx(top2_margin(model, ids), abs=1e-5)


def test_divergences_name_the_first_differing_generations(tiny_ckpt):
    model = load_model(tiny_ckpt[0])
    reference = [([5, 6], [7, 8, 9]), ([5], [10, 11]), ([6], [12, 13]), ([7], [1, 2])]
    rows = [([5, 6], [7, 8, 9]), ([5], [10, 4]), ([6], [12]), ([7], [3, 2])]
    found = divergences(rows, reference, model, limit=2)
    assert [(d["generation"], d["position"]) for d in found] == [(1, 1), (2, 1)]
    assert (found[0]["ar_token"], found[0]["row_token"]) == (11, 4)
    assert (found[1]["ar_token"], found[1]["row_token"]) == (13, None)
    assert found[0]["ar_margin"] == top2_margin(model, [5, 10])


def test_bench_reports_where_a_greedy_row_leaves_ar(tiny_ckpt, tmp_path, monkeypatch):
    questions = tmp_path / "q.jsonl"
    lines = [{"question_id": i, "category": "a", "turns": [f"w{5 + i} w9"]} for i in range(2)]
    questions.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    generate, calls = bench.Runner.generate, []

    def second_question_changes_token_3(self, prompt_ids, max_new_tokens):
        ids, *rest = generate(self, prompt_ids, max_new_tokens)
        calls.append(self.name)
        if self.name == "ar#changed" and calls.count(self.name) == 3:  # warm-up, q0, q1
            ids = ids[:3] + [ids[3] + 1] + ids[4:]
        return ids, *rest

    monkeypatch.setattr(bench.Runner, "generate", second_question_changes_token_3)
    result = run_benchmark(
        ["ar", "ar#changed"], str(questions), model=tiny_ckpt[0], max_new_tokens=8,
        single_turn=True, one_shape=True,
    )  # fmt: skip
    assert "divergences" not in result["methods"]["ar"]
    changed = result["methods"]["ar#changed"]
    assert changed["match_ar"] == 0.5
    [d] = changed["divergences"]
    assert (d["generation"], d["position"], d["row_token"]) == (1, 3, d["ar_token"] + 1)
    assert d["ar_margin"] >= 0


def test_top2_margin_at_one_width_compiles_once(tiny_ckpt):
    """Prompts of several buckets at one width (the benchmark's longest row) share one
    program."""
    from jaxspec.divergence import _logits_after

    model = load_model(tiny_ckpt[0])
    before = _logits_after._cache_size()
    for n in (40, 60, 70):  # buckets 48, 64, 96
        top2_margin(model, list(range(3, 3 + n)), width=96)
    assert _logits_after._cache_size() <= before + 1
