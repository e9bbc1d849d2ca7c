"""The Python API's arguments of the wrong kind, on the tiny checkpoint: each ends in a
one-line JaxspecError naming the argument, at the call (not inside JAX, pathlib or `re`,
and not later, inside a stream's thread); empty paths and trees are not read as "the
default". A TreeSpec or DynamicTree built by hand is a tree `Generator` takes, checked
like a named one, and decodes AR's tokens."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.tree import DynamicTree, TreeSpec
from tests.test_api import PROMPT, N


@pytest.fixture(scope="module")
def ar(tiny_model):
    return jaxspec.Generator(tiny_model, "ar")


def refused(message: str, call, *args, **kwargs) -> None:
    with pytest.raises(jaxspec.JaxspecError, match=re.escape(message)):
        call(*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_len": 100.5}, "max_len (--max-len) must be an integer from 1 to the model's"),
        ({"max_len": "100"}, "got '100'"),
        ({"max_len": True}, "got True"),  # once a limit of 1 position
        ({"chat": "no"}, "chat must be True or False, got 'no'"),  # once truthy: chat on
        ({"tree": ""}, "unknown tree ''"),  # once the default tree
        ({"tree": ["chain-2"]}, "a tree is named by a string (e.g. 'chain-2'"),
        ({"drafter": ""}, "drafter (--drafter) is empty: pass a path, or None"),
        ({"drafter": 5}, "drafter (--drafter) must be a path (str or Path), got int"),
    ],
)
def test_generator_arguments_of_the_wrong_kind(kwargs, message, tiny_model, tiny_drafters):
    if set(kwargs) <= {"max_len", "chat"}:
        refused(message, jaxspec.Generator, tiny_model, "ar", **kwargs)
    else:
        drafter = tiny_drafters / "medusa"
        refused(message, jaxspec.Generator, tiny_model, "medusa", **{"drafter": drafter, **kwargs})


def test_a_generator_needs_a_loaded_model_and_a_method_name(tiny_model, tiny_ckpt):
    for not_a_model in (None, str(tiny_ckpt[0])):
        refused("expected a loaded model (model = jaxspec.load_model(PATH))",
                jaxspec.Generator, not_a_model, "ar")  # fmt: skip
        refused("expected a loaded model", jaxspec.load_drafter, not_a_model, "medusa")
    refused("unknown method ['medusa']", jaxspec.Generator, tiny_model, ["medusa"])


def test_load_model_and_load_drafter_paths(tiny_model, tiny_ckpt, tmp_path):
    refused("the model's path is empty: pass a path, or None", jaxspec.load_model, "")
    refused("the model's path must be a path (str or Path), got int", jaxspec.load_model, 5)
    refused("the drafter's path is empty", jaxspec.load_drafter, tiny_model, "medusa", "")
    home = tmp_path / "home"
    with pytest.MonkeyPatch.context() as mp:  # `~` is the user's home, not a folder named ~
        mp.setenv("HOME", str(home))
        refused(f"no model at {home / 'm'}", jaxspec.load_model, "~/m")


def test_a_mesh_is_text_or_a_mesh_of_the_two_axes(tiny_ckpt):
    bad_axes = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    for mesh, got in [(3, "got int"), (bad_axes, "got a Mesh with axes ('x', 'y')")]:
        refused(f"mesh (--mesh) is \"data=D,model=M\" or a jax Mesh with axes ('data', "
                f"'model'), {got}", jaxspec.load_model, tiny_ckpt[0], mesh=mesh)  # fmt: skip


def test_sampling_takes_numpy_seeds_and_float32_temperatures(ar):
    sampled = ar.generate(PROMPT, N, temperature=1.0, seed=3).token_ids
    assert ar.generate(PROMPT, N, temperature=1.0, seed=np.int64(3)).token_ids == sampled
    greedy = ar.generate(PROMPT, N).token_ids
    assert ar.generate(PROMPT, N, temperature=1e-30, seed=3).token_ids == greedy  # once all 0s
    for t in (1e300, 1e-39):  # beyond float32, below its normal numbers (flushed to 0)
        refused("temperature (--temperature) must be 0 (greedy) or from 1.18e-38 to 3.4e+38",
                ar.generate, PROMPT, N, temperature=t)  # fmt: skip


def test_stream_refuses_what_cannot_fit_at_the_call(ar, tiny_model):
    """Before, these passed the call and failed on the first piece, from the thread."""
    refused("empty prompt", ar.stream, [], N)
    refused("exceeds the limit", ar.stream, PROMPT, tiny_model.cfg.max_position)
    refused("exceeds the limit", ar.stream, [5] * tiny_model.cfg.max_position, N)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: TreeSpec(((0, 0),)), "invalid tree: path (0, 0) has no parent (0,)"),
        (lambda: TreeSpec(((-1,),)), "path (-1,) must be a non-empty sequence of integer ranks"),
        (lambda: TreeSpec(((),)), "path () must be a non-empty sequence"),
        (lambda: TreeSpec("abc"), "invalid tree: paths are a sequence of paths, got 'abc'"),
        (lambda: TreeSpec([(0.5,)]), "path (0.5,) must be"),  # once rank 0
        (lambda: TreeSpec([0, 1]), "a path is a sequence of ranks, got 0"),
        (lambda: TreeSpec([(0,), (0,)]), "a path is listed twice"),
        (lambda: TreeSpec.chain(0), "tree chain-0: its depth must be an integer >= 1"),
        (lambda: TreeSpec.comb(2, 0), "tree comb-2-0: its width must be an integer >= 1"),
        (lambda: DynamicTree(8.5), "got nodes=8.5, depth=0, width=8"),
    ],
)
def test_a_tree_built_by_hand_is_checked(build, message):
    refused(message, build)


def test_a_tree_built_by_hand_decodes_ars_tokens(tiny_model, tiny_drafters, ar):
    assert TreeSpec([[1], [0], [0, 0]]).paths == ((0,), (1,), (0, 0))  # sorted, hashable
    expected = ar.generate(PROMPT, N).token_ids
    for method, tree in [("medusa", TreeSpec.comb(2, 10)), ("eagle", DynamicTree(8))]:
        gen = jaxspec.Generator(tiny_model, method, drafter=tiny_drafters / method, tree=tree)
        assert gen.generate(PROMPT, N).token_ids == expected
    refused("tree (--tree) picks a draft tree; method 'ar' has none",
            jaxspec.Generator, tiny_model, "ar", tree=TreeSpec.chain(1))  # fmt: skip
    refused("tree depth 5 exceeds the drafter's 2 Medusa heads", jaxspec.Generator, tiny_model,
            "medusa", drafter=tiny_drafters / "medusa", tree=TreeSpec.chain(5))  # fmt: skip
