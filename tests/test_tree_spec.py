"""Tree specs from names and measured accuracy: what dynamic trees accept, and reach
probabilities for trees deeper or wider than the accuracy measured; what chains of pseudo
tokens see after a prompt's last chunk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.chains import after_prompt
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import KVBlock, KVCache, causal_mask
from jaxspec.tree import DynamicTree, TreeSpec, reach_probability, tree_preset


def test_a_tree_past_the_measured_accuracy_reaches_nothing_there():
    """Nodes deeper or of higher rank than the accuracy measured are never reached (and
    neither are their children); the others multiply their path's per-rank accuracies."""
    tree = TreeSpec([(0,), (1,), (2,), (0, 0), (0, 0, 0)])
    cumulative = [[0.5, 0.7], [0.4, 0.6]]  # depth 1 and 2, top-1 and top-2
    reach = reach_probability(tree, cumulative)
    np.testing.assert_allclose(reach, [1, 0.5, 0.2, 0, 0.5 * 0.4, 0])


def test_a_dynamic_tree_keeps_its_own_depth_and_needs_two_nodes():
    assert tree_preset("dynamic-16-3-5").at_depth(4).max_depth == 3
    assert tree_preset("dynamic-2").n_nodes == 2  # the root and one drafted node
    with pytest.raises(JaxspecError, match=r"nodes must be a whole number >= 2.*got nodes=1,"):
        tree_preset("dynamic-1")
    with pytest.raises(JaxspecError, match=r"got nodes=8, depth=0, width=0"):
        DynamicTree(8, width=0)
    wide = DynamicTree(16, np.int64(30), np.int64(8))  # numpy's sizes as Python's: no overflow
    assert type(wide.width) is int and wide.max_depth == 30


def test_chains_after_a_prompt_s_last_chunk_see_what_their_anchor_sees():
    """Rows of 3 and 5 committed slots (of 6), a last chunk of 2 tokens, chains of 2 steps on
    anchors (0, 1) and (1, 0): each chain row, step-major, sees its row's committed slots
    (not the free ones) and the chunk's tokens its anchor sees."""
    slots, chunk = jnp.zeros((2, 1, 6, 1)), jnp.zeros((2, 1, 2, 1))
    cache = KVCache((slots,), (slots,), jnp.asarray([3, 5], jnp.int32))
    anchors = jnp.asarray([[0, 1], [1, 0]])
    _, _, sees = after_prompt(cache, KVBlock((chunk,), (chunk,)), causal_mask(2, 2), anchors, 2)
    first, second = [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]
    row_0 = [first + [1, 0], first + [1, 1]] * 2  # anchor 0, anchor 1; then step 2
    row_1 = [second + [1, 1], second + [1, 0]] * 2
    np.testing.assert_array_equal(sees, [row_0, row_1])
