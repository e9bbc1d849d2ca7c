"""Drafters whose drafts run beside the real tokens (FIRP's pseudo chains, SDSAT's adaptive
tokens) compute a prompt's rows in a pass of their own, exactly AR's prefill: on an
accelerator, products tiled by row count would otherwise change the prompt's bits (and
greedy outputs at near-ties) whenever chains are added beside them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec.drafters.firp as firp_module
import jaxspec.drafters.sdsat as sdsat_module
from jaxspec.drafters.firp import FirpDrafter
from jaxspec.kv_cache import causal_mask, commit, init_cache
from jaxspec.llama import embed, run_layers
from tests.test_firp import deeper, random_maps
from tests.test_sdsat import random_sdsat

B, P, PREFIX = 2, 6, 5


def drafters(cfg, params):
    firp = FirpDrafter(cfg, (1, 2, 4))
    sdsat, sdsat_params = random_sdsat(cfg, params, one_forward=True)
    return {"firp": (firp, random_maps(cfg, 3)), "sdsat": (sdsat, sdsat_params)}


def prompt_inputs(cfg, params, with_cache: bool):
    """-> (h [B,P,D], positions, cache or None, mask, anchors [B,1]): a right-padded prompt
    (row 1 has 4 real tokens), after PREFIX and 3 committed tokens when with_cache."""
    tokens = jax.random.randint(jax.random.key(5), (B, PREFIX + P), 0, cfg.vocab_size)
    cache, start = None, jnp.zeros((B,), jnp.int32)
    if with_cache:
        cache = init_cache(cfg, B, 32)
        _, block, _ = run_layers(params, cfg, embed(params, tokens[:, :PREFIX]),
                                 jnp.broadcast_to(jnp.arange(PREFIX), (B, PREFIX)), None,
                                 causal_mask(B, PREFIX))  # fmt: skip
        start = jnp.asarray([PREFIX, 3], jnp.int32)  # rows of different lengths
        cache = commit(cache, block, start)
    positions = start[:, None] + jnp.arange(P)
    anchors = jnp.asarray([[P - 1], [3]])
    return embed(params, tokens[:, PREFIX:]), positions, cache, causal_mask(B, P), anchors


@pytest.mark.parametrize("window", [0, 4])  # 4: a sliding window (Mistral) shorter than P
@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("which", ["firp", "sdsat"])
def test_prefill_computes_the_prompt_alone_and_the_same_drafts(which, with_cache, window):
    cfg, params = deeper("tiny-gqa")
    cfg = dataclasses.replace(cfg, sliding_window=window)
    drafter, dparams = drafters(cfg, params)[which]
    h, positions, cache, mask, anchors = prompt_inputs(cfg, params, with_cache)
    args = (params, dparams, cfg, h, positions, cache, mask, anchors, (2, cfg.n_layers), 3)
    real, block, states, drafts = drafter.prefill_model(*args)
    plain, plain_block, plain_states = run_layers(
        params, cfg, h, positions, cache, mask, collect=(2, cfg.n_layers)
    )
    np.testing.assert_array_equal(np.asarray(real), np.asarray(plain))
    for got, want in zip(block.keys + block.values, plain_block.keys + plain_block.values,
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert states.keys() == plain_states.keys()
    _, _, _, joint = drafter.run_model(*args)  # the drafts computed beside the prompt
    assert drafts.shape == joint.shape == (B, 1, 3, cfg.dim)
    # float32 rounding of values up to ~100 (jax versions sum in other orders): to 1e-5 of
    # the largest, where a wrong mask or position moves them by their own size
    scale = float(np.abs(np.asarray(joint)).max())
    np.testing.assert_allclose(np.asarray(drafts), np.asarray(joint), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("which", ["firp", "sdsat"])
def test_no_row_is_computed_beside_the_prompt(which, monkeypatch):
    """The prompt's rows go through every layer in one run_layers call of their own."""
    cfg, params = deeper("tiny-gqa")
    drafter, dparams = drafters(cfg, params)[which]
    calls = []

    def recorded(params, cfg, h, positions, *args, **kwargs):
        calls.append(h.shape[1])
        return run_layers(params, cfg, h, positions, *args, **kwargs)

    module = firp_module if which == "firp" else sdsat_module
    monkeypatch.setattr(module, "run_layers", recorded)
    if which == "sdsat":  # its plain pass is the base drafter's
        monkeypatch.setattr("jaxspec.drafters.base.run_layers", recorded)
    h, positions, cache, mask, anchors = prompt_inputs(cfg, params, False)
    drafter.prefill_model(params, dparams, cfg, h, positions, cache, mask, anchors, (), 3)
    assert calls[0] == P and all(n != P for n in calls[1:]), calls
