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
    inputs = DraftInputs({}, history[jnp.arange(1), position], position,
                         state=LookupState(history))  # fmt: skip
    return LookupDrafter(**fields).propose(None, {}, tree_preset(tree), inputs, None)[0].tolist()


def test_continuations_longest_match_first_then_latest():
    found, matched = LookupDrafter().continuations(HISTORY, POSITION, 4, 3)
    assert found[0].tolist() == [[7, 1, 2], [7, 8, 9], [-1, -1, -1], [-1, -1, -1]]
    assert matched[0].tolist() == [2, 2, 0, 0]  # "5 6" twice; "6" alone ranks after
    found, matched = LookupDrafter(max_ngram=1).continuations(HISTORY, POSITION, 4, 3)
    assert found[0].tolist() == [[7, 1, 2], [7, 8, 9], [-1, -1, -1], [-1, -1, -1]]
    assert matched[0].tolist() == [1, 1, 0, 0]
    # A continuation running past the current token is unknown there.
    found, matched = LookupDrafter().continuations(HISTORY, jnp.array([6]), 2, 3)
    assert found[0].tolist() == [[7, 8, 9], [-1, -1, -1]]  # "5 6" at 0-1; nothing else matches
    assert matched[0].tolist() == [2, 0]


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
    assert "method 'lookup' has none" in err

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "a", "turns": [PROMPT]}))
    out = tmp_path / "r.json"
    bench_main(["--model", ckpt, "--methods", "ar,lookup,lookup@comb-2-2", "--questions",
                str(questions), "--max-new-tokens", "16", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["methods"]
    assert rows["lookup"]["match_ar"] == rows["lookup@comb-2-2"]["match_ar"] == 1.0
    assert np.all(np.diff(rows["lookup"]["acceptance_by_depth"]) <= 0)


def brute_force_confidence(data, G: int, D: int):
    """Per answer position: the latest of the longest earlier suffix matches (up to G
    tokens), its continuation compared with what came next, token by token."""
    tries, hits = np.zeros((G, D), int), np.zeros((G, D), int)
    for t, start, n in zip(data["tokens"], data["starts"], data["lengths"], strict=True):
        t = t[:n].tolist()
        for p in range(start - 1, n - 1):
            m_best, e_best = 0, -1
            for e in range(p - 1, -1, -1):
                m = 0
                while m < G and e - m >= 0 and t[e - m] == t[p - m]:
                    m += 1
                if m > m_best:
                    m_best, e_best = m, e
            for j in range(D if m_best else 0):
                if e_best + 1 + j > p or p + 1 + j >= n:
                    break
                tries[m_best - 1, j] += 1
                if t[e_best + 1 + j] != t[p + 1 + j]:
                    break
                hits[m_best - 1, j] += 1
    return tries, hits


def test_retrieval_confidence_counts_what_decoding_would_have_found():
    from jaxspec.drafters.retrieval_confidence import measure

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, (5, 40)).astype(np.int32)  # 4 tokens: many matches
    tokens[1, 20:30] = tokens[1, 5:15]  # a copied stretch
    data = {"tokens": tokens, "starts": np.array([3, 10, 1, 20, 39]),
            "lengths": np.array([40, 35, 40, 30, 40])}  # fmt: skip
    rates, tries = measure(data, LookupDrafter(max_ngram=3), 4)
    want_tries, want_hits = brute_force_confidence(data, 3, 4)
    np.testing.assert_array_equal(tries, want_tries)
    assert tries[:, :3].min() > 0  # every match length, three tokens deep
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(rates, want_hits / want_tries)  # nan where never tried


def test_a_longer_match_outranks_a_later_one_up_to_max_ngram():
    """The match "1 2 3" (3 tokens) at 0-2 then 9, "2 3" (2 tokens) at 5-6 then 8: the longer match
    leads though the shorter is later; a run of one token continues into the current one."""
    history = jnp.array([[1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3, 0, 0]])
    found, matched = LookupDrafter().continuations(history, jnp.array([10]), 3, 2)
    assert found[0].tolist() == [[9, 5], [8, 1], [-1, -1]]
    assert matched[0].tolist() == [3, 2, 0]
    # the match at 2 ("7 7") is followed by the current token itself (position 3): known
    found, matched = LookupDrafter().continuations(jnp.array([[5, 7, 7, 7, 0]]),
                                                   jnp.array([3]), 1, 2)  # fmt: skip
    assert found[0].tolist() == [[7, -1]] and matched[0].tolist() == [2]


def test_the_generated_tokens_join_the_text_matched():
    """advance() keeps the prompt and then every accepted token: a suffix repeated from
    the output (not the prompt) is found."""
    from jaxspec.drafters.base import Entered

    drafter = LookupDrafter()
    state = drafter.init_state(None, 1, 12, None)
    rounds = [([4, 6, 1], 0, 2), ([2, 8, 3], 3, 9), ([9, 2], 6, 8)]  # tokens, start, next
    for tokens, start, current in rounds:
        n = len(tokens)
        entered = Entered(jnp.array([tokens]), jnp.array([start]), jnp.array([n]), {})
        inputs = DraftInputs({}, jnp.array([current]), jnp.array([start + n]), entered=entered,
                             state=state)  # fmt: skip
        state = drafter.advance(None, {}, inputs)
    assert state.tokens[0, :9].tolist() == [4, 6, 1, 2, 8, 3, 9, 2, 8]
    found, matched = drafter.continuations(state.tokens, jnp.array([8]), 1, 2)
    # "2 8" ends at 8 (the current token); found at 3-4 (the first output tokens): then 3 9
    assert found[0].tolist() == [[3, 9]] and matched[0].tolist() == [2]


@pytest.mark.parametrize(
    "drafter_name, tree_name", [("lookup", "comb-3-2"), ("retrieval", "dynamic-6-3-2")]
)
def test_copied_drafts_sample_the_models_first_three_tokens(drafter_name, tree_name):
    """Many rows of a prompt that repeats itself (so matches are found and their drafts
    often accepted), sampled: the first three tokens jointly follow the model's
    distribution, with lookup's drafts (a comb: the best match's chain, siblings that no
    match reaches all token 0) and with retrieved chains in a Medusa tree."""
    from jaxspec.decode import SpeculativeGenerator
    from jaxspec.drafters.retrieval import RetrievalDrafter
    from jaxspec.sampling import Sampling
    from tests.test_speculative import (
        exact_joint_distribution,
        pooled_chisquare_pvalue,
        sampling_test_drafter,
        tiny,
    )

    cfg, params = tiny("tiny-mqa", vocab=6)
    sampling, prompt, N = Sampling(1.0), [1, 4, 2, 5, 1, 4, 2, 5, 1, 4], 3000
    drafter, dparams = LookupDrafter(), None
    if drafter_name == "retrieval":
        medusa, dparams = sampling_test_drafter("medusa", cfg, params)
        drafter = RetrievalDrafter(medusa, chains=2)
    gen = SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset(tree_name), sampling)
    got = gen.generate_batch([prompt] * N, 3, seed=2)
    assert np.mean([r.accepted[0] >= 1 for r in got]) > 0.1  # copied drafts were kept
    out = np.array([r.token_ids for r in got])
    expected = exact_joint_distribution(cfg, params, prompt, sampling, 3) * N  # 216 cells
    observed = np.zeros_like(expected)
    np.add.at(observed, (out[:, 0], out[:, 1], out[:, 2]), 1)
    assert pooled_chisquare_pvalue(observed, expected) > 1e-3
