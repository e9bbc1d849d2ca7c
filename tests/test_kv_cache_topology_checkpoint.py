"""A bfloat16 cache, a long prompt's block reads, retrieved chains with unknown tokens or
shared prefixes, and the checkpoint loader's refusals and their messages."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_params,
    save_checkpoint,
    shape_problems,
)
from jaxspec.config import preset
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import KVBlock, causal_mask, commit, init_cache, prompt_reads
from jaxspec.llama import forward as eager_forward
from jaxspec.llama import init_params
from jaxspec.topology import Retrieved, select_nodes
from jaxspec.tree import DynamicTree
from tests.test_dynamic_tree import chosen_paths

forward = jax.jit(eager_forward, static_argnums=1)


def test_commit_casts_the_block_to_a_bfloat16_cache():
    cfg = preset("tiny-mqa")
    cache = init_cache(cfg, 1, 4, jnp.bfloat16)
    new = jnp.full((1, cfg.n_kv_heads, 2, cfg.head_dim), 1.0 + 2.0**-10, jnp.float32)
    block = KVBlock((new,) * cfg.n_layers, (-new,) * cfg.n_layers)
    cache = commit(cache, block, jnp.array([2], jnp.int32))
    assert cache.keys[0].dtype == jnp.bfloat16 and cache.values[-1].dtype == jnp.bfloat16
    keys = np.asarray(cache.keys[0].astype(jnp.float32))[0, 0, :, 0]
    np.testing.assert_array_equal(keys, [1.0, 1.0, 0.0, 0.0])  # 1 + 2^-10 rounds to 1


def test_a_prompts_block_reads_never_touch_slots_past_the_longest_row():
    """prompt_reads: a chunk's forward reads the cache in blocks up to the rows' lengths,
    so NaN in slots past them changes nothing (a whole-buffer masked read gives NaN)."""
    cfg = preset("tiny-mqa")
    params = init_params(cfg, jax.random.key(0), scale=0.2)
    tokens, positions = jnp.array([[3, 1, 4]]), jnp.array([[5, 6, 7]])
    filled = jax.random.normal(jax.random.key(1), (1, cfg.n_kv_heads, 16, cfg.head_dim))
    cache = init_cache(cfg, 1, 16).replace(
        keys=(filled,) * cfg.n_layers, values=(-filled,) * cfg.n_layers, lengths=jnp.array([5])
    )
    clean, _, _ = forward(params, cfg, tokens, positions, cache, causal_mask(1, 3))
    dirty = cache.replace(
        keys=tuple(k.at[:, :, 8:].set(jnp.nan) for k in cache.keys),
        values=tuple(v.at[:, :, 8:].set(jnp.nan) for v in cache.values),
    )
    got, _, _ = forward(params, cfg, tokens, positions, prompt_reads(dirty, 4), causal_mask(1, 3))
    np.testing.assert_allclose(got, clean, rtol=1e-5, atol=1e-5)


def test_a_chain_node_past_an_unknown_token_is_never_chosen():
    """Chain 1, ?, 2 certain of itself (score 0): only its node 1 is known; the drafter's
    top-1 chain 0 -> 0 fills the other places, never an orphaned node 2."""
    logits = jnp.zeros((1, 3, 4)).at[:, :, 0].set(2.0)  # top-1 guess 0 at every depth
    chains = jnp.array([[[1, -1, 2]]])
    draft = select_nodes(logits, DynamicTree(4, 3, 1), Retrieved(chains, jnp.zeros((1, 1, 3))))
    assert sorted(chosen_paths(draft, 0)) == [(0,), (0, 0), (1,)]


def test_chains_sharing_a_prefix_share_its_node():
    """Chains 1 -> 2 and 1 -> 3, both certain: one node 1 with two children."""
    logits = jnp.zeros((1, 2, 4)).at[:, :, 0].set(2.0).at[:, :, 3].set(1.0)  # guesses 0, 3
    chains = Retrieved(jnp.array([[[1, 2], [1, 3]]]), jnp.zeros((1, 2, 2)))
    draft = select_nodes(logits, DynamicTree(4, 2, 2), chains)
    assert sorted(chosen_paths(draft, 0)) == [(1,), (1, 2), (1, 3)]


def test_shape_problems_show_the_first_ones_and_count_the_rest():
    want = {f"w{i}": (2,) for i in range(5)}
    assert shape_problems(want, {"w0": (2,), "w1": (3,), "x": (1,)}, 5) == (
        "missing w2; missing w3; missing w4; unexpected x; w1 has shape (3,), expected (2,)"
    )
    assert shape_problems(want, {}, 3) == "missing w0; missing w1; missing w2; ... 2 more"
    assert shape_problems(want, {}, 5).count("missing") == 5
    assert "more" not in shape_problems(want, {}, 5)


@pytest.fixture
def tiny_saved(tmp_path):
    cfg = preset("tiny-gqa")  # 3 layers
    save_checkpoint(tmp_path, cfg, init_params(cfg, jax.random.key(0)))
    return cfg, tmp_path


@pytest.mark.parametrize(
    "n_layers, dropped, held",
    [(2, None, "0..2"), (4, None, "0..2"), (3, "layers.1.", r"[0, 2]")],
)
def test_a_layer_count_other_than_the_weights_is_named(tiny_saved, n_layers, dropped, held):
    cfg, folder = tiny_saved
    if dropped:
        flat = load_file(folder / WEIGHTS_FILE)
        save_file({k: v for k, v in flat.items() if not k.startswith(dropped)},
                  folder / WEIGHTS_FILE)  # fmt: skip
    message = f"holds layers {held} but {folder / CONFIG_FILE} says n_layers={n_layers}"
    with pytest.raises(JaxspecError, match=re.escape(message)):
        load_params(folder, dataclasses.replace(cfg, n_layers=n_layers), on_host=True)


def test_a_misshapen_checkpoint_is_refused_on_load(tiny_saved):
    cfg, folder = tiny_saved
    other = dataclasses.replace(cfg, ffn_dim=cfg.ffn_dim + 1)
    with pytest.raises(JaxspecError, match=r"gate_proj has shape \(64, 88\), expected \(64, 89\)"):
        load_params(folder, other, on_host=True)
