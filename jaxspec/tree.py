"""Draft trees: static ones (a hashable spec built from paths, and its numpy constants) and
dynamic ones (DynamicTree: a node budget; jaxspec.topology chooses the nodes each step).

A path is a tuple of top-k ranks, one per depth: (0,) is the drafter's best guess for the
next token, (0, 1) the second guess for the token after it, under (0,). Node 0 is the
root: the newest token, already chosen but not yet in the cache. Example, paths
[(0,), (1,), (0, 0)] give nodes 0 root, 1 = (0,), 2 = (1,), 3 = (0, 0) and

    mask (node attends to)     depth   parent   retrieve (root-to-leaf paths, -1 pads)
    1 0 0 0                    0       -1       [0, 1, 3]
    1 1 0 0                    1        0       [0, 2, -1]
    1 0 1 0                    1        0
    1 1 0 1                    2        1
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Sequence
from functools import cached_property

import numpy as np

from jaxspec.errors import JaxspecError, is_whole

MAX_DEPTH = 1024  # deeper than any drafter drafts; a chain's paths grow as depth squared


def check_depth(depth: int, name: str) -> None:
    """Refuse a tree that is not 1 to MAX_DEPTH deep before its paths are built."""
    if not is_whole(depth) or depth < 1:
        raise JaxspecError(f"tree {name}: its depth must be an integer >= 1, got {depth!r}")
    if depth > MAX_DEPTH:
        raise JaxspecError(
            f"tree {name} is {depth} tokens deep; trees go at most {MAX_DEPTH} deep (no "
            "drafter drafts further): pick a shallower one"
        )


def _path(path) -> tuple[int, ...]:
    """One path as a tuple of Python ints, else a one-line error."""
    ranks = path.tolist() if isinstance(path, np.ndarray) else path
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise JaxspecError(f"invalid tree: a path is a sequence of ranks, got {path!r}")
    if ranks and all(type(r) is int and r >= 0 for r in ranks):  # the usual case, fast
        return tuple(ranks)
    if not ranks or not all(is_whole(r) and r >= 0 for r in ranks):
        raise JaxspecError(
            f"invalid tree: path {tuple(ranks)} must be a non-empty sequence of integer ranks >= 0"
        )
    return tuple(int(r) for r in ranks)


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A static tree from its paths (lists or tuples, in any order; each path's parent
    must be in the tree too), kept sorted by (depth, ranks). TreeSpec(()) is plain AR's
    empty tree."""

    paths: tuple[tuple[int, ...], ...]  # sorted by (depth, ranks); the root is implicit
    name: str = dataclasses.field(default="", compare=False)  # a preset's; not in hash/eq

    def __post_init__(self):
        given = self.paths
        if isinstance(given, (str, bytes)) or not isinstance(given, (Sequence, np.ndarray)):
            raise JaxspecError(f"invalid tree: paths are a sequence of paths, got {given!r}")
        given = [_path(p) for p in given]
        normal = sorted(set(given), key=lambda p: (len(p), p))
        if len(normal) != len(given):
            raise JaxspecError("invalid tree: a path is listed twice")
        present = set(normal)
        for p in normal:
            if len(p) > 1 and p[:-1] not in present:
                raise JaxspecError(f"invalid tree: path {p} has no parent {p[:-1]} in the tree")
        object.__setattr__(self, "paths", tuple(normal))

    @classmethod
    def chain(cls, depth: int, name: str = "") -> TreeSpec:
        """Top-1 guesses only: a chain of `depth` drafted tokens."""
        check_depth(depth, f"chain-{depth}")
        return cls([(0,) * d for d in range(1, depth + 1)], name)

    @classmethod
    def comb(cls, depth: int, width: int, name: str = "") -> TreeSpec:
        """The top-1 chain of `depth` tokens with the rank 1..width-1 alternatives of every
        depth hanging off it (SDSAT's sampling trees: top-`width` per position)."""
        check_depth(depth, f"comb-{depth}-{width}")
        if not is_whole(width) or width < 1:
            raise JaxspecError(f"tree comb-{depth}-{width}: its width must be an integer >= 1")
        return cls([(0,) * d + (r,) for d in range(depth) for r in range(width)], name)

    @property
    def n_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def width(self) -> int:
        """The top-k the tree takes from a distribution of guesses: its largest rank + 1."""
        return int(self.rank.max()) + 1

    @property
    def label(self) -> str:
        """How messages name the tree: `tree NAME (T nodes)`, `a T-node tree` unnamed."""
        if not self.paths:
            return "the empty tree (AR)"
        if self.name:
            return f"tree {self.name} ({self.n_nodes} nodes)"
        return f"a {self.n_nodes}-node tree"

    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @cached_property
    def depth(self) -> np.ndarray:
        """[T] depth of each node (root 0)."""
        return np.array([0] + [len(p) for p in self.paths], np.int32)

    @cached_property
    def rank(self) -> np.ndarray:
        """[T] top-k rank of each node among its depth's guesses (root 0)."""
        return np.array([0] + [p[-1] for p in self.paths], np.int32)

    @cached_property
    def parent(self) -> np.ndarray:
        """[T] parent node index (root -1)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return np.array([-1] + [index.get(p[:-1], 0) for p in self.paths], np.int32)

    @cached_property
    def mask(self) -> np.ndarray:
        """[T,T] bool: node i attends to node j iff j is i or an ancestor of i."""
        T = self.n_nodes
        mask = np.eye(T, dtype=bool)
        for i in range(1, T):
            mask[i] |= mask[self.parent[i]]
        return mask

    @cached_property
    def retrieve(self) -> np.ndarray:
        """[P, max_depth + 1] node indices of each root-to-leaf path, padded with -1."""
        leaves = [i for i in range(self.n_nodes) if i not in set(self.parent.tolist())]
        out = np.full((len(leaves), self.max_depth + 1), -1, np.int32)
        for row, leaf in enumerate(leaves):
            chain = [leaf]
            while chain[-1] != 0:
                chain.append(int(self.parent[chain[-1]]))
            out[row, : len(chain)] = chain[::-1]
        return out

    @cached_property
    def children(self) -> np.ndarray:
        """[T, C] child node indices in rank order, padded with -1 (C = most children)."""
        kids = [[] for _ in range(self.n_nodes)]
        for i in range(1, self.n_nodes):
            kids[self.parent[i]].append(i)
        width = max(1, max(len(k) for k in kids))
        out = np.full((self.n_nodes, width), -1, np.int32)
        for i, k in enumerate(kids):
            k.sort(key=lambda n: self.rank[n])
            out[i, : len(k)] = k
        return out


def search_tree(accuracy: np.ndarray, n_nodes: int) -> TreeSpec:
    """The tree of `n_nodes` (root included) that maximises the expected accepted length.

    accuracy [depth, k]: measured probability that a drafter's rank-r guess at depth d is
    the right token (FIRP §3.4 / Medusa's tree search). A path is accepted with the
    product of its nodes' accuracies, and the expected accepted length is the sum of
    those products over all nodes; since a child's value never exceeds its parent's,
    taking the best frontier node each time gives the optimal tree.
    """
    accuracy = np.asarray(accuracy, np.float64)
    depth_max, k = accuracy.shape
    frontier = [(-accuracy[0, r], (r,)) for r in range(k)]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < n_nodes - 1:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth_max:
            for r in range(k):
                heapq.heappush(frontier, (neg_value * accuracy[len(path), r], path + (r,)))
    return TreeSpec(chosen)


def per_rank_accuracy(topk_accuracy) -> np.ndarray:
    """Cumulative top-1..k accuracy per depth [depth, k] -> the probability that the rank-r
    guess itself is right [depth, k]."""
    cumulative = np.asarray(topk_accuracy, np.float64)
    return np.diff(cumulative, axis=1, prepend=0.0).clip(0.0, 1.0)


def reach_probability(tree: TreeSpec, topk_accuracy) -> np.ndarray:
    """[T] probability that a step accepts each node, from measured cumulative top-1..k
    accuracy per depth [depth, k] under search_tree's independence assumption: the product
    of its path's per-rank accuracies (the root: 1)."""
    per_rank = per_rank_accuracy(topk_accuracy)
    reach = np.ones(tree.n_nodes)
    for i in range(1, tree.n_nodes):  # parents come before their children
        d, r = tree.depth[i] - 1, tree.rank[i]
        known = d < per_rank.shape[0] and r < per_rank.shape[1]
        reach[i] = reach[tree.parent[i]] * (per_rank[d, r] if known else 0.0)
    return reach


def expected_tokens_per_step(tree: TreeSpec, topk_accuracy) -> float:
    """Accepted drafted tokens plus the bonus token a step is expected to emit: the sum of
    reach_probability (the root counting for the bonus token)."""
    return float(reach_probability(tree, topk_accuracy).sum())


def last_accepted_probability(tree: TreeSpec, topk_accuracy) -> np.ndarray:
    """[T] probability that each node ends a step as the last accepted one
    (reach_probability's assumption): it is reached and none of its children is."""
    reach = reach_probability(tree, topk_accuracy)
    last = reach.copy()
    for i in range(1, tree.n_nodes):
        last[tree.parent[i]] -= reach[i]
    return last


def searched_trees(topk_accuracy, sizes=(8, 16, 32, 64)) -> dict[str, list[list[int]]]:
    """Trees searched from measured cumulative top-1..k accuracy per head [depth, k]:
    {"searched-N": paths} for each size N (nodes, root included)."""
    per_rank = per_rank_accuracy(topk_accuracy)
    return {f"searched-{n}": [list(p) for p in search_tree(per_rank, n).paths] for n in sizes}


# Presets. CPU trees are small (a CPU verify step's cost grows fast with its nodes);
# the GPU tree has the size and shape class of Medusa's mc_sim_7b_63 (63 nodes, depth 4,
# top-10 per head), here searched from typical Medusa head accuracies.
_TYPICAL_ACCURACY = np.array(
    [
        [0.60, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.012, 0.01, 0.008],
        [0.40, 0.10, 0.05, 0.03, 0.02, 0.015, 0.012, 0.01, 0.008, 0.006],
        [0.30, 0.08, 0.04, 0.025, 0.018, 0.012, 0.01, 0.008, 0.006, 0.005],
        [0.25, 0.07, 0.035, 0.02, 0.015, 0.01, 0.008, 0.006, 0.005, 0.004],
    ]
)
PRESETS = {
    "chain-1": TreeSpec.chain(1),
    "chain-2": TreeSpec.chain(2),
    "chain-4": TreeSpec.chain(4),
    "cpu-8": search_tree(_TYPICAL_ACCURACY, 8),
    "cpu-16": search_tree(_TYPICAL_ACCURACY, 16),
    "cpu-24": search_tree(_TYPICAL_ACCURACY, 24),
    "gpu-32": search_tree(_TYPICAL_ACCURACY, 32),
    "gpu-63": search_tree(_TYPICAL_ACCURACY, 64),  # 63 drafted nodes + the root
}


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A tree chosen at every step, on device: `nodes` nodes counting the root (as a
    static tree's name counts them: dynamic-8 verifies as many rows as searched-8), the
    others the drafted nodes of highest path probability (jaxspec.topology.select_nodes)
    among the drafter's top-`width` guesses up to `depth`. Its shapes are static (one
    compiled program), its topology is data. `depth` 0: as deep as the drafter drafts
    (Drafter.draft_depth, set when it is chosen)."""

    nodes: int
    depth: int = 0
    width: int = 8
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        sizes = (self.nodes, self.depth, self.width)
        if not all(map(is_whole, sizes)) or self.nodes < 2 or self.depth < 0 or self.width < 1:
            raise JaxspecError(
                f"invalid {self.label}: nodes must be a whole number >= 2, depth >= 0 (0: the "
                f"drafter's) and width (guesses a node) >= 1; got nodes={self.nodes!r}, "
                f"depth={self.depth!r}, width={self.width!r}"
            )
        for field, size in zip(("nodes", "depth", "width"), sizes, strict=True):
            object.__setattr__(self, field, int(size))  # numpy's as Python's
        reachable = sum(self.width**d for d in range(1, self.depth + 1))
        if self.depth and reachable < self.nodes - 1:
            raise JaxspecError(
                f"{self.label} has only {reachable} nodes within depth {self.depth} at "
                f"{self.width} guesses a node; take fewer nodes or more guesses "
                "(dynamic-N-DEPTH-WIDTH)"
            )

    @property
    def n_nodes(self) -> int:
        return self.nodes

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def label(self) -> str:
        return f"tree {self.name or f'dynamic-{self.nodes}'} ({self.nodes} nodes, dynamic)"

    def at_depth(self, depth: int) -> DynamicTree:
        """This tree with its depth, when unset, set to the drafter's `depth`."""
        return self if self.depth else dataclasses.replace(self, depth=depth)


def tree_preset(name: str) -> TreeSpec | DynamicTree:
    """A preset, `chain-N` (1 <= N <= MAX_DEPTH), `comb-N-W` (TreeSpec.comb(N, W)) or `dynamic-N`
    (DynamicTree: N nodes with the root; `dynamic-N-D-W` sets its depth and guesses a node),
    named `name`."""
    if not isinstance(name, str):
        raise JaxspecError(
            f"a tree is named by a string (e.g. 'chain-2', 'searched-16', 'dynamic-16'), got "
            f"{type(name).__name__}"
        )
    if m := re.fullmatch(r"dynamic-([1-9][0-9]*)(?:-([1-9][0-9]*)-([1-9][0-9]*))?", name):
        depth, width = (int(m[2]), int(m[3])) if m[2] else (0, DynamicTree.width)
        return DynamicTree(int(m[1]), depth, width, name=name)
    if name in PRESETS:
        return dataclasses.replace(PRESETS[name], name=name)
    if m := re.fullmatch(r"chain-([1-9][0-9]*)", name):
        return TreeSpec.chain(int(m[1]), name)
    if m := re.fullmatch(r"comb-([1-9][0-9]*)-([1-9][0-9]*)", name):
        return TreeSpec.comb(int(m[1]), int(m[2]), name)
    raise JaxspecError(
        f"unknown tree {name!r}; known: {', '.join(PRESETS)}, chain-N, comb-DEPTH-WIDTH, "
        "dynamic-N, dynamic-N-DEPTH-WIDTH"
    )
