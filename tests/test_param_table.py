"""The parameter table is the one layout: init_params, checkpoint.expected_shapes,
LlamaConfig.n_params and the logical axes all agree with it (issue 28)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from jaxspec import param_table
from jaxspec.checkpoint import expected_shapes, flatten_params
from jaxspec.config import LlamaConfig
from jaxspec.llama import LINEAR_NAMES, init_params


def tiny(n_kv_heads: int, tie: bool) -> LlamaConfig:
    """Prime-ish sizes, and head_dim * n_heads != dim, so no two axes share a size."""
    return LlamaConfig(
        vocab_size=97,
        dim=44,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        head_dim=14,
        ffn_dim=76,
        tie_embeddings=tie,
        name="tiny-table",
    )


CONFIGS = [
    *(
        pytest.param(tiny(kv, tie), id=f"kv{kv}-{'tied' if tie else 'untied'}")
        for kv in (1, 2, 4)
        for tie in (False, True)
    ),
    pytest.param(
        dataclasses.replace(tiny(2, False), qkv_bias=True, qk_norm=True), id="kv2-biases-qk-norms"
    ),
]


def is_axes(x) -> bool:
    return isinstance(x, tuple)


def abstract_params(cfg: LlamaConfig):
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_table_shapes_are_init_params_shapes(cfg):
    params = abstract_params(cfg)
    assert param_table.param_shapes(cfg) == jax.tree.map(lambda a: a.shape, params)
    assert ("lm_head" in params) == (not cfg.tie_embeddings)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_expected_shapes_are_flattened_init_params(cfg):
    flat = flatten_params(abstract_params(cfg))
    assert expected_shapes(cfg) == {name: a.shape for name, a in flat.items()}


@pytest.mark.parametrize("cfg", CONFIGS)
def test_n_params_counts_init_params(cfg):
    leaves = jax.tree.leaves(abstract_params(cfg))
    assert cfg.n_params == sum(math.prod(a.shape) for a in leaves)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_logical_axes_match_params(cfg):
    params = abstract_params(cfg)
    axes = param_table.logical_axes(cfg)
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(params)
    sizes: dict[str, set[int]] = {}

    def check(a, names):
        assert len(names) == a.ndim, names
        assert set(names) <= set(param_table.AXES), names
        for name, size in zip(names, a.shape, strict=True):
            sizes.setdefault(name, set()).add(size)

    jax.tree.map(check, params, axes)
    # Each logical axis has one size across the model (what sharding by it needs).
    H = cfg.head_dim
    assert sizes == {
        "vocab": {cfg.vocab_size},
        "embed": {cfg.dim},
        "heads": {cfg.n_heads * H},
        "kv_heads": {cfg.n_kv_heads * H},
        "mlp": {cfg.ffn_dim},
        **({"head_dim": {H}} if cfg.qk_norm else {}),
    }


def test_table_is_well_formed():
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    assert set(param_table.LETTERS) <= fields
    names = [(p.per_layer, p.name) for p in param_table.TABLE]
    assert len(set(names)) == len(names)
    for p in param_table.TABLE:
        assert len(p.dims) == len(p.axes), p.name
        assert all(f in param_table.LETTERS for d in p.dims for f in d.split("*")), p.name
        assert p.init in ("normal", "ones", "zeros"), p.name
        for flag in (p.absent_if, p.present_if):
            assert flag is None or flag in fields, p.name
        assert p.init == "normal" or len(p.dims) == 1, p.name  # norms and biases are vectors
    per_layer_weights = [p.name for p in param_table.TABLE if p.per_layer and p.init == "normal"]
    assert per_layer_weights == list(LINEAR_NAMES)


def test_docstring_is_rendered_from_the_table():
    doc = param_table.__doc__
    assert doc.endswith(param_table.layout() + "\n")
    for p in param_table.TABLE:
        assert f'"{p.name}": [' in doc, p.name
    assert '"q_proj": [D, N*H],' in doc
    assert "absent when tie_embeddings" in doc and "only when qk_norm" in doc


def test_tying_keeps_the_other_weights_draws():
    untied = init_params(tiny(2, False), jax.random.key(3))
    tied = init_params(tiny(2, True), jax.random.key(3))
    del untied["lm_head"]
    assert jax.tree.structure(untied) == jax.tree.structure(tied)
    for a, b in zip(jax.tree.leaves(untied), jax.tree.leaves(tied), strict=True):
        np.testing.assert_array_equal(a, b)
