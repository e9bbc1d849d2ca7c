"""KV cache: an explicit pytree of per-layer buffers with static shape and per-row length.

New tokens of a forward are written at slots [length, length + T) of their row; only
`advance` (or, for trees, committing an accepted path) makes them part of the context.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.config import LlamaConfig


@flax.struct.dataclass
class KVCache:
    keys: tuple[jax.Array, ...]  # L x [B,S,K,H]
    values: tuple[jax.Array, ...]  # L x [B,S,K,H]
    lengths: jax.Array  # [B] int32, committed tokens per row

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    def buffers():
        return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))

    return KVCache(keys=buffers(), values=buffers(), lengths=jnp.zeros((batch,), jnp.int32))


def write_rows(buffer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """buffer [B,S,...] <- new [B,T,...] at row-wise slot starts [B]."""

    def write_row(row, new_row, start):
        index = (start,) + (0,) * (row.ndim - 1)
        return jax.lax.dynamic_update_slice(row, new_row.astype(row.dtype), index)

    return jax.vmap(write_row)(buffer, new, starts)


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commit the first n [B] (or scalar) freshly written slots of each row."""
    return cache.replace(lengths=cache.lengths + n)


def cache_attention_mask(lengths: jax.Array, new_mask: jax.Array, max_len: int) -> jax.Array:
    """Mask over all S cache slots for T new tokens written at [length, length + T).

    lengths [B], new_mask [B,T,T] (which new tokens each new token sees) -> [B,T,S].
    Example, length 2, S 6, T 3, causal new_mask:

        slot:   0 1 2 3 4 5
        t=0     1 1 1 0 0 0
        t=1     1 1 1 1 0 0
        t=2     1 1 1 1 1 0
    """
    T = new_mask.shape[-1]
    rel = jnp.arange(max_len)[None, None, :] - lengths[:, None, None]  # [B,1,S]
    committed = rel < 0
    among_new = jnp.take_along_axis(
        new_mask, jnp.broadcast_to(jnp.clip(rel, 0, T - 1), new_mask.shape[:2] + (max_len,)), axis=2
    )
    return jnp.logical_or(committed, jnp.logical_and(rel < T, among_new))


def causal_mask(batch: int, T: int) -> jax.Array:
    """[B,T,T] lower-triangular mask among T new tokens."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (batch, T, T))
