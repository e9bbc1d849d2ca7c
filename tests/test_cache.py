"""KV cache writes, the cache attention mask, and cached decoding against a full forward."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import preset
from jaxspec.kv_cache import KVBlock, attention_mask, causal_mask, commit, init_cache, write_rows
from jaxspec.layers import OutIn, dense, split_bfloat16
from jaxspec.llama import forward as eager_forward
from jaxspec.llama import init_params

forward = jax.jit(eager_forward, static_argnums=1)


def test_attention_mask_literal():
    # Row 0: 2 committed slots, 3 new causal tokens. Row 1: 0 committed, a 3-token tree
    # where tokens 1 and 2 are siblings under token 0.
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    new_mask = jnp.stack([causal_mask(1, 3)[0], jnp.asarray(tree)])
    mask = attention_mask(jnp.array([2, 0]), new_mask, 4)
    expected = np.array(
        [
            [[1, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 1]],
            [[0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 0, 1]],
        ],
        bool,
    )
    np.testing.assert_array_equal(np.asarray(mask), expected)


def test_commit_writes_at_lengths_and_advances():
    cfg = preset("tiny-mqa")
    cache = init_cache(cfg, 2, 6).replace(lengths=jnp.array([1, 3], jnp.int32))
    new = jnp.arange(2 * 2, dtype=jnp.float32).reshape(2, 1, 2, 1) + 1  # [B,K,T,H=1] values
    block = KVBlock(
        tuple(jnp.broadcast_to(new, (2, 1, 2, cfg.head_dim)) for _ in range(cfg.n_layers)),
        tuple(-jnp.broadcast_to(new, (2, 1, 2, cfg.head_dim)) for _ in range(cfg.n_layers)),
    )
    cache = commit(cache, block, jnp.array([2, 1], jnp.int32))
    np.testing.assert_array_equal(cache.lengths, [3, 4])
    np.testing.assert_array_equal(
        np.asarray(cache.keys[1])[:, 0, :, 0], [[0, 1, 2, 0, 0, 0], [0, 0, 0, 3, 4, 0]]
    )
    np.testing.assert_array_equal(np.asarray(cache.values[0])[1, 0, :, 0], [0, 0, 0, -3, -4, 0])


def test_write_rows_per_row_offsets():
    buf = jnp.zeros((2, 1, 5, 1))  # [B,K,S,H]
    new = jnp.array([[[[1.0], [2.0]]], [[[3.0], [4.0]]]])  # [B,K,T,H]
    out = np.asarray(write_rows(buf, new, jnp.array([0, 3])))[:, 0, :, 0]
    np.testing.assert_array_equal(out, [[1, 2, 0, 0, 0], [0, 0, 0, 3, 4]])


def test_incremental_decode_equals_full_forward():
    cfg = preset("tiny-gqa")
    params = init_params(cfg, jax.random.key(0), scale=0.2)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    full, _, _ = forward(params, cfg, tokens, positions, init_cache(cfg, 2, 16), causal_mask(2, 12))

    # Prefill 5 tokens, then feed the rest one and three at a time.
    cache = init_cache(cfg, 2, 16)
    pieces = []
    for start, stop in [(0, 5), (5, 6), (6, 9), (9, 12)]:
        T = stop - start
        logits, block, _ = forward(
            params, cfg, tokens[:, start:stop], positions[:, start:stop], cache, causal_mask(2, T)
        )
        cache = commit(cache, block, jnp.full((2,), T, jnp.int32))
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5, rtol=1e-5)


def test_padding_after_the_prompt_is_invisible():
    """Bucketed prefill: right padding changes no logit of the real tokens."""
    cfg = preset("tiny-mqa")
    params = init_params(cfg, jax.random.key(0), scale=0.2)
    tokens = jax.random.randint(jax.random.key(2), (1, 7), 0, cfg.vocab_size)
    padded = jnp.concatenate([tokens, jnp.zeros((1, 9), jnp.int32)], 1)

    def run(toks):
        T = toks.shape[1]
        pos = jnp.arange(T)[None]
        return forward(params, cfg, toks, pos, init_cache(cfg, 1, 16), causal_mask(1, T))[0]

    np.testing.assert_allclose(run(padded)[:, :7], run(tokens), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_dense_rows_are_independent_of_how_many_are_computed(dtype, transposed):
    """Greedy losslessness rests on this: a row's product is the same bits whether it is
    computed alone (AR) or among a tree's rows (verify). bfloat16 weights: any row count;
    float32: from 2 rows (XLA:CPU computes a single float32 row with another kernel, see
    DESIGN.md). Both are float32-accurate products of float32 activations."""
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (16, 96))
    w = jax.random.normal(kw, (200, 96) if transposed else (96, 200)).astype(dtype)
    w_arg = OutIn(w) if transposed else w
    together = jax.jit(dense)(x, w_arg)
    assert together.dtype == jnp.float32 and together.shape == (16, 200)
    for rows in (1, 2, 5) if dtype == jnp.bfloat16 else (2, 5):
        alone = jax.jit(dense)(x[:rows], w_arg)
        np.testing.assert_array_equal(np.asarray(alone), np.asarray(together[:rows]))
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    exact = np.asarray(x, np.float64) @ (w64.T if transposed else w64)
    np.testing.assert_allclose(np.asarray(together), exact, rtol=1e-5, atol=1e-5)


def test_split_bfloat16_parts_sum_exactly_to_float32():
    x = jax.random.normal(jax.random.key(4), (5, 64)) * jnp.logspace(-30, 30, 64)
    parts = split_bfloat16(x)
    assert parts.dtype == jnp.bfloat16 and parts.shape == (15, 64)
    p = np.asarray(parts.astype(jnp.float32), np.float64).reshape(5, 3, 64)
    np.testing.assert_array_equal(p[:, 0] + p[:, 1] + p[:, 2], np.asarray(x, np.float64))


def test_a_request_may_fill_the_context_and_the_slots_written_ahead_lie_past_it():
    """chain-4: a step writes up to 5 slots past the last kept token, and a finished row
    one more step (2 x 5). Those slots hold no kept token, so they may lie past the limit:
    a 49-token prompt + 15 new tokens fill a 64-position context exactly (a 74-slot cache)
    and decode as AR does with every draft accepted; one token more is refused, with the
    numbers of the request."""
    from jaxspec.decode import SpeculativeGenerator
    from jaxspec.errors import JaxspecError
    from jaxspec.tree import tree_preset
    from tests.drafters import OracleDrafter

    cfg = dataclasses.replace(preset("tiny-gqa"), eos_token_ids=(), max_position=64)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    prompt = list(range(3, 52))
    plain = SpeculativeGenerator(cfg, params)
    assert plain.cache_len(49, 15) == 66  # AR's 2 slots past the context
    ar = plain.generate(prompt, 15).token_ids
    reference = jnp.asarray(prompt + ar + [0] * 8, jnp.int32)
    drafter, tree = OracleDrafter(cfg.vocab_size), tree_preset("chain-4")
    gen = SpeculativeGenerator(cfg, params, drafter, reference, tree)
    assert gen.cache_len(49, 15) == 74
    result = gen.generate(prompt, 15)
    assert result.token_ids == ar and result.accepted == [4, 4, 4]  # every draft accepted
    message = "prompt of 49 tokens + 16 new tokens need 65 positions, which exceeds the limit"
    with pytest.raises(JaxspecError, match=re.escape(message + " of 64 positions")):
        gen.generate(prompt, 16)
    with pytest.raises(JaxspecError, match=re.escape(message)):
        plain.generate(prompt, 16)
