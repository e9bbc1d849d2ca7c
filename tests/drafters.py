"""Drafters for tests: random guesses (still lossless) and an oracle (shows acceptance)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafters.base import Drafter


@dataclasses.dataclass(frozen=True)
class RandomDrafter(Drafter):
    vocab_size: int

    def propose(self, params, drafter_params, tree, inputs, key):
        B = inputs.current.shape[0]
        return jax.random.randint(key, (B, tree.n_nodes - 1), 0, self.vocab_size, jnp.int32)


@dataclasses.dataclass(frozen=True)
class OracleDrafter(Drafter):
    """drafter_params: a reference sequence [N] (prompt + expected output). Rank-0 nodes
    propose the reference token at their position, other ranks a wrong one."""

    vocab_size: int

    def propose(self, params, reference, tree, inputs, key):
        depth = jnp.asarray(tree.depth[1:])
        rank = jnp.asarray(tree.rank[1:])
        pos = jnp.clip(inputs.position[:, None] + depth[None], 0, reference.shape[0] - 1)
        right = reference[pos]  # [B,T-1]
        return jnp.where(rank[None] == 0, right, (right + rank[None]) % self.vocab_size)
