"""The Llama model as pure functions of an explicit parameter pytree.

params: a dict of arrays laid out by the one table in `jaxspec.param_table` (names, shapes,
logical axes; its docstring draws the tree): top-level weights and "layers", a list of one
dict per decoder block. Linear weights are stored [in, out] (HF stores [out, in]); names
mirror HF. For decoding in bfloat16, `compute_params` keeps the blocks' linear weights
[out, in] (layers.OutIn).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxspec import param_table
from jaxspec.config import LlamaConfig
from jaxspec.kv_cache import KVBlock, KVCache, attention_mask
from jaxspec.layers import (
    OutIn,
    PlainProducts,
    PrefixReads,
    apply_rope,
    attention,
    dense,
    rms_norm,
    rope_tables,
    swiglu_mlp,
    within_window,
)

Params = dict
# (x [...,in], weight name) -> x @ weight [...,out]: a block's linear maps. The plain one
# reads the layer's weights; an adapter (SDSAT's) may add its own terms.
Linear = Callable[[jax.Array, str], jax.Array]


# A decoder block's linear weights (q_proj ... down_proj): its entries that are not norms.
LINEAR_NAMES = tuple(p.name for p in param_table.TABLE if p.per_layer and p.init == "normal")


def compute_params(tree, dtype=None):
    """Params (the model's, or a drafter's) ready to compute with weights in `dtype` (None:
    as they are): floating leaves cast, integer leaves kept; in bfloat16 every decoder
    block's linear weight [in,out] becomes OutIn([out,in]), the faster order on CPUs with
    AMX and no slower elsewhere. Values and results are unchanged: only the order differs."""
    if dtype is None:
        return tree
    dtype = jnp.dtype(dtype)

    def leaf(path, a):
        a = a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
        name = getattr(path[-1], "key", None) if path else None
        if dtype == jnp.bfloat16 and name in LINEAR_NAMES and a.ndim == 2:
            return OutIn(a.T)
        return a

    return jax.tree_util.tree_map_with_path(leaf, tree)


def plain_products(params: Params) -> Params:
    """The model's params with every bfloat16 decoder-block linear weight multiplied in one
    bfloat16 pass (layers.PlainProducts); the same arrays, no copy."""

    def layer(p: dict) -> dict:
        return {
            name: PlainProducts(w) if name in LINEAR_NAMES and _is_bfloat16(w) else w
            for name, w in p.items()
        }

    return {**params, "layers": [layer(p) for p in params["layers"]]}


def _is_bfloat16(w) -> bool:
    return (w.w if isinstance(w, OutIn) else w).dtype == jnp.bfloat16


def plain_linear(p: dict) -> Linear:
    return lambda x, name: dense(x, p[name]).astype(x.dtype)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens [B,T] -> hidden [B,T,D] float32 (activations stay float32 whatever the
    weights' dtype: see layers.dense)."""
    return jnp.take(params["embed_tokens"], tokens, axis=0).astype(jnp.float32)


def project_heads(cfg, p, x, name: str, n_heads: int, linear: Linear) -> jax.Array:
    """x [B,T,D] -> query, key or value heads [B,T,n_heads,H] (name "q", "k" or "v"), with
    the family's bias (Qwen2) and per-head RMSNorm on q and k (Qwen3), before RoPE."""
    B, T, _ = x.shape
    y = linear(x, f"{name}_proj")
    if cfg.qkv_bias:
        y = y + p[f"{name}_bias"].astype(y.dtype)
    y = y.reshape(B, T, n_heads, cfg.head_dim)
    if cfg.qk_norm and name != "v":
        y = rms_norm(y, p[f"{name}_norm"], cfg.norm_eps)
    return y


def layer_kv(cfg, p, x, cos, sin, linear: Linear | None = None):
    """A block's keys (rotated) and values for its normed input x [B,T,D] -> [B,K,T,H] each."""
    linear = linear or plain_linear(p)
    k = project_heads(cfg, p, x, "k", cfg.n_kv_heads, linear)
    v = project_heads(cfg, p, x, "v", cfg.n_kv_heads, linear)
    return apply_rope(k, cos, sin).transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def decoder_layer(cfg, p, h, cos, sin, k_cache, v_cache, mask, linear: Linear | None = None):
    """One block. h [B,T,D]; caches [B,K,S,H] (read only) -> h, new keys and values [B,K,T,H]."""
    linear = linear or plain_linear(p)
    x = rms_norm(h, p["input_layernorm"], cfg.norm_eps)
    q = apply_rope(project_heads(cfg, p, x, "q", cfg.n_heads, linear), cos, sin)
    k, v = layer_kv(cfg, p, x, cos, sin, linear)
    plain = isinstance(p.get("q_proj"), PlainProducts)  # its attention's products too
    h = h + linear(attention(q, k_cache, v_cache, k, v, mask, plain), "o_proj")
    h = h + swiglu_mlp(rms_norm(h, p["post_attention_layernorm"], cfg.norm_eps), linear)
    return h, k, v


def run_layers(
    params: Params,
    cfg: LlamaConfig,
    h: jax.Array,
    positions: jax.Array,
    cache: KVCache | None,
    new_mask: jax.Array,
    start: int = 0,
    stop: int | None = None,
    collect: Sequence[int] = (),
    context_mask: jax.Array | None = None,
    linears: Callable[[int, dict], Linear] | None = None,
    context_block: KVBlock | None = None,
) -> tuple[jax.Array, KVBlock, dict[int, jax.Array]]:
    """Run layers [start, stop) on hidden states h [B,T,D] at positions [B,T].

    Every new token sees its row's committed cache (none when `cache` is None, as in a
    prefill: no work is spent on an empty cache buffer); new_mask [B,T,T] says which new tokens
    see each other (causal for a chain, the tree mask for a tree). The cache is only read:
    the new tokens' keys/values come back as a KVBlock of the layers run, for `commit`.
    `collect` names layer counts i whose output (the state after i layers, HF's
    hidden_states[i]) is returned in the dict. `context_mask` [B,T,S], when given, replaces
    "sees the committed slots" with any per-token choice of cache slots (FIRP's training
    attends pseudo tokens to a prefix of the real ones). `linears(i, layer_params)`, when
    given, supplies layer i's linear maps (an adapter's). `context_block` (with
    context_mask [B,T,S+T']): T' uncommitted tokens right after each row's committed ones,
    read after the cache's slots (a prompt's forward, for chains computed after it). With a
    sliding window (Mistral), a token also sees only keys within the window behind it
    (cache slot s holds position s). A cache with a `read_block` (a long prompt's chunk) is
    read a block of slots at a time, only as far as its rows' lengths.
    """
    stop = cfg.n_layers if stop is None else stop
    cos, sin = rope_tables(cfg, positions)
    if cache is None:
        mask, keys_in, values_in = new_mask, [None] * cfg.n_layers, [None] * cfg.n_layers
    elif context_mask is None and cache.read_block:
        window = cfg.sliding_window or 0
        mask = PrefixReads(cache.lengths, new_mask, positions, window, cache.read_block)
        keys_in, values_in = cache.keys, cache.values
    elif context_mask is None:
        mask = attention_mask(cache.lengths, new_mask, cache.max_len)  # [B,T,S+T]
        keys_in, values_in = cache.keys, cache.values
    else:
        mask = jnp.concatenate([context_mask, new_mask], axis=-1)
        keys_in, values_in = cache.keys, cache.values
        if context_block is not None:
            keys_in = tuple(zip(keys_in, context_block.keys, strict=True))
            values_in = tuple(zip(values_in, context_block.values, strict=True))
    window_in_mask = cfg.sliding_window and not isinstance(mask, PrefixReads)  # else per block
    if window_in_mask:  # keys: the cache's slots (slot s holds position s), then the new
        B, T = positions.shape
        # The widths from the mask: a context's keys may be None below the first layer run
        after = 0 if context_block is None else context_block.keys[start].shape[2]
        S = mask.shape[-1] - T - after
        slots = [jnp.broadcast_to(jnp.arange(S), (B, S))]
        if context_block is not None:  # right after each row's committed tokens
            slots.append(cache.lengths[:, None] + jnp.arange(after))
        key_positions = jnp.concatenate([*slots, positions], axis=1)  # [B,S+T'+T]
        mask = jnp.logical_and(mask, within_window(positions, key_positions, cfg.sliding_window))
    keys, values = [], []
    collected = {start: h} if start in collect else {}
    for i in range(start, stop):
        p = params["layers"][i]
        linear = None if linears is None else linears(i, p)
        h, k, v = decoder_layer(cfg, p, h, cos, sin, keys_in[i], values_in[i], mask, linear)
        keys.append(k)
        values.append(v)
        if i + 1 in collect:
            collected[i + 1] = h
    return h, KVBlock(tuple(keys), tuple(values)), collected


def final_norm(params: Params, cfg: LlamaConfig, h: jax.Array) -> jax.Array:
    return rms_norm(h, params["norm"], cfg.norm_eps)


def vocab_projection(params: Params, cfg: LlamaConfig, x: jax.Array) -> jax.Array:
    """The output projection (lm_head, or the tied embeddings): x [...,D] -> [...,V] float32."""
    if cfg.tie_embeddings:
        return dense(x, OutIn(params["embed_tokens"]))  # [V,D]
    return dense(x, params["lm_head"])


def draft_vocab(params: Params, cfg: LlamaConfig, ids) -> dict:
    """Token ids [V'] -> {"ids", "matrix" [V',D]}: their rows of the output projection, for
    drafters that guess among a draft vocabulary only."""
    ids = jnp.asarray(ids, jnp.int32)
    lm = params["embed_tokens"] if cfg.tie_embeddings else params["lm_head"].T  # [V,D]
    return {"ids": ids, "matrix": jnp.take(lm, ids, axis=0)}


def lm_logits(params: Params, cfg: LlamaConfig, h: jax.Array) -> jax.Array:
    """Final norm and output projection: h [B,T,D] -> logits [B,T,V] in float32."""
    return vocab_projection(params, cfg, final_norm(params, cfg, h))


def forward(
    params: Params,
    cfg: LlamaConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    new_mask: jax.Array,
    collect: Sequence[int] = (),
) -> tuple[jax.Array, KVBlock, dict[int, jax.Array]]:
    """tokens [B,T] -> logits [B,T,V], the tokens' KVBlock, collected states."""
    h, block, collected = run_layers(
        params, cfg, embed(params, tokens), positions, cache, new_mask, collect=collect
    )
    return lm_logits(params, cfg, h), block, collected


def init_params(cfg: LlamaConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02):
    """Random parameters (tests, and timing at 7B/13B shapes) from `param_table`: weights
    scale * N(0, 1), norms ones, biases zeros. Keys are drawn layer by layer, then for the
    top level, one per weight the table can hold: an absent one (lm_head when tied) keeps
    its key, so an option never changes the other weights' draws."""
    weights = [p for p in param_table.TABLE if p.init == "normal"]
    n_keys = sum(cfg.n_layers if p.per_layer else 1 for p in weights)
    keys = iter(jax.random.split(key, n_keys))

    def make(entries) -> dict:
        out = {}
        for p in entries:
            k = next(keys) if p.init == "normal" else None  # drawn even when p is absent
            if p.present(cfg):
                shape = p.shape(cfg)
                if k is None:
                    w = jnp.ones(shape) if p.init == "ones" else jnp.zeros(shape)
                else:
                    w = scale * jax.random.normal(k, shape)
                out[p.name] = w.astype(dtype)
        return out

    layers = [make(p for p in param_table.TABLE if p.per_layer) for _ in range(cfg.n_layers)]
    return {**make(p for p in param_table.TABLE if not p.per_layer), "layers": layers}
