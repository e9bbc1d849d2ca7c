"""Tree specs from names and measured accuracy: what dynamic trees accept, and reach
probabilities for trees deeper or wider than the accuracy measured."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.tree import DynamicTree, TreeSpec, reach_probability, tree_preset


def test_a_tree_past_the_measured_accuracy_reaches_nothing_there():
    """Nodes deeper or of higher rank than the accuracy measured are never reached (and
    neither are their children); the others multiply their path's per-rank accuracies."""
    tree = TreeSpec.from_paths([(0,), (1,), (2,), (0, 0), (0, 0, 0)])
    cumulative = [[0.5, 0.7], [0.4, 0.6]]  # depth 1 and 2, top-1 and top-2
    reach = reach_probability(tree, cumulative)
    np.testing.assert_allclose(reach, [1, 0.5, 0.2, 0, 0.5 * 0.4, 0])


def test_a_dynamic_tree_keeps_its_own_depth_and_needs_two_nodes():
    assert tree_preset("dynamic-16-3-5").at_depth(4).max_depth == 3
    assert tree_preset("dynamic-2").n_nodes == 2  # the root and one drafted node
    with pytest.raises(JaxspecError, match="needs 2 nodes or more"):
        tree_preset("dynamic-1")
    with pytest.raises(JaxspecError, match="needs 2 nodes or more"):
        DynamicTree(8, width=0)
