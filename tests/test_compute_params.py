"""compute_params: weights cast for decoding, bfloat16 block linears kept [out,in]."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoint import flatten_params
from jaxspec.config import preset
from jaxspec.kv_cache import causal_mask
from jaxspec.layers import OutIn, dense
from jaxspec.llama import LINEAR_NAMES, compute_params, forward, init_params


def tiny():
    cfg = dataclasses.replace(preset("tiny-gqa"), eos_token_ids=())
    return cfg, init_params(cfg, jax.random.key(0), scale=0.3)


def test_bfloat16_block_linears_become_out_in_and_nothing_else_does():
    _, params = tiny()
    bf16 = compute_params(params, "bfloat16")
    layer, stored = bf16["layers"][1], params["layers"][1]
    for name in LINEAR_NAMES:
        assert isinstance(layer[name], OutIn)
        assert layer[name].w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(layer[name].w.T, stored[name].astype(jnp.bfloat16))
    assert not isinstance(layer["input_layernorm"], OutIn)
    assert bf16["embed_tokens"].dtype == jnp.bfloat16
    f32 = compute_params(params, "float32")
    assert not any(isinstance(w, OutIn) for w in f32["layers"][1].values())
    assert compute_params(params, None) is params


def test_out_in_multiplies_like_in_out():
    x = jax.random.normal(jax.random.key(1), (2, 3, 64))
    w = jax.random.normal(jax.random.key(2), (64, 88)).astype(jnp.bfloat16)
    np.testing.assert_allclose(dense(x, OutIn(w.T)), dense(x, w), rtol=1e-6, atol=1e-6)


def test_bfloat16_logits_and_saved_weights_do_not_depend_on_the_order():
    """The forward with [out,in] weights gives the [in,out] forward's logits, and flattening
    for saving or export hands back [in,out] weights."""
    cfg, params = tiny()
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    out_in = compute_params(params, "bfloat16")
    tokens = jnp.array([[3, 14, 15, 92, 65]])
    positions = jnp.arange(5)[None]

    def logits(p):
        return forward(p, cfg, tokens, positions, None, causal_mask(1, 5))[0]

    np.testing.assert_allclose(logits(out_in), logits(cast), rtol=1e-5, atol=1e-5)
    flat, expected = flatten_params(out_in), flatten_params(cast)
    assert flat.keys() == expected.keys()
    for key, w in expected.items():
        np.testing.assert_array_equal(flat[key], w)
