"""The drafter base class's shared logic (default trees, dynamic drafting, the protocol's
defaults) and retrieval candidates (what RetrievalDrafter hands its inner drafter, and
the measured confidences it carries), pinned from a mutation review."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters.base import (
    Drafter,
    DraftInputs,
    Entered,
    default_tree,
    resolve_tree,
    tree_candidates,
)
from jaxspec.drafters.lookup import SPARE_SLOTS, LookupDrafter, LookupState
from jaxspec.drafters.retrieval import LOOKUP_CONFIDENCE, RetrievalDrafter, RetrievalState
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError
from jaxspec.topology import Retrieved
from jaxspec.tree import DynamicTree, TreeSpec, tree_preset
from tests.test_dynamic_tree import chosen_paths

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_tree_per_backend(monkeypatch):
    """CPU: the drafter's cpu_tree, else chain-1; accelerators: its gpu_tree, else its own
    searched-64, else the gpu-63 preset; select_tree takes a name given over either."""
    bare, searched = DrafterSettings(), DrafterSettings(trees={"searched-64": [[0]]})
    own = DrafterSettings(trees={"searched-64": [[0]]}, cpu_tree="cpu-8", gpu_tree="cpu-16")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert [default_tree(s) for s in (bare, searched, own)] == ["chain-1", "chain-1", "cpu-8"]
    assert Drafter().select_tree(None, bare) == tree_preset("chain-1")
    assert Drafter().select_tree("comb-2-2", own) == tree_preset("comb-2-2")
    for backend in ("gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        got = [default_tree(s) for s in (bare, searched, own)]
        assert got == ["gpu-63", "searched-64", "cpu-16"]
    assert Drafter().select_tree(None, searched) == TreeSpec([[0]])


def test_a_drafters_own_tree_shadows_the_preset_of_its_name():
    """A tree the drafter ships under a preset's name is the one verified; an unknown name
    is one error, not one chained to tree_preset's."""
    settings = DrafterSettings(trees={"chain-3": [[0]]})
    assert resolve_tree("chain-3", settings).n_nodes == 2  # the preset chain-3 has 4
    with pytest.raises(JaxspecError, match="drafter's own: chain-3") as e:
        resolve_tree("searched-99", settings)
    assert e.value.__cause__ is None and e.value.__suppress_context__


# Hand-worked guesses: depth 1 token 1 (p ~ 0.52) then 2 (~ 0.47); depth 2 token 5 (~ 0.52)
# then 6. Two nodes of width 2 take 1 and 2 (1 -> 5 scores ~ 0.27). A calibration sending
# depth 2's guesses to probability 1 gives 1 -> 5 its parent's 0.52: it beats 2.
LOGITS = jnp.full((1, 2, 8), -9.0).at[0, 0, 1].set(3.0).at[0, 0, 2].set(2.9)
LOGITS = LOGITS.at[0, 1, 5].set(1.0).at[0, 1, 6].set(0.9)
SURE_OF_DEPTH_2 = ((1.0, 0.0), (0.0, 0.0))
TWO = DynamicTree(3, 2, 2)


@dataclasses.dataclass(frozen=True)
class FixedGuesses(Drafter):
    calibration: tuple = ()

    def guesses(self, params, drafter_params, tree, inputs):
        return LOGITS


def test_dynamic_drafting_uses_the_drafters_calibration_and_retrieved_chains():
    """draft_dynamic and tree_candidates map guesses through the drafter's calibration;
    draft_dynamic adds `extra`'s chains (2 -> 5, sure of itself: it takes both places)."""

    def paths(draft):
        return set(chosen_paths(draft, 0))

    assert paths(FixedGuesses().draft_dynamic(None, None, None, TWO)) == {(1,), (2,)}
    calibrated = FixedGuesses(SURE_OF_DEPTH_2)
    assert paths(calibrated.draft_dynamic(None, None, None, TWO)) == {(1,), (1, 5)}
    assert paths(tree_candidates(LOGITS, TWO)) == {(1,), (2,)}
    assert paths(tree_candidates(LOGITS, TWO, SURE_OF_DEPTH_2)) == {(1,), (1, 5)}
    chains = jnp.array([[[2, 5]]])
    extra = Retrieved(chains, jnp.log(jnp.array([[[0.9, 0.72]]])))
    assert paths(calibrated.draft_dynamic(None, None, None, TWO, extra)) == {(2,), (2, 5)}


def test_static_trees_take_each_depths_guess_of_their_rank():
    """tree_candidates: the node at depth d and rank r gets depth d's rank-r guess."""
    logits = jnp.array([[[0.0, 1.0, 3.0, 0.5, 4.0, 2.0], [2.0, 5.0, 0.0, 4.0, 1.0, 3.0]]])
    tree = TreeSpec([(0,), (1,), (0, 0), (0, 1), (0, 2)])
    assert tree_candidates(logits, tree).tolist() == [[4, 2, 1, 3, 5]]


def test_the_base_state_shardings_split_every_array_by_rows():
    """Drafter.state_shardings: the rows' sharding for every array of the state."""
    state = {"a": jnp.zeros(2), "b": (jnp.zeros((2, 3)),)}
    got = Drafter().state_shardings(state, SimpleNamespace(rows="rows", replicated="whole"))
    assert got == {"a": "rows", "b": ("rows",)}


def test_the_base_advance_keeps_the_state():
    """A drafter overriding only init_state (a fixed table) keeps its state every step."""
    state = {"table": jnp.arange(3)}
    inputs = DraftInputs({}, jnp.array([1]), jnp.array([4]), state=state)
    assert Drafter().advance(None, None, inputs) is state


@dataclasses.dataclass(frozen=True)
class Spy(Drafter):
    """An inner drafter whose every answer names the call and its arguments."""

    collect = (1, 2)
    draft_depth = 3

    def check_tree(self, tree):
        raise JaxspecError("the inner drafter refuses")

    def run_model(self, *args):
        return ("run_model", args)

    def prefill_model(self, *args):
        return ("prefill_model", args)

    def projected_rows(self, *args):
        return ("projected_rows", args)

    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None):
        return ("inner state", drafter_params)

    def state_shardings(self, state, layout):
        return ("inner shardings", state)

    def advance(self, params, drafter_params, inputs):
        return ("advanced", inputs.state)

    def draft_dynamic(self, params, drafter_params, inputs, tree, extra=None):
        return inputs.state, extra


def test_retrieval_hands_the_model_state_and_checks_to_its_drafter():
    """collect, draft_depth, run_model, prefill_model (FIRP's differs), projected_rows
    (Medusa's heads projected with the verify rows), init_state (with the drafter params:
    Chimera's pre-filled table), state shardings and tree checks are the inner drafter's;
    lookup's token state sits beside it, split by rows."""
    r = RetrievalDrafter(Spy(), 2)
    assert (r.collect, r.draft_depth) == ((1, 2), 3)
    assert r.run_model(1, 2) == ("run_model", (1, 2))
    assert r.prefill_model(1, 2) == ("prefill_model", (1, 2))
    assert r.projected_rows(1, 2) == ("projected_rows", (1, 2))
    state = r.init_state(None, 2, 10, jnp.float32, {"table": 7})
    assert state.inner == ("inner state", {"table": 7})
    assert state.lookup.tokens.shape == (2, 10 + SPARE_SLOTS)
    shardings = r.state_shardings(state, SimpleNamespace(rows="rows", replicated="whole"))
    assert shardings.inner == ("inner shardings", state.inner)
    assert shardings.lookup == LookupState("rows")
    with pytest.raises(JaxspecError, match="the inner drafter refuses"):
        r.check_tree(DynamicTree(8, 3, 2))
    with pytest.raises(JaxspecError, match="retrieval candidates join dynamic trees"):
        r.check_tree(tree_preset("chain-2"))


def test_retrieval_advances_both_states():
    """advance: the inner drafter's state by its own advance, lookup's tokens with the
    entered ones and the current one after them."""
    state = RetrievalState("inner", LookupDrafter().init_state(None, 1, 6, None))
    entered = Entered(jnp.array([[4, 6, 1]]), jnp.array([0]), jnp.array([3]), {})
    inputs = DraftInputs({}, jnp.array([8]), jnp.array([3]), entered=entered, state=state)
    got = RetrievalDrafter(Spy()).advance(None, None, inputs)
    assert got.inner == ("advanced", "inner")
    assert got.lookup.tokens[0, :5].tolist() == [4, 6, 1, 8, 0]


def test_retrieval_offers_the_best_continuations_with_their_confidence():
    """The current token (position 11) is 6 after 5: "5 6" occurred at 5-6 (then 7 1 2)
    and 0-1 (then 7 8 9): with 2 chains, both, each node scored by 2-token matches'
    confidences multiplied along the chain; the inner drafter gets its own state."""
    history = jnp.array([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 0, 0, 0, 0]])
    state = RetrievalState("inner", LookupState(history))
    inputs = DraftInputs({}, jnp.array([6]), jnp.array([11]), state=state)
    inner, extra = RetrievalDrafter(Spy(), 2).propose(
        None, None, DynamicTree(8, 3, 2), inputs, None
    )
    assert inner == "inner"
    assert extra.tokens.tolist() == [[[7, 1, 2], [7, 8, 9]]]
    want = np.log(np.cumprod(LOOKUP_CONFIDENCE[1][:3]))
    np.testing.assert_allclose(np.asarray(extra.score[0]), [want, want], rtol=1e-6)


def test_lookup_confidence_is_the_table_the_design_documents():
    """LOOKUP_CONFIDENCE is docs/design.md's measured table, row by match length."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\s*\| (\d) tokens? \|(.*)\|\s*$", text, re.MULTILINE)
    assert [int(m) for m, _ in rows] == [1, 2, 3]
    table = [[float(x) for x in re.findall(r"\b0\.\d+", cells)] for _, cells in rows]
    assert table == [list(row) for row in LOOKUP_CONFIDENCE]


def test_retrieval_confidence_from_the_shell(tmp_path, capsys):
    """The command prints one line per match length (3 by default) with one cell per
    depth (6 by default): measure's rate (3 decimals) and its tries; the flags set both."""
    from jaxspec.drafters.retrieval_confidence import main, measure

    tokens = np.tile(np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32), (2, 3))  # [2,24]
    tokens[1, 8:12] = [7, 7, 7, 7]
    data = {"tokens": tokens, "starts": np.array([2, 4]), "lengths": np.array([24, 20])}
    np.savez(tmp_path / "a.npz", **data)
    main([str(tmp_path / "a.npz")])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["match 1", "match 2", "match 3"]
    assert all(line.count("(") == 6 for line in lines)
    main([str(tmp_path / "a.npz"), "--max-ngram", "2", "--depth", "2"])
    lines = capsys.readouterr().out.splitlines()
    rates, tries = measure(data, LookupDrafter(max_ngram=2), 2)
    assert tries.min() > 0
    assert lines == [
        f"match {m}: "
        + ", ".join(f"{r:.3f} ({c})" for r, c in zip(rates[m - 1], tries[m - 1], strict=True))
        for m in (1, 2)
    ]
