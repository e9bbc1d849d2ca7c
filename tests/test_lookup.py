"""Lookup (prompt lookup decoding): continuations found by suffix matching on device, trees
filled from them, and decoding that is AR's, token for token, through the API, the CLI
and the benchmark."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.drafters.base import DraftInputs
from jaxspec.drafters.lookup import LookupDrafter, LookupState
from jaxspec.tree import tree_preset

# The current token (position 11) is 6 after 5: "5 6" occurred at 5-6 (then 7 1 2) and at
# 0-1 (then 7 8 9); "6" alone at 1 and 6 too, but a two-token match ranks first.
HISTORY = jnp.array([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 0, 0, 0, 0]])
POSITION = jnp.array([11])


def propose(tree: str, history=HISTORY, position=POSITION, **fields) -> list[int]:
    inputs = DraftInputs({}, history[jnp.arange(1), position], position, None, None,
                         state=LookupState(history))  # fmt: skip
    return LookupDrafter(**fields).propose(None, {}, tree_preset(tree), inputs, None)[0].tolist()


def test_continuations_longest_match_first_then_latest():
    got = LookupDrafter().continuations(HISTORY, POSITION, 4, 3)[0].tolist()
    assert got == [[7, 1, 2], [7, 8, 9], [-1, -1, -1], [-1, -1, -1]]
    # A continuation running past the current token is unknown there.
    at_end = LookupDrafter().continuations(HISTORY, jnp.array([6]), 2, 3)[0].tolist()
    assert at_end == [[7, 8, 9], [-1, -1, -1]]  # "5 6" at 0-1; nothing else matches


def test_trees_are_filled_from_the_continuations():
    assert propose("chain-3") == [7, 1, 2]  # the best match's continuation
    # comb-2-3: depth 1 ranks 0-2 (only 7 follows any match), then under 7 the distinct
    # next tokens of the matches that agree with it: 1 (latest), then 8.
    assert tree_preset("comb-2-3").paths == ((0,), (1,), (2,), (0, 0), (0, 1), (0, 2))
    assert propose("comb-2-3") == [7, 0, 0, 1, 8, 0]
    # With only unigram matching, "6" at 6 and 1 still lead to 7, the same drafts.
    assert propose("chain-3", max_ngram=1) == [7, 1, 2]
    no_match = jnp.array([[1, 2, 3, 4, 9, 0, 0, 0]])
    assert propose("chain-2", no_match, jnp.array([4])) == [0, 0]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return jaxspec.load_model(tiny_ckpt[0], dtype="float32")


# A prompt that repeats itself, so that the (random) tiny model's output and its prompt
# share n-grams for lookup to find.
PROMPT = "w5 w9 w7 w11 w5 w9 w7 w11 w5 w9"


@pytest.mark.parametrize("tree", ["chain-4", "comb-3-3"])
def test_lookup_decodes_ars_tokens(model, tree):
    ar = jaxspec.Generator(model).generate([PROMPT, "w8 w8 w8"], max_new_tokens=24)
    got = jaxspec.Generator(model, "lookup", tree=tree).generate(
        [PROMPT, "w8 w8 w8"], max_new_tokens=24
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert sum(r.steps for r in got) < sum(r.steps for r in ar)  # it found and kept drafts
    assert max(max(r.accepted) for r in got) >= 2


def test_lookup_from_the_shell_and_in_the_benchmark(tiny_ckpt, tmp_path, capsys):
    from infer.bench import main as bench_main
    from infer.generate import main as generate_main
    from tests.conftest import one_line_error

    ckpt = str(tiny_ckpt[0])
    capsys.readouterr()
    argv = ["--model", ckpt, "--json", "--max-new-tokens", "16", PROMPT]
    generate_main(argv)
    ar = json.loads(capsys.readouterr().out)
    generate_main(["--method", "lookup", *argv])
    lookup = json.loads(capsys.readouterr().out)
    assert lookup["token_ids"] == ar["token_ids"] and lookup["method"] == "lookup"
    err = one_line_error(generate_main, ["--method", "lookup", "--drafter", ckpt, *argv], capsys)
    assert "--method lookup has none" in err

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "a", "turns": [PROMPT]}))
    out = tmp_path / "r.json"
    bench_main(["--model", ckpt, "--methods", "ar,lookup,lookup@comb-2-2", "--questions",
                str(questions), "--max-new-tokens", "16", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["methods"]
    assert rows["lookup"]["match_ar"] == rows["lookup@comb-2-2"]["match_ar"] == 1.0
    assert np.all(np.diff(rows["lookup"]["acceptance_by_depth"]) <= 0)
