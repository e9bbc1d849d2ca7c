"""How bfloat16 weights multiply: exact everywhere (the default), one bfloat16 pass in the
prefill (shared by AR and every method, so their tokens still agree), or everywhere."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.errors import JaxspecError
from jaxspec.layers import OutIn, PlainProducts, dense
from jaxspec.llama import compute_params, init_params, plain_products
from jaxspec.tree import tree_preset

CFG = dataclasses.replace(preset("tiny-gqa"), eos_token_ids=())


def test_plain_products_are_one_bfloat16_pass():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 3)), jnp.bfloat16)
    want = jnp.einsum("ri,io->ro", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(dense(x, PlainProducts(w)), want)
    np.testing.assert_array_equal(dense(x, PlainProducts(OutIn(w.T))), want)
    assert not np.array_equal(dense(x, w), want)  # the exact product keeps x's float32 bits


def test_plain_prefill_keeps_methods_on_ar_tokens():
    params = compute_params(init_params(CFG, jax.random.key(0), scale=0.3), jnp.bfloat16)
    wrapped = plain_products(params)
    assert isinstance(wrapped["layers"][0]["q_proj"], PlainProducts)
    assert wrapped["embed_tokens"] is params["embed_tokens"]  # the same arrays
    medusa = MedusaDrafter(CFG, 2)
    heads = compute_params(medusa.init(params, jax.random.key(1)), jnp.bfloat16)
    prompt = [5, 9, 7, 11, 3]
    for products in ("plain-prefill", "plain"):
        ar = SpeculativeGenerator(CFG, params, products=products).generate(prompt, 20)
        spec = SpeculativeGenerator(CFG, params, medusa, heads, tree_preset("comb-2-3"),
                                    products=products)  # fmt: skip
        got = spec.generate(prompt, 20)
        if products == "plain-prefill":
            assert got.token_ids == ar.token_ids
        assert len(got.token_ids) == 20
    with pytest.raises(JaxspecError, match="unknown products 'fast'"):
        SpeculativeGenerator(CFG, params, products="fast")
