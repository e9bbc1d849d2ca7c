"""Decode, verify and prefill at a model's shapes with random weights made on the device
(speed does not depend on their values): an AR step against the bandwidth floor, a verify
step over trees of 1..64 nodes against the AR step, and a prompt's prefill.

A step is timed as `infer.roofline` does: steps dispatched back to back (no host round trip
per token), each a full `decode.speculative_step` (the tree's forward against the cache,
greedy acceptance, Medusa heads drafting the next candidates) and the `commit` of the
accepted path. Weights bfloat16, activations and the cache float32, as generation runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig
from jaxspec.decode import (
    SpeculativeGenerator,
    available_bytes,
    default_products,
    speculative_step,
)
from jaxspec.device_bench.device import floor_ms
from jaxspec.drafters.base import NoDrafter
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import commit, init_cache
from jaxspec.layers import EXACT_ROUNDING
from jaxspec.llama import compute_params, init_params, plain_products
from jaxspec.sampling import Sampling
from jaxspec.tree import TreeSpec, tree_preset

# The verify trees by node count (root included): chains where a tree that small is one,
# then the presets searched from typical Medusa head accuracies (`tree.PRESETS`; 64 nodes
# is Medusa's mc_sim_7b_63 class: 63 drafted nodes, depth 4).
VERIFY_TREES = {
    1: "ar",
    2: "chain-1",
    4: "chain-3",
    8: "cpu-8",
    16: "cpu-16",
    32: "gpu-32",
    64: "gpu-63",
}
CACHE_ITEMSIZE = 4  # the KV cache is float32

Add = Callable[[dict], None]


def verify_tree(nodes: int) -> TreeSpec:
    name = VERIFY_TREES[nodes]
    return TreeSpec(()) if name == "ar" else tree_preset(name)


def wide_slice(
    base: LlamaConfig, dim: int, heads: int, kv_heads: int, ffn: int, layers: int, name: str
) -> LlamaConfig:
    """`base` (vocabulary, RoPE) with another model's layer shapes and `layers` of them."""
    return dataclasses.replace(
        base,
        dim=dim,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=ffn,
        head_dim=0,
        n_layers=layers,
        name=name,
    )


def random_model(cfg: LlamaConfig, dtype, seed: int = 0) -> dict:
    """Random params at cfg's shapes in `dtype`, made on the default device, ready to compute."""
    params = compute_params(init_params(cfg, jax.random.key(seed), dtype), dtype)
    jax.block_until_ready(params)
    return params


def weight_bytes(cfg: LlamaConfig, dtype) -> int:
    return cfg.n_params * jnp.dtype(dtype).itemsize


def cache_bytes(cfg: LlamaConfig, batch: int, tokens: float) -> float:
    """Bytes of keys and values of `tokens` positions for `batch` rows (all layers)."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * batch * CACHE_ITEMSIZE


def time_steps(cfg, params, dtype, tree: TreeSpec, batch: int, context: int, steps: int) -> dict:
    """One decode step with `tree` (the empty tree: an AR step) after `context` tokens,
    batch rows -> {"ms_per_step", "first_s": compile and 3 warm-up steps}."""
    if tree.n_nodes == 1:
        drafter, drafter_params = NoDrafter(), None
    else:
        drafter = MedusaDrafter(cfg, n_heads=tree.max_depth)
        drafter_params = compute_params(drafter.init(params), dtype)
    # Room for every step to accept the whole depth, the warm-up's included.
    S = context + (steps + 4) * (tree.max_depth + 1)
    cache = init_cache(cfg, batch, S).replace(lengths=jnp.full((batch,), context, jnp.int32))
    token, key = jnp.zeros((batch,), jnp.int32), jax.random.key(0)
    candidates = jnp.zeros((batch, tree.n_nodes - 1), jnp.int32)
    state = drafter.init_state(cfg, batch, S, jnp.float32, drafter_params)
    static = dict(cfg=cfg, sampling=Sampling(), tree=tree, drafter=drafter)

    def run(n, cache, token, candidates, state):
        for _ in range(n):
            _, n_emitted, token, candidates, block, state = step(
                params, drafter_params, cache, token, candidates, key, state
            )
            cache = commit(cache, block, n_emitted)
        jax.block_until_ready(token)
        return cache, token, candidates, state

    start = time.perf_counter()
    step = speculative_step.lower(
        params, drafter_params, cache, token, candidates, key, state, **static
    ).compile(EXACT_ROUNDING)  # as SpeculativeGenerator compiles it
    carry = run(3, cache, token, candidates, state)  # warm up
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    run(steps, *carry)
    return {"ms_per_step": (time.perf_counter() - start) / steps * 1e3, "first_s": first_s}


def ar_rows(add: Add, cfg, params, dtype, batches, context: int, steps: int, gbs,
            products=("exact", "plain")) -> None:  # fmt: skip
    """AR decode per batch size and products (decode.PRODUCTS: what the three-pass exact
    split costs a step) against the floor: every weight and each row's live cache
    (context plus half the timed steps, on average) read once per step."""
    for batch, how in itertools.product(batches, products):
        weights = plain_products(params) if how == "plain" else params
        timed = time_steps(cfg, weights, dtype, TreeSpec(()), batch, context, steps)
        ms = timed["ms_per_step"]
        floor = floor_ms(
            weight_bytes(cfg, dtype) + cache_bytes(cfg, batch, context + steps / 2), gbs
        )
        add(
            {
                "batch": batch,
                "products": how,
                "context": context,
                "ms_per_step": ms,
                "ms_per_token": ms,  # each row's: a step gives every row one token
                "tokens_per_s": batch * 1e3 / ms,
                "floor_ms": floor,
                "fraction_of_floor": None if floor is None else floor / ms,
                "first_s": timed["first_s"],
            }
        )


def verify_rows(add: Add, cfg, params, dtype, nodes, context: int, steps: int) -> None:
    """A verify step per tree size (batch 1), each over the 1-node (AR) step measured first."""
    ar_ms = None
    for n in sorted(nodes):
        tree = verify_tree(n)
        timed = time_steps(cfg, params, dtype, tree, 1, context, steps)
        if n == 1:
            ar_ms = timed["ms_per_step"]
        add(
            {
                "nodes": tree.n_nodes,
                "tree": VERIFY_TREES[n],
                "depth": tree.max_depth,
                "ms_per_step": timed["ms_per_step"],
                "over_ar_step": None if ar_ms is None else timed["ms_per_step"] / ar_ms,
                "first_s": timed["first_s"],
            }
        )


def fits(cfg: LlamaConfig, dtype, headroom: float = 1.5) -> tuple[bool, str]:
    """Whether cfg's weights (times headroom, for the steps' buffers) fit in what the device
    has free -> (fits, the numbers)."""
    need = weight_bytes(cfg, dtype) * headroom
    have, where = available_bytes()
    return need <= have, f"needs ~{need / 1e9:.1f} GB, {have / 1e9:.1f} GB free ({where})"


def is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return (
        "RESOURCE_EXHAUSTED" in text
        or "out of memory" in text.lower()
        or (isinstance(e, JaxspecError) and "more than the" in text and "available" in text)
    )


def prefill_rows(add: Add, cfg, params, sizes, products=("exact", "plain-prefill"),
                 chunks=None, repeats: int = 2) -> None:  # fmt: skip
    """Prefill of a prompt of each size through `SpeculativeGenerator.generate` (one new
    token: the prefill and its commit, chunked as the generator chunks long prompts), with
    each way of multiplying bfloat16 weights (decode.PRODUCTS); the fastest of `repeats`
    warm runs. Then chunks = (a size, chunk sizes): that prompt in each chunk size, with
    the backend's default products (which chunk this platform should take). A size that
    does not fit in memory is a skipped row, and so is every larger one."""
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, cfg.vocab_size, n).tolist() for n in sorted(sizes)}
    too_big = None
    for n, prompt in prompts.items():
        for how in products:
            if too_big is None:
                too_big = _prefill_row(add, cfg, params, prompt, how, None, repeats)
            else:
                add({"tokens": n, "products": how,
                     "skipped": f"a {too_big}-token prompt did not fit already"})  # fmt: skip
    n, chunk_sizes = chunks or (None, ())
    for chunk in chunk_sizes if too_big is None or n < too_big else ():
        _prefill_row(add, cfg, params, prompts[n], default_products(), chunk, repeats)


def _prefill_row(add: Add, cfg, params, prompt, how: str, chunk: int | None, repeats: int):
    """One prefill row (chunk None: the generator's default) -> None, or the prompt's
    length when it did not fit (the row says so)."""
    n = len(prompt)
    # Timing only (random weights): a prompt past the shapes' context (Llama-3-8B's 8192;
    # 3.1's 128k) costs what it would at a longer-context model's.
    cfg = dataclasses.replace(cfg, max_position=max(cfg.max_position, n + 8))
    generator = SpeculativeGenerator(cfg, params, max_len=n + 8, products=how, prefill_chunk=chunk)
    row = {"tokens": n, "products": how, "chunk": generator.prefill_chunk}
    try:
        runs = [generator.generate(prompt, 1) for _ in range(repeats)]
    except Exception as e:  # noqa: BLE001 - out of memory is a result, anything else not
        if not is_out_of_memory(e):
            raise
        add({**row, "skipped": "out of memory: " + " ".join(str(e).split())[:240]})
        return n
    finally:
        del generator
    ms = min(r.prefill_s for r in runs) * 1e3
    add({**row, "ms": ms, "tokens_per_s": n / ms * 1e3,
         "first_s": runs[0].compile_s + runs[0].prefill_s,
         "first_token": runs[0].token_ids[0]})  # fmt: skip
    return None
