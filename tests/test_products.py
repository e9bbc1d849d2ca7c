"""How bfloat16 weights multiply: exact everywhere (the default), one bfloat16 pass in the
prefill (shared by AR and every method, so their tokens still agree), or everywhere."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import attention_mask, causal_mask
from jaxspec.layers import OutIn, PlainProducts, PrefixReads, attention, dense
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


@pytest.mark.parametrize("out_in", [False, True])
def test_bfloat16_dense_keeps_all_24_bits_of_x(out_in):
    """A shift of the columns times 2 (exact in bfloat16) moves each of x's float32 values
    (24 significant bits, 8 in each split part) to the next column unchanged, in either
    weight order: the float64 product bit for bit."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(4, 6)) * 2.0 ** rng.integers(-20, 20, (4, 6))).astype(np.float32)
    shift = 2 * np.roll(np.eye(6), 1, axis=1)  # [in,out]
    w = jnp.asarray(shift, jnp.bfloat16)
    got = dense(jnp.asarray(x), OutIn(w.T) if out_in else w)
    np.testing.assert_array_equal(got, x.astype(np.float64) @ shift)


@pytest.mark.parametrize("prefix", [False, True])
def test_plain_attention_reads_only_bfloat16_bits(prefix):
    """plain=True: both of attention's products are one bfloat16 pass (over the cache read
    whole or block by block), so q, k and v rounded to bfloat16 first give the same bits;
    the float32 products see the bits the rounding drops."""
    rng = np.random.default_rng(1)
    B, T, S, N, K, H = 1, 3, 8, 4, 2, 8
    shapes = [(B, T, N, H), (B, K, S, H), (B, K, S, H), (B, K, T, H), (B, K, T, H)]
    args = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    rounded = [a.astype(jnp.bfloat16).astype(jnp.float32) for a in args]
    lengths, causal = jnp.array([5]), causal_mask(B, T)
    mask = attention_mask(lengths, causal, S)
    if prefix:
        mask = PrefixReads(lengths, causal, lengths[:, None] + jnp.arange(T), 0, 4)
    run = jax.jit(lambda inputs, plain: attention(*inputs, mask, plain), static_argnums=1)
    np.testing.assert_array_equal(run(args, True), run(rounded, True))
    assert not np.array_equal(run(args, False), run(rounded, False))


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


def test_plain_prefill_is_the_default_on_a_gpu_only(monkeypatch):
    """The backend picks the default products: plain-prefill on a GPU (measured faster
    there), exact elsewhere; an explicit choice wins, PPD's included."""
    from jaxspec.decode import default_products
    from jaxspec.drafters.registry import method
    from jaxspec.methods import build_ppd

    params = compute_params(init_params(CFG, jax.random.key(0), scale=0.3), jnp.bfloat16)
    for backend, want in [("cpu", "exact"), ("tpu", "exact"), ("gpu", "plain-prefill")]:
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert default_products() == want
        q_proj = SpeculativeGenerator(CFG, params).prefill_params["layers"][0]["q_proj"]
        assert isinstance(q_proj, PlainProducts) == (want == "plain-prefill")
        exact = SpeculativeGenerator(CFG, params, products="exact")
        assert not isinstance(exact.prefill_params["layers"][0]["q_proj"], PlainProducts)
    model = types.SimpleNamespace(cfg=CFG, params=params, mesh=None)
    ppd = build_ppd(model, method("ppd"), None, None, None, None, None, {"ppd_k": 2})
    assert isinstance(ppd.prefill_params["layers"][0]["q_proj"], PlainProducts)  # a GPU's
    assert not isinstance(ppd.params["layers"][0]["q_proj"], PlainProducts)
    ppd = build_ppd(model, method("ppd"), None, None, None, None, "exact", {"ppd_k": 2})
    assert not isinstance(ppd.prefill_params["layers"][0]["q_proj"], PlainProducts)


def test_decoding_programs_compile_with_roundings_as_written(monkeypatch):
    """Every program of a generation is compiled with layers.EXACT_ROUNDING (no excess
    precision: XLA:GPU could otherwise undo split_bfloat16's exact split)."""
    from jaxspec.layers import EXACT_ROUNDING

    options, compile_ = [], jax.stages.Lowered.compile

    def recording(self, compiler_options=None, **kw):
        options.append(compiler_options)
        return compile_(self, compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    params = compute_params(init_params(CFG, jax.random.key(0), scale=0.3), jnp.bfloat16)
    medusa = MedusaDrafter(CFG, 2)
    heads = compute_params(medusa.init(params, jax.random.key(1)), jnp.bfloat16)
    SpeculativeGenerator(CFG, params, medusa, heads, tree_preset("comb-2-3")).generate([5, 9], 4)
    assert len(options) >= 4 and all(o == EXACT_ROUNDING for o in options)
