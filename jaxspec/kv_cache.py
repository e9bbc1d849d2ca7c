"""KV cache: an explicit pytree of per-layer buffers with static shape and per-row length.

A forward only *reads* the cache: attention sees the committed slots [0, length) plus the
forward's own new tokens, and the forward returns their keys/values as a `KVBlock`.
`commit` (a separate, donated step) then writes the block at [length, length + T) and
advances the lengths. Keeping reads and the in-place write in different programs is what
lets XLA update the cache without copying it (on CPU a program that reads and updates the
same buffer copies it whole), and lets tree decoding commit only the accepted path.
"""

from __future__ import annotations

from functools import partial

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.config import LlamaConfig


@flax.struct.dataclass
class KVCache:
    keys: tuple[jax.Array, ...]  # L x [B,K,S,H]
    values: tuple[jax.Array, ...]  # L x [B,K,S,H]
    lengths: jax.Array  # [B] int32, committed tokens per row
    # > 0: forwards read the committed slots this many at a time, only up to the longest
    # row's length (a long prompt's chunks: `prompt_reads`); 0: the whole buffer, masked
    read_block: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]


@flax.struct.dataclass
class KVBlock:
    """Keys/values of T new tokens for a run of layers: each [B,K,T,H]."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)  # S third: no transposes in attention

    def buffers():
        return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))

    return KVCache(keys=buffers(), values=buffers(), lengths=jnp.zeros((batch,), jnp.int32))


def prompt_reads(cache: KVCache | None, block: int) -> KVCache | None:
    """The cache (None: none) as a long prompt's chunk reads it (layers.prefix_attention):
    `block` slots at a time, as far as the prompt has come, whatever the buffer's size."""
    return None if cache is None else cache.replace(read_block=block)


def write_rows(buffer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """buffer [B,K,S,H] <- new [B,K,T,H] at row-wise slot starts [B]."""

    def write_row(row, new_row, start):
        return jax.lax.dynamic_update_slice(row, new_row.astype(row.dtype), (0, start, 0))

    return jax.vmap(write_row)(buffer, new, starts)


@partial(jax.jit, donate_argnames=("cache",))
def commit(cache: KVCache, block: KVBlock, n: jax.Array) -> KVCache:
    """Write block (every layer's) at each row's length and commit n [B] of its tokens.

    Slots past length + n hold the block's remaining tokens but stay invisible (attention
    only reads committed slots) and are overwritten by the next commit.
    """
    keys, values = list(cache.keys), list(cache.values)
    for i, (k, v) in enumerate(zip(block.keys, block.values, strict=True)):
        keys[i] = write_rows(keys[i], k, cache.lengths)
        values[i] = write_rows(values[i], v, cache.lengths)
    return KVCache(tuple(keys), tuple(values), cache.lengths + n)


def attention_mask(lengths: jax.Array, new_mask: jax.Array, max_len: int) -> jax.Array:
    """Mask over [cache slots | new tokens] for T new tokens: [B,T,S+T].

    lengths [B] committed slots per row; new_mask [B,T,T] says which new tokens each new
    token sees (causal for a chain, the tree mask for a tree). Example, length 2, S 4, T 3,
    causal new_mask:

        key:   s0 s1 s2 s3 | n0 n1 n2
        n0      1  1  0  0 |  1  0  0
        n1      1  1  0  0 |  1  1  0
        n2      1  1  0  0 |  1  1  1
    """
    B, T, _ = new_mask.shape
    committed = jnp.arange(max_len)[None, None, :] < lengths[:, None, None]  # [B,1,S]
    return jnp.concatenate([jnp.broadcast_to(committed, (B, T, max_len)), new_mask], axis=-1)


def causal_mask(batch: int, T: int) -> jax.Array:
    """[B,T,T] lower-triangular mask among T new tokens."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (batch, T, T))
