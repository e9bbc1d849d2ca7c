"""Whether a row's numbers depend on the rows computed with it, on this device. An AR step
computes one new row, a verify step a tree's; greedy speculative decoding gives AR's
tokens exactly when the rows they share come out the same bits. Measured for the weight
products (`layers.dense`, bfloat16 weights) and for a 2-layer model's logits after a
cache: row 0 computed among n rows against alone, each program compiled with XLA's
defaults and with `layers.EXACT_ROUNDING`; and the products' error against float64.
Also the time of a product at each row count, as decoding computes it: whether one row
(an AR step: the split's three) costs more than a few (a small verify step)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig
from jaxspec.device_bench.shapes import Add, random_model
from jaxspec.kv_cache import causal_mask, init_cache
from jaxspec.layers import EXACT_ROUNDING, OutIn, PlainProducts, dense
from jaxspec.llama import forward

COMPILES = {"xla defaults": None, "exact rounding": EXACT_ROUNDING}


def run_compiled(fn, args, options):
    return jax.jit(fn).lower(*args).compile(options)(*args)


def compare(add: Add, what: str, label: str, n: int, among, alone, error=None) -> None:
    among, alone = np.asarray(among, np.float32), np.asarray(alone, np.float32)
    row = {
        "what": what,
        "compile": label,
        "rows": n,
        "row0_max_diff": float(np.max(np.abs(among - alone))),
        "row0_same_bits": bool(np.array_equal(among, alone)),
    }
    add(row if error is None else {**row, "error_vs_float64": error})


def product_rows(add: Add, dim: int, out: int, rows: tuple[int, ...]) -> None:
    """x [n,dim] float32 times a bfloat16 w [dim,out]: row 0 among n rows vs alone, and the
    largest error relative to the largest float64 product."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((max(rows), dim)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((dim, out)) / np.sqrt(dim), jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    for label, options in COMPILES.items():
        alone = run_compiled(dense, (x[:1], w), options)
        for n in rows:
            got = np.asarray(run_compiled(dense, (x[:n], w), options), np.float64)
            error = float(np.max(np.abs(got - exact[:n])) / np.max(np.abs(exact[:n])))
            compare(add, "products", label, n, got[:1], alone, error)


def product_times(add: Add, dim: int, out: int, rows: tuple[int, ...], repeats: int) -> None:
    """Microseconds per product of x [n,dim] float32 and a bfloat16 weight stored [out,in]
    (as decoding keeps it), compiled with exact rounding: the three-pass split and one
    pass. `repeats` products of different x run in one program (a loop: no dispatch cost
    in the time, no product merged with another)."""
    rng = np.random.default_rng(2)
    w = OutIn(jnp.asarray(rng.standard_normal((out, dim)) / np.sqrt(dim), jnp.bfloat16))

    def products(xs, weight):  # xs [repeats,n,dim] -> [repeats,n,out]
        return jax.lax.map(lambda x: dense(x, weight), xs)

    for how, weight in (("exact split", w), ("one pass", PlainProducts(w))):
        for n in rows:
            xs = jnp.asarray(rng.standard_normal((repeats, n, dim)), jnp.float32)
            compiled = jax.jit(products).lower(xs, weight).compile(EXACT_ROUNDING)
            jax.block_until_ready(compiled(xs, weight))  # warm up
            start = time.perf_counter()
            jax.block_until_ready(compiled(xs, weight))
            seconds = (time.perf_counter() - start) / repeats
            add({"what": "product time", "compile": f"exact rounding, {how}", "rows": n,
                 "us_per_product": seconds * 1e6})  # fmt: skip


def model_rows(add: Add, cfg: LlamaConfig, context: int, rows: tuple[int, ...]) -> None:
    """A 2-layer model of cfg's shapes (random bfloat16 weights) after `context` cached
    tokens: the logits of the first new token when n tokens (a chain) are computed."""
    cfg = dataclasses.replace(cfg, n_layers=2)
    params = random_model(cfg, jnp.bfloat16)
    S = context + max(rows)
    cache = init_cache(cfg, 1, S)
    rng = np.random.default_rng(1)

    def filled(buffer):  # [1,K,S,H] random keys/values in the first `context` slots
        return jnp.asarray(rng.standard_normal(buffer.shape) * 0.5, buffer.dtype)

    cache = cache.replace(
        keys=tuple(map(filled, cache.keys)),
        values=tuple(map(filled, cache.values)),
        lengths=jnp.full((1,), context, jnp.int32),
    )
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, max(rows))), jnp.int32)

    def logits(params, tokens, cache):  # weights an argument: captured, they would be
        T = tokens.shape[1]  # constants of the program (slow to compile)
        positions = context + jnp.arange(T)[None]
        return forward(params, cfg, tokens, positions, cache, causal_mask(1, T))[0][:, 0]

    for label, options in COMPILES.items():
        alone = run_compiled(logits, (params, tokens[:, :1], cache), options)
        for n in rows:
            among = run_compiled(logits, (params, tokens[:, :n], cache), options)
            compare(add, "2-layer model", label, n, among, alone)
