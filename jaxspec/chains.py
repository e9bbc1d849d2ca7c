"""Draft tokens chained off the nodes of a verify step (FIRP's pseudo states, SDSAT's
adaptive tokens in its one-forward loop): K extra tokens per anchor node, ordered
step-major, that see what their anchor sees and the earlier tokens of their own chain.
Real tokens never see them, so the logits being verified stay exactly the model's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kv_cache import KVBlock, KVCache


def chain_mask(n_anchors: int, n_steps: int, chained: bool = True) -> np.ndarray:
    """[K*A, K*A] among pseudo tokens ordered step-major (row i*A + a: step i+1 of anchor
    a): each sees the earlier steps of its own anchor's chain and itself (only itself
    when not `chained`: FIRP's "masked" ablation, its Fig. 7)."""
    step = np.repeat(np.arange(n_steps), n_anchors)
    anchor = np.tile(np.arange(n_anchors), n_steps)
    earlier = step[None] <= step[:, None] if chained else step[None] == step[:, None]
    return (anchor[:, None] == anchor[None]) & earlier


def joint_mask(new_mask: jax.Array, anchors: jax.Array, n_steps: int) -> jax.Array:
    """new_mask [B,T,T] among real tokens, anchors [B,A] -> [B,T+K*A,T+K*A] over
    [real ; pseudo step-major]: real rows keep new_mask and see no pseudo token; a pseudo
    row sees what its anchor sees plus its chain (chain_mask)."""
    B, T, _ = new_mask.shape
    A = anchors.shape[1]
    sees_real = jnp.take_along_axis(new_mask, anchors[:, :, None], axis=1)  # [B,A,T]
    real_rows = jnp.concatenate([new_mask, jnp.zeros((B, T, n_steps * A), bool)], -1)
    chain = jnp.broadcast_to(jnp.asarray(chain_mask(A, n_steps)), (B, n_steps * A, n_steps * A))
    pseudo_rows = jnp.concatenate([jnp.tile(sees_real, (1, n_steps, 1)), chain], -1)
    return jnp.concatenate([real_rows, pseudo_rows], 1)


def pseudo_positions(positions: jax.Array, anchors: jax.Array, n_steps: int) -> jax.Array:
    """positions [B,T], anchors [B,A] -> [B,K*A] step-major: step i at anchor's + i."""
    at_anchor = jnp.take_along_axis(positions, anchors, axis=1)  # [B,A]
    return jnp.concatenate([at_anchor + i for i in range(1, n_steps + 1)], axis=1)


def after_prompt(
    cache: KVCache | None, block: KVBlock, new_mask: jax.Array, anchors: jax.Array, n_steps: int
) -> tuple[KVCache, KVBlock | None, jax.Array]:
    """A prompt's forward already run (its KVBlock `block`, T rows after the cache's) ->
    what its chains attend to when they run in a pass of their own (run_layers' cache,
    context_block and context_mask [B,K*A,S(+T)], step-major; each sees what its anchor
    sees). The prompt's rows are then computed by exactly AR's prefill: rows computed
    beside them could change their bits on an accelerator (products tiled by row count)."""
    B, T, _ = new_mask.shape
    sees_new = jnp.take_along_axis(new_mask, anchors[:, :, None], axis=1)  # [B,A,T]
    if cache is None:  # the block as the cache: slot s holds position s
        context = KVCache(block.keys, block.values, jnp.zeros((B,), jnp.int32))
        return context, None, jnp.tile(sees_new, (1, n_steps, 1))
    committed = jnp.arange(cache.max_len)[None] < cache.lengths[:, None]  # [B,S]
    committed = jnp.broadcast_to(committed[:, None], (B, anchors.shape[1], cache.max_len))
    sees = jnp.concatenate([committed, sees_new], axis=-1)  # [B,A,S+T]
    return cache, block, jnp.tile(sees, (1, n_steps, 1))
