"""Token selection: greedy, or sampling from the temperature/top-k/top-p warped distribution.

`warped_logprobs` is *the model's distribution* that lossless speculative sampling must
reproduce exactly, so every decoder samples through it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 means no top-k cut; top_p 1 means no nucleus.

    typical: Medusa's typical acceptance in speculative decoding (a drafted token is kept
    if its probability exceeds min(0.09, 0.3 * exp(-entropy))). NOT lossless: the output
    distribution is no longer the model's. Off by default.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    typical: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise JaxspecError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise JaxspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise JaxspecError(f"--top-k must be >= 0, got {self.top_k}")
        if self.typical and self.temperature == 0:
            raise JaxspecError("--typical needs sampling: set --temperature > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warped_logprobs(logits: jax.Array, s: Sampling) -> jax.Array:
    """logits [..., V] -> log-probabilities [..., V], -inf outside the top-k/top-p support.

    top-k keeps the k tokens jax.lax.top_k returns (the lower id first among equal logits);
    the nucleus is then taken among them, so only k values are sorted, not V (with top_k
    0, the whole vocabulary is sorted: on XLA:CPU a verify step's [T, V] sort costs more
    than its forward)."""
    logits = logits.astype(jnp.float32) / s.temperature
    neg_inf = jnp.finfo(jnp.float32).min
    if s.top_k:
        values, ids = jax.lax.top_k(logits, s.top_k)  # [..., k], descending
        if s.top_p < 1:
            values = jnp.where(nucleus(values, s.top_p), values, neg_inf)
        logits = jnp.put_along_axis(
            jnp.full_like(logits, neg_inf), ids, values, axis=-1, inplace=False
        )
    elif s.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        keep = nucleus(jnp.take_along_axis(logits, order, axis=-1), s.top_p)
        keep = jnp.put_along_axis(jnp.zeros_like(keep), order, keep, axis=-1, inplace=False)
        logits = jnp.where(keep, logits, neg_inf)
    return jax.nn.log_softmax(logits, axis=-1)


def nucleus(sorted_logits: jax.Array, top_p: float) -> jax.Array:
    """sorted_logits [..., n] descending -> keep [..., n]: a token stays while the mass
    strictly before it is below top_p (the first always)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    return (jnp.cumsum(probs, axis=-1) - probs) < top_p


def select_tokens(logits: jax.Array, keys: jax.Array, s: Sampling) -> jax.Array:
    """logits [B,V], keys [B] (one PRNG key per row) -> tokens [B] int32."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logprobs = warped_logprobs(logits, s)
    return jax.vmap(jax.random.categorical)(keys, logprobs).astype(jnp.int32)


def position_keys(key: jax.Array, positions: jax.Array) -> jax.Array:
    """One key per row from the row index and the position being sampled: positions [B] ->
    keys [B].

    Tying randomness to positions (not to loop iterations) makes a run reproducible from
    its seed whatever the number of tokens each step produces; the row index keeps rows
    of a batch independent.
    """
    rows = jnp.arange(positions.shape[0])
    return jax.vmap(lambda p, r: jax.random.fold_in(jax.random.fold_in(key, p), r))(positions, rows)
