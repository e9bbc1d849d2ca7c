"""Sampling paths the other chi-square tests leave out, pinned by a review of sampling's
losslessness: a prompt prefilled in chunks, in a batch whose rows have different prompt
lengths; the drafter's key apart from the keys that sample tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import SpeculativeGenerator
from jaxspec.sampling import Sampling
from jaxspec.tree import tree_preset
from tests.drafters import OracleDrafter
from tests.test_speculative import exact_joint_distribution, pooled_chisquare_pvalue, tiny


def test_chunked_prompts_of_two_lengths_sample_the_models_first_tokens():
    """2-token chunks, rows alternating a 5-token prompt (two chunks, then 1 token) and its
    first 4 tokens (one chunk, then 2), chain-1 drafts of token 0: each prompt's first two
    tokens (the chunked prefill's, then the first verify step's) jointly follow the model.
    A chunked prefill keyed at another position than the prompt's end (one the first step
    draws with too) would correlate the two draws."""
    cfg, params = tiny("tiny-mqa", vocab=6)
    sampling, N = Sampling(1.0), 600
    # p(x1, x2, x3 | the 4 tokens): its x1 = 3 slice is the 5-token prompt's p(x2, x3)
    joint = exact_joint_distribution(cfg, params, [1, 4, 2, 5], sampling, 3)
    prompts = {(1, 4, 2, 5, 3): joint[3] / joint[3].sum(), (1, 4, 2, 5): joint.sum(2)}
    zeros = jnp.zeros(16, jnp.int32)  # the oracle's reference: it drafts token 0
    gen = SpeculativeGenerator(
        cfg, params, OracleDrafter(cfg.vocab_size), zeros, tree_preset("chain-1"), sampling,
        prefill_chunk=2,
    )  # fmt: skip
    assert gen.shapes(5, 2)[0]  # prefilled in chunks
    results = gen.generate_batch([list(p) for p in prompts] * (N // 2), 2, seed=5)
    out = np.array([r.token_ids for r in results])
    for i, expected in enumerate(prompts.values()):
        expected = expected * (N // 2)
        observed = np.zeros_like(expected)
        np.add.at(observed, (out[i::2, 0], out[i::2, 1]), 1)
        assert pooled_chisquare_pvalue(observed, expected) > 1e-3


def test_the_drafters_key_is_apart_from_every_positions_sampling_key():
    """The key a drafter gets is none of the keys positions fold in (sampling.position_keys
    keys row r at position p by fold_in(fold_in(key, p), r)): a drafter folding rows into
    its own key never draws with a token's randomness (fold_in(key, 7) did, at position 7)."""
    from jaxspec.decode import _draft
    from jaxspec.drafters.base import DraftInputs

    class Spy:
        def advance(self, params, drafter_params, inputs):
            return None

        def propose(self, params, drafter_params, tree, inputs, key):
            self.key = key

    spy, key = Spy(), jax.random.key(3)
    _draft(spy, None, None, None, DraftInputs({}, jnp.zeros(1), jnp.zeros(1)), key)
    positions = jnp.arange(1 << 16, dtype=jnp.uint32)  # beyond any model's max_position
    position_keys = jax.vmap(lambda p: jax.random.key_data(jax.random.fold_in(key, p)))(positions)
    drafter_key = jax.random.key_data(spy.key)
    assert not (position_keys == drafter_key).all(-1).any()
