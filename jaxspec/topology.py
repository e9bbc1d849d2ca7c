"""A draft tree's topology as arrays, per row: what verification and acceptance read.

A static tree (tree.TreeSpec) gives the same constants to every row. A dynamic tree
(tree.DynamicTree) is chosen on device at every step: its drafter scores candidate nodes
and keeps the N best by path probability (`select_nodes`), so the topology is data (a
`Draft`: tokens, parents, depths), while the node count, the depth bound and every shape
stay static: one compiled program serves every topology.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.tree import DynamicTree, TreeSpec

# Per depth (slope, shift): a drafter's guess probabilities as acceptance estimates (`calibrated`).
Calibration = tuple[tuple[float, float], ...]


@flax.struct.dataclass
class Topology:
    """Per row: depth [B,T] (root 0); mask [B,T,T] (a node sees itself and its
    ancestors); paths [B,P,D+1] (root-to-node node indices, -1 past the end); children
    [B,T,C] (each node's children, best first, -1 pads)."""

    depth: jax.Array
    mask: jax.Array
    paths: jax.Array
    children: jax.Array


@flax.struct.dataclass
class Draft:
    """A dynamic tree's drafted nodes 1..N, best first (a parent before its children):
    tokens, parent (node index, 0 the root) and depth, each [B,N]."""

    tokens: jax.Array
    parent: jax.Array
    depth: jax.Array


def static_topology(tree: TreeSpec, batch: int) -> Topology:
    """The static tree's constants for every row (its root-to-leaf paths only)."""

    def rows(x):
        return jnp.broadcast_to(jnp.asarray(x), (batch, *x.shape))

    return Topology(rows(tree.depth), rows(tree.mask), rows(tree.retrieve), rows(tree.children))


def parent_topology(parent: jax.Array, depth: jax.Array, max_depth: int, width: int):
    """parent [B,T] (the root's own 0), depth [B,T] -> Topology (a path to every node; at
    most `width` children a node)."""
    B, T = parent.shape
    up = [jnp.broadcast_to(jnp.arange(T), (B, T))]  # up[k]: each node's k-th ancestor
    for _ in range(max_depth):
        up.append(jnp.take_along_axis(parent, up[-1], axis=1))
    ancestors = jnp.stack(up, axis=-1)  # [B,T,D+1]
    mask = jnp.any(ancestors[:, :, :, None] == jnp.arange(T), axis=2)  # [B,T,T]
    level = jnp.arange(max_depth + 1)
    back = jnp.clip(depth[..., None] - level, 0, max_depth)  # the ancestor at depth `level`
    paths = jnp.where(
        level <= depth[..., None], jnp.take_along_axis(ancestors, back, axis=2), -1
    )  # [B,T,D+1]
    node = jnp.arange(T)
    is_child = (parent[:, None, :] == node[None, :, None]) & (node != 0)  # [B,n,m]
    order = jnp.cumsum(is_child, axis=-1) - 1
    slot = is_child[:, :, None, :] & (order[:, :, None, :] == jnp.arange(width)[:, None])
    children = jnp.where(slot.any(-1), jnp.argmax(slot, -1), -1)  # [B,T,C]
    return Topology(depth, mask, paths.astype(jnp.int32), children.astype(jnp.int32))


def tree_topology(current: jax.Array, candidates, tree) -> tuple[jax.Array, Topology]:
    """The root current [B] and the drafter's candidates (an array [B,T-1] for a static
    tree, a Draft for a dynamic one) -> tree tokens [B,T] and its Topology."""
    B = current.shape[0]
    if not isinstance(tree, DynamicTree):
        return jnp.concatenate([current[:, None], candidates], axis=1), static_topology(tree, B)
    zero = jnp.zeros((B, 1), jnp.int32)
    tokens = jnp.concatenate([current[:, None], candidates.tokens], axis=1)
    parent = jnp.concatenate([zero, candidates.parent], axis=1)
    depth = jnp.concatenate([zero, candidates.depth], axis=1)
    return tokens, parent_topology(parent, depth, tree.max_depth, tree.width)


@flax.struct.dataclass
class Retrieved:
    """Retrieved continuations offered to a dynamic tree: tokens [B,X,D] (-1 unknown) and
    score [B,X,D], each node's own log confidence that its path is right (from its match:
    drafters.retrieval; non-increasing along a chain; -inf: none of its own)."""

    tokens: jax.Array
    score: jax.Array


def select_nodes(logits: jax.Array, tree: DynamicTree, extra: Retrieved | None = None,
                 calibration: Calibration = ()) -> Draft:  # fmt: skip
    """Per-depth guesses logits [B,K,V] (K >= depth; guesses at depth d do not depend on
    the path, as Medusa heads' and FIRP's) -> the N nodes of highest path probability (the
    product of the drafter's probabilities along the path, each first mapped through
    `calibration` when given) among the paths of top-`width` guesses up to tree.max_depth,
    and the paths of `extra`'s chains, each scored by the higher of the drafter's path
    probability and its own confidence (merge_chains).

    Depth by depth only the N best of each depth can have chosen children, so each depth
    keeps its N best; then the N best of all are the tree (a path's probability never
    exceeds its parent's: ties go to the earlier node, parents before children, so every
    chosen node's parent is chosen)."""
    B, N, D, k = logits.shape[0], tree.n_nodes - 1, tree.max_depth, tree.width
    logits = logits[:, :D].astype(jnp.float32)
    norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [B,D,1]
    # The barrier keeps this TopK a TopK: with the later ones in the same program, XLA:CPU
    # otherwise rewrites it into a full sort of the vocabulary, far slower at V=49k.
    guess_lp, guess = map(jax.lax.optimization_barrier, jax.lax.top_k(logits, k))  # [B,D,k]
    guess_lp = calibrated(guess_lp - norm, calibration)  # log probabilities of the guesses
    score, rank = jax.lax.top_k(guess_lp[:, 0], min(N, k))  # depth 1
    token = jnp.take_along_axis(guess[:, 0], rank, axis=1)
    path = jnp.full((*token.shape, D), -1, jnp.int32).at[..., 0].set(token)  # [B,M,D]
    scores, tokens, paths = [score], [token], [path]
    parents, depths, offset = [jnp.full_like(rank, -1)], [jnp.ones_like(rank)], 0
    for d in range(1, D):
        M = score.shape[1]
        grown = (score[:, :, None] + guess_lp[:, d][:, None, :]).reshape(B, M * k)
        score, index = jax.lax.top_k(grown, min(N, M * k))
        token = jnp.take_along_axis(guess[:, d], index % k, axis=1)
        path = jnp.take_along_axis(path, (index // k)[..., None], axis=1).at[..., d].set(token)
        tokens.append(token)
        paths.append(path)
        parents.append(offset + index // k)  # into the pool
        depths.append(jnp.full_like(index, d + 1))
        scores.append(score)
        offset += M
    pool = tuple(jnp.concatenate(x, axis=1) for x in (scores, tokens, parents, depths))
    if extra is not None:
        chains = extra.tokens
        at = jnp.maximum(chains, 0).transpose(0, 2, 1)  # [B,D,X]
        lp = calibrated(jnp.take_along_axis(logits, at, axis=2) - norm, calibration)
        lp = lp.transpose(0, 2, 1)  # [B,X,D]
        drafter = jnp.cumsum(lp, axis=2)
        pool = merge_chains(pool, jnp.concatenate(paths, 1), chains,
                            jnp.maximum(drafter, extra.score))  # fmt: skip
    return best_of_pool(*pool, N)


def calibrated(lp: jax.Array, calibration: Calibration) -> jax.Array:
    """Guess log probabilities lp [B,D,...] (axis 1: depth) -> estimated log probabilities
    that each guess is right when its parent is: min(0, slope * lp + shift) with depth d's
    (slope, shift) from `calibration` (a drafter's, fitted on held-out answers); () leaves
    lp as it is. Non-positive, so a path's score never exceeds its parent's."""
    if not calibration:
        return lp
    D = lp.shape[1]
    slope, shift = (jnp.asarray([c[i] for c in calibration[:D]], lp.dtype) for i in (0, 1))
    shape = (1, D) + (1,) * (lp.ndim - 2)
    return jnp.minimum(0.0, slope.reshape(shape) * lp + shift.reshape(shape))


def merge_chains(pool, known: jax.Array, chains: jax.Array, score: jax.Array):
    """pool: candidate nodes (score, token, parent, depth), each [B,M] (best_of_pool's),
    known [B,M,D] their paths (-1 past each node's depth); chains [B,X,D] (-1 unknown)
    with their nodes' scores [B,X,D] (non-increasing along a chain) -> the pool with the
    chains' nodes appended (x-major, then depth). A chain node whose path is a pool node's
    or an earlier chain's is left out (-inf) and lends that node its score if higher; the
    next node of its chain hangs from that node. A node past an unknown token scores -inf.
    Every node still scores at most its parent (whose path is a prefix of its own)."""
    B, X, D = chains.shape
    M = known.shape[1]
    chains = chains.astype(jnp.int32)
    score = jnp.where(jnp.cumprod(chains >= 0, axis=2) > 0, score, -jnp.inf)
    depth = jnp.arange(D)
    upto = depth[:, None] >= depth[None, :]  # [d,j]: token j is on the path of depth d
    own = jnp.where(upto, chains[:, :, None, :], -1).reshape(B, X * D, D)  # each node's path
    same_known = jnp.all(own[:, :, None] == known[:, None], axis=-1)  # [B,X*D,M]
    same_chain = jnp.all(own[:, :, None] == own[:, None], axis=-1)  # [B,X*D,X*D]
    earlier = jnp.arange(X * D)[:, None] > jnp.arange(X * D)[None]
    in_known = same_known.any(-1)
    repeat = in_known | jnp.any(same_chain & earlier, axis=-1)  # [B,X*D]
    # each chain node's place in the pool: the known node, the first chain with its path,
    # or itself
    first_chain = jnp.argmax(same_chain, axis=-1)  # the earliest equal (itself at least)
    place = jnp.where(in_known, jnp.argmax(same_known, axis=-1), M + first_chain)
    parent = jnp.concatenate([jnp.full((B, X, 1), -1), place.reshape(B, X, D)[:, :, :-1]], 2)
    flat = lambda x: x.reshape(B, X * D)  # noqa: E731
    scores = jnp.concatenate([pool[0], jnp.where(repeat, -jnp.inf, flat(score))], axis=1)
    scores = scores.at[jnp.arange(B)[:, None], place].max(flat(score))
    depths = jnp.broadcast_to(depth + 1, (B, X, D))
    added = (flat(jnp.maximum(chains, 0)), flat(parent), flat(depths))
    return (scores, *(jnp.concatenate([a, b.astype(a.dtype)], axis=1)
                      for a, b in zip(pool[1:], added, strict=True)))  # fmt: skip


def best_of_pool(score, token, parent, depth, n: int) -> Draft:
    """Candidate nodes, each [B,M]: score (log path probability), token, parent (its index
    in the pool, -1 the root; a parent before its children) and depth -> the Draft of the
    n best. A node's score never exceeds its parent's and ties go to the earlier one, so
    every chosen node's parent is chosen (best first: parents before children)."""
    B = score.shape[0]
    _, chosen = jax.lax.top_k(score, n)  # [B,n]
    node_of = jnp.zeros_like(score, jnp.int32)  # pool index -> node index (0: not chosen)
    node_of = node_of.at[jnp.arange(B)[:, None], chosen].set(jnp.arange(1, n + 1))
    pick = lambda x: jnp.take_along_axis(x, chosen, axis=1)  # noqa: E731
    parent_pool = pick(parent)
    node_parent = jnp.where(
        parent_pool >= 0, jnp.take_along_axis(node_of, jnp.maximum(parent_pool, 0), axis=1), 0
    )
    return Draft(pick(token).astype(jnp.int32), node_parent.astype(jnp.int32), pick(depth))


def top_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """logits [...,V] -> the top-k guesses' log probabilities and indices [...,k]. The
    barrier keeps the TopK a TopK: beside other TopKs in one program XLA:CPU otherwise
    rewrites it into a full sort of the vocabulary."""
    norm = jax.nn.logsumexp(logits, -1, keepdims=True)
    lp, index = map(jax.lax.optimization_barrier, jax.lax.top_k(logits, k))
    return lp - norm, index


def expand_frontier(
    score, token, tree: DynamicTree, expand, carry, above, keys, values, extra=None
) -> Draft:
    """EAGLE-2's per-node expansion with static shapes, for drafters whose guesses depend on
    the path. score, token [B,k]: the root's top-k guesses (log probabilities, tokens;
    k = tree.width), every one in the first frontier. Each depth d = 2..tree.max_depth:

        expand(d, paths [B,k,d-1], carry [B,k,...], above [B,k,E], keys, values [B,K,E,H])
            -> (log probs [B,k,k], tokens [B,k,k] of the frontier nodes' top-k children,
                the nodes' own entries keys, values [B,K,k,H], their carry [B,k,...])

    for the frontier (the k best nodes of depth d-1 by path probability; `paths` their
    tokens from depth 1, `above` which of the earlier entries are their ancestors, `carry`
    what their parents handed down); then the k best children are the next frontier. The
    tree is the N best of every node scored (best_of_pool), and of `extra`'s chains by
    their own scores (merge_chains: the drafter scores only the paths it expanded)."""
    B, k = score.shape
    D = tree.max_depth
    pool = [score], [token], [jnp.full((B, k), -1)], [jnp.ones((B, k), jnp.int32)]
    front, paths = jnp.broadcast_to(jnp.arange(k), (B, k)), token[..., None]
    known = [paths]  # every pool node's path [B,k or k*k,d]
    for d in range(2, D + 1):
        lp, guess, new_keys, new_values, carry = expand(d, paths, carry, above, keys, values)
        keys = jnp.concatenate([keys, new_keys], 2)
        values = jnp.concatenate([values, new_values], 2)
        grown, guess = (score[:, :, None] + lp).reshape(B, k * k), guess.reshape(B, k * k)
        offset = sum(x.shape[1] for x in pool[0])
        pool[0].append(grown)
        pool[1].append(guess)
        pool[2].append(jnp.repeat(front, k, axis=1))
        pool[3].append(jnp.full((B, k * k), d, jnp.int32))
        known.append(jnp.concatenate([jnp.repeat(paths, k, axis=1), guess[..., None]], -1))
        score, best = jax.lax.top_k(grown, k)  # the next frontier
        src = best // k  # [B,k] the frontier node each one hangs from
        front = offset + best
        paths = jnp.concatenate(
            [_rows_of(paths, src), jnp.take_along_axis(guess, best, 1)[..., None]], -1
        )
        above = jnp.concatenate([_rows_of(above, src), src[..., None] == jnp.arange(k)], -1)
        carry = jax.tree.map(lambda x, src=src: _rows_of(x, src), carry)
    pool = tuple(jnp.concatenate(x, 1) for x in pool)
    if extra is not None:
        padded = [jnp.pad(x, ((0, 0), (0, 0), (0, D - x.shape[2])), constant_values=-1)
                  for x in known]  # fmt: skip
        pool = merge_chains(pool, jnp.concatenate(padded, 1), extra.tokens, extra.score)
    return best_of_pool(*pool, tree.n_nodes - 1)


def _rows_of(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B,k,...] -> [B,k',...]: row index [B,k'] of each."""
    return jnp.take_along_axis(x, index.reshape(*index.shape, *[1] * (x.ndim - 2)), 1)
