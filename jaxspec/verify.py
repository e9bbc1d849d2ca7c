"""Tree verification: one forward over the draft tree, then acceptance, reading the tree's
topology as per-row arrays (jaxspec.topology: a static tree's constants or a dynamic
tree's choice).

Greedy: the longest path from the root (among the topology's paths: a static tree's
root-to-leaf paths, a path to every node of a dynamic one) whose drafted tokens each equal
the model's argmax at their parent, plus the model's own next token after it (the bonus).

Sampling (lossless): from the root, the children's drafted tokens are tried best first
against the model's warped distribution p at the current node: a child with token t is
accepted with probability r(t) / sum(r), where r is p with the tokens already rejected
at this node removed; on acceptance the walk moves to that child, otherwise t is removed
from r. When no child is accepted (or at a leaf) the bonus token is drawn from r. The
drafted tokens are fixed before any of this randomness is drawn, so every emitted token
is distributed exactly as p given the tokens before it: the output distribution is the
model's, for any tree and any drafter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.kv_cache import KVBlock
from jaxspec.sampling import Sampling, warped_logprobs
from jaxspec.topology import Topology


def at_nodes(x: jax.Array, nodes: jax.Array) -> jax.Array:
    """x [B,T,...], node indices [B,...] -> x at each row's nodes [B,...(nodes),...]."""
    return jax.vmap(lambda row, index: row[index])(x, nodes)


def _longest_path(topo: Topology, child_ok):
    """child_ok(parent_nodes, child_nodes) [B,P,D] each -> [B,P,D] bool: is each path step
    acceptable? Returns the longest acceptable path's nodes [B,D+1] (0 past the end), its
    accepted count [B] and its last node [B]."""
    paths = topo.paths  # [B,P,D+1], -1 pads
    nodes_all = jnp.maximum(paths, 0)
    ok = child_ok(nodes_all[:, :, :-1], nodes_all[:, :, 1:]) & (paths[:, :, 1:] >= 0)
    accepted = jnp.cumprod(ok, axis=-1).sum(-1)  # [B,P]
    best = jnp.argmax(accepted, axis=-1)  # [B]
    n_accepted = jnp.take_along_axis(accepted, best[:, None], axis=1)[:, 0]
    nodes = jnp.take_along_axis(nodes_all, best[:, None, None], axis=1)[:, 0]  # [B,D+1]
    nodes = nodes * (jnp.arange(paths.shape[-1]) <= n_accepted[:, None])
    last = jnp.take_along_axis(nodes, n_accepted[:, None], axis=1)[:, 0]
    return nodes, n_accepted, last


def accept_greedy(topo: Topology, tokens: jax.Array, logits: jax.Array):
    """tokens [B,T], logits [B,T,V] -> accepted path nodes [B,D+1], accepted count [B],
    bonus token [B]. Node slots past the accepted count are 0 (unused)."""
    predicted = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B,T]
    nodes, n_accepted, last = _longest_path(
        topo, lambda parents, children: at_nodes(tokens, children) == at_nodes(predicted, parents)
    )
    bonus = jnp.take_along_axis(predicted, last[:, None], axis=1)[:, 0]
    return nodes, n_accepted, bonus


def accept_sampling(topo: Topology, tokens, logits, keys, sampling: Sampling):
    """As accept_greedy, by lossless rejection sampling; keys [B] one PRNG key per row."""
    probs = jnp.exp(warped_logprobs(logits, sampling))  # [B,T,V]
    D = topo.paths.shape[-1] - 1
    return jax.vmap(lambda c, t, p, k: _sample_path(c, D, t, p, k))(
        topo.children, tokens, probs, keys
    )


def _sample_path(children, D: int, tokens, probs, key):
    """One row: children [T,C] (best first), tokens [T], probs [T,V] -> nodes [D+1],
    accepted count, bonus token."""
    C = children.shape[1]
    uniforms = jax.random.uniform(key, (max(D, 1), C))
    node, n_accepted, done = jnp.int32(0), jnp.int32(0), jnp.bool_(False)
    nodes = jnp.zeros((D + 1,), jnp.int32)
    residual = probs[0]
    for d in range(D):
        chosen = jnp.int32(-1)
        for c in range(C):
            child = children[node, c]
            token = tokens[jnp.maximum(child, 0)]
            trying = (child >= 0) & ~done & (chosen < 0)
            p_accept = residual[token] / jnp.maximum(residual.sum(), 1e-30)
            accept = trying & (uniforms[d, c] < p_accept)
            chosen = jnp.where(accept, child, chosen)
            residual = jnp.where(trying & ~accept, residual.at[token].set(0.0), residual)
        moved = chosen >= 0
        node = jnp.where(moved, chosen, node)
        nodes = nodes.at[d + 1].set(jnp.where(moved, chosen, 0))
        n_accepted = n_accepted + moved
        residual = jnp.where(moved, probs[node], residual)
        done = done | ~moved
    bonus_key = jax.random.fold_in(key, 1)
    bonus = jax.random.categorical(bonus_key, jnp.log(residual)).astype(jnp.int32)
    return nodes, n_accepted, bonus


def accept_typical(topo: Topology, tokens, logits, keys, sampling: Sampling, eps=0.09, alpha=0.3):
    """Medusa's typical acceptance (NOT lossless): the longest path whose drafted tokens
    each have probability > min(eps, alpha * exp(-entropy)) under their parent's warped
    distribution; the bonus token is sampled from the last accepted node."""
    logprobs = warped_logprobs(logits, sampling)  # [B,T,V]
    probs = jnp.exp(logprobs)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logprobs, 0.0), axis=-1)  # [B,T]
    threshold = jnp.minimum(eps, alpha * jnp.exp(-entropy))  # [B,T]

    def child_ok(parents, children):
        p_child = jnp.take_along_axis(
            at_nodes(probs, parents), at_nodes(tokens, children)[..., None], axis=-1
        )
        return p_child[..., 0] > at_nodes(threshold, parents)

    nodes, n_accepted, last = _longest_path(topo, child_ok)
    last_logprobs = jnp.take_along_axis(logprobs, last[:, None, None], axis=1)[:, 0]
    bonus = jax.vmap(jax.random.categorical)(keys, last_logprobs).astype(jnp.int32)
    return nodes, n_accepted, bonus


def gather_path(block: KVBlock, nodes: jax.Array) -> KVBlock:
    """Keys/values of the accepted path, in order: each [B,K,T,H] -> [B,K,D+1,H]."""
    index = nodes[:, None, :, None]
    take = lambda x: jnp.take_along_axis(x, index, axis=2)  # noqa: E731
    return KVBlock(tuple(map(take, block.keys)), tuple(map(take, block.values)))
