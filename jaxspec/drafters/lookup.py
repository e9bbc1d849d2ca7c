"""Lookup: drafts copied from the text itself (prompt lookup decoding, suffix matching).

The drafter keeps every committed token (its state). Each step it finds the places where
the last few tokens occurred before (the longest suffix match, up to `max_ngram` tokens,
then the most recent) and proposes what followed them. Nothing is trained: it pays off
where outputs copy their input (summaries, retrieval answers, code edits).

A tree is filled depth by depth from the best `matches` continuations: a node of rank r
takes the r-th distinct token at its depth among the continuations that agree with its
path so far; a chain takes the best match's continuation, a comb its alternatives. Nodes
that no continuation reaches get token 0 (verification rejects what is wrong; any draft is
lossless).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig
from jaxspec.drafters.base import Drafter, DraftInputs
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.tree import TreeSpec

# Slots past the cache length: a step writes its root and accepted path there at most.
SPARE_SLOTS = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class LookupSettings(DrafterSettings):
    """Its default trees: on CPU a short chain (a verify row costs nearly a decode step
    there), on accelerators a comb of alternatives."""

    max_ngram: int = 3
    matches: int = 8
    cpu_tree: str | None = "chain-4"
    gpu_tree: str | None = "comb-8-4"


@flax.struct.dataclass
class LookupState:
    tokens: jax.Array  # [B,N] every committed token, then the current one (N = S + spare)


@dataclasses.dataclass(frozen=True)
class LookupDrafter(Drafter):
    max_ngram: int = 3  # the longest suffix matched
    matches: int = 8  # continuations considered per step (at least the tree's width)

    @classmethod
    def from_settings(cls, cfg: LlamaConfig, settings: LookupSettings | None = None, **options):
        settings = settings or LookupSettings()
        return cls(settings.max_ngram, settings.matches)

    def init(self, base_params=None, key=None) -> dict:
        return {}  # nothing to learn

    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None) -> LookupState:
        return LookupState(jnp.zeros((batch, max_len + SPARE_SLOTS), jnp.int32))

    def advance(self, params, drafter_params, inputs: DraftInputs) -> LookupState:
        """The entered tokens at their positions, the current one after them."""
        new, B = inputs.entered, inputs.current.shape[0]
        write = jax.vmap(lambda row, x, at: jax.lax.dynamic_update_slice(row, x, (at,)))
        tokens = write(inputs.state.tokens, new.tokens.astype(jnp.int32), new.start)
        return LookupState(tokens.at[jnp.arange(B), inputs.position].set(inputs.current))

    def continuations(self, tokens, position, width: int, depth: int):
        """tokens [B,N] with the current token at position [B] -> (found [B,W,depth]: what
        followed the W best earlier occurrences of the current suffix (longest match of up
        to max_ngram tokens first, then the latest), -1 where unknown or not found;
        matched [B,W]: how many tokens each occurrence matched, 0 for none)."""
        B, N = tokens.shape
        at = jnp.arange(N)
        run, matched = jnp.ones((B, N), bool), jnp.zeros((B, N), jnp.int32)
        for j in range(self.max_ngram):  # run: the j+1 tokens ending at i equal those at p
            mine = jnp.take_along_axis(tokens, jnp.maximum(position - j, 0)[:, None], 1)
            ahead = jnp.take(tokens, jnp.maximum(at - j, 0), axis=1)  # [B,N]
            run &= (at >= j) & (position[:, None] >= j) & (ahead == mine)
            matched += run
        usable = (at[None] < position[:, None]) & (matched > 0)  # something follows
        score = jnp.where(usable, matched * N + at, -1)  # longer, then later
        best, ends = jax.lax.top_k(score, min(width, N))  # [B,W]
        follow = ends[..., None] + 1 + jnp.arange(depth)  # [B,W,depth]
        known = (best >= 0)[..., None] & (follow <= position[:, None, None])
        found = jnp.take_along_axis(tokens[:, None], jnp.minimum(follow, N - 1), axis=2)
        return jnp.where(known, found, -1), jnp.maximum(best, 0) // N

    def propose(self, params, drafter_params, tree: TreeSpec, inputs: DraftInputs, key):
        """-> candidates [B,T-1]: depth by depth, node (parent, rank r) takes the r-th
        distinct next token of the continuations that agree with the parent's path."""
        B, T = inputs.current.shape[0], tree.n_nodes
        if T == 1:
            return jnp.zeros((B, 0), jnp.int32)
        W = max(self.matches, tree.width)
        cont, _ = self.continuations(inputs.state.tokens, inputs.position, W, tree.max_depth)
        W = cont.shape[1]
        nodes = jnp.zeros((B, T), jnp.int32)
        agree = jnp.zeros((B, T, W), bool).at[:, 0].set(True)  # continuation w fits node
        earlier = jnp.asarray(np.tril(np.ones((W, W), bool), -1))  # [w, w'] w' < w
        for d in range(1, tree.max_depth + 1):
            level = np.flatnonzero(tree.depth == d)
            token = cont[:, None, :, d - 1]  # [B,1,W]
            fits = agree[:, tree.parent[level]] & (token >= 0)  # [B,n,W]
            same = (token[..., :, None] == token[..., None, :]) & earlier  # [B,1,W,W]
            first = fits & ~jnp.any(same & fits[..., None, :], axis=-1)
            rank = jnp.cumsum(first, axis=-1) - 1
            pick = first & (rank == jnp.asarray(tree.rank[level])[None, :, None])
            chosen = jnp.take_along_axis(token[:, 0], jnp.argmax(pick, -1), axis=1)  # [B,n]
            reached = pick.any(-1)  # [B,n]
            nodes = nodes.at[:, level].set(jnp.where(reached, chosen, 0))
            agree = agree.at[:, level].set(fits & (token == chosen[..., None]) & reached[..., None])
        return nodes[:, 1:]
