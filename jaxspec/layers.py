"""Llama building blocks: RMSNorm, RoPE (HF split-half convention), SwiGLU, attention."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig, RopeScaling

# Every float32 product in true float32: GPUs would otherwise run them on TF32 tensor cores
# (10-bit mantissas), and the model's greedy tokens would depend on how rows are batched.
FLOAT32 = jax.lax.Precision.HIGHEST
# Compiler options of every program whose tokens must equal AR's: roundings as written.
# With excess precision allowed (XLA's default), XLA:GPU may drop an f32 -> bf16 -> f32
# round trip or keep a bfloat16 intermediate in float32 within a fusion: that would undo
# split_bfloat16's exact split and make a program's numbers depend on how it was fused.
EXACT_ROUNDING = {"xla_allow_excess_precision": False}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] normalised in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies [H/2] (a trace-time constant)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly (Llama 3.1's scheme).
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = np.where(
            wavelen > low_wavelen,
            inv_freq / scaling.factor,
            np.where(wavelen < high_wavelen, inv_freq, interpolated),
        )
    elif scaling.kind == "freq_factors":
        inv_freq = inv_freq / np.asarray(scaling.freq_factors)  # [H/2] divisors
    return inv_freq.astype(np.float32)


def rope_tables(cfg: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B,T] -> cos, sin [B,T,1,H/2] in float32."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,H/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B,T,heads,H]; rotates the pairs (i, i + H/2) as HF's rotate_half does."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def split_bfloat16(x: jax.Array) -> jax.Array:
    """x [R,in] float32 -> [3R,in] bfloat16 whose rows 3r, 3r+1, 3r+2 sum exactly to row r:
    each holds the next 8 mantissa bits of what the earlier ones left (3 x 8 = float32's 24).
    Interleaved, not in three blocks: rows split over devices keep their parts on their own
    device (blocks would be shuffled between devices before every product on a mesh)."""
    parts = []
    rest = x.astype(jnp.float32)
    for _ in range(3):
        part = rest.astype(jnp.bfloat16)
        rest = rest - part.astype(jnp.float32)  # exact: the leading bits cancel
        parts.append(part)
    return jnp.stack(parts, axis=1).reshape(-1, x.shape[-1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutIn:
    """A linear weight w [out,in] (HF's order) that `dense` multiplies as [in,out].

    bfloat16 weights are kept so for decoding (`llama.compute_params`): on CPUs with AMX,
    XLA:CPU's bfloat16 product reads [out,in] faster than [in,out] (docs/design.md,
    Precision)."""

    w: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainProducts:
    """A bfloat16 linear weight (an array [in,out] or an OutIn) that `dense` multiplies in
    one bfloat16 x bfloat16 pass accumulated in float32 instead of split_bfloat16's three:
    fewer products where they are the bottleneck (a long prefill on an accelerator), but x
    rounded to bfloat16, and a row's result may depend on the rows computed with it. A
    layer whose weights are PlainProducts multiplies its attention in one pass too
    (`attention_product`)."""

    w: jax.Array | OutIn


def dense(x: jax.Array, w: jax.Array | OutIn | PlainProducts) -> jax.Array:
    """x [...,in] times w [in,out] (or an OutIn holding [out,in]) -> [...,out] float32.

    float32 w: a float32 product. bfloat16 w: each row of x is split exactly into three
    bfloat16 rows (`split_bfloat16`), each element product is exact in float32, products are
    accumulated in float32 and the three summed: float32 accuracy for bfloat16 weights, at
    the cost of 3R rows on XLA:CPU's AMX/AVX512-BF16 kernel, whose cost barely grows with
    rows. That kernel serves >= 3 rows (one or two fall to slower kernels with other bits),
    which the split always gives, and a row's result does not depend on how many rows are
    computed: the same bits alone (AR) as among a tree's (verify)."""
    spec, plain = "ri,io->ro", isinstance(w, PlainProducts)
    w = w.w if plain else w
    if isinstance(w, OutIn):
        spec, w = "ri,oi->ro", w.w
    rows = x.reshape(-1, x.shape[-1])  # [R,in]
    n = rows.shape[0]
    if plain:
        y = jnp.einsum(spec, rows.astype(w.dtype), w, preferred_element_type=jnp.float32)
    elif w.dtype == jnp.bfloat16:
        y = jnp.einsum(spec, split_bfloat16(rows), w, preferred_element_type=jnp.float32)
        y = y.reshape(n, 3, -1)
        y = y[:, 0] + y[:, 1] + y[:, 2]  # [R,out]
    else:
        y = jnp.einsum(spec, rows, w, preferred_element_type=jnp.float32, precision=FLOAT32)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def swiglu_mlp(x: jax.Array, linear) -> jax.Array:
    """x [B,T,D] -> [B,T,D]: down(silu(gate(x)) * up(x)); linear(x, name) applies a weight."""
    return linear(jax.nn.silu(linear(x, "gate_proj")) * linear(x, "up_proj"), "down_proj")


def within_window(positions: jax.Array, key_positions: jax.Array, window: int) -> jax.Array:
    """positions [B,T], key_positions [B,S] -> [B,T,S]: the key is one of the last `window`
    positions up to the query's (HF's sliding window: q - window < k). Example, window 2:

        key:  0 1 2 3
        q 2   0 1 1 1    (keys after the query are masked by causality, not here)
        q 3   0 0 1 1
    """
    return key_positions[:, None, :] > positions[:, :, None] - window


@dataclasses.dataclass(frozen=True)
class PrefixReads:
    """What a long prompt's chunk sees, in place of a [B,T,S+T] mask: each row's committed
    slots [0, lengths) (slot s holds position s) read `block` keys at a time, then the new
    tokens as new_mask [B,T,T] says; with a sliding `window` (0: none) only keys within it
    behind each query's position (positions [B,T])."""

    lengths: jax.Array
    new_mask: jax.Array
    positions: jax.Array
    window: int
    block: int


def attention_product(spec: str, a: jax.Array, b: jax.Array, plain: bool) -> jax.Array:
    """einsum(spec, a, b) -> float32: in true float32, or (plain: the layer's weights are
    PlainProducts) in one bfloat16 x bfloat16 pass accumulated in float32, as its linear
    maps multiply (a long prefill's attention on an accelerator, not float32's slow path)."""
    if plain:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=FLOAT32)


def attention(q, k_cache, v_cache, k_new, v_new, mask, plain: bool = False):
    """Grouped-query attention over [committed cache | new tokens], one softmax over both.

    q [B,T,N,H]; k/v_cache [B,K,S,H], a tuple of such blocks (their slots one after the
    other), or None (no context: a prefill); k/v_new [B,K,T,H]; mask [B,T,S+T] (True = may
    attend), or PrefixReads (`prefix_attention`) -> [B,T,N*H]. Query heads are grouped per
    kv head as rows q = (g, t). plain: products as `attention_product` says.
    """
    if isinstance(mask, PrefixReads):
        return prefix_attention(q, k_cache, v_cache, k_new, v_new, mask, plain)
    B, T, N, H = q.shape
    K = k_new.shape[1]
    G = N // K
    if k_cache is None:
        blocks = [(k_new, v_new)]
    elif isinstance(k_cache, tuple):
        blocks = [*zip(k_cache, v_cache, strict=True), (k_new, v_new)]
    else:
        blocks = [(k_cache, v_cache), (k_new, v_new)]
    q = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    scores = jnp.concatenate(
        [attention_product("bkqh,bksh->bkqs", q, k, plain) for k, _ in blocks],
        axis=-1,
    ).reshape(B, K, G, T, -1) / math.sqrt(H)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_new.dtype).reshape(B, K, G * T, -1)
    out, start = 0.0, 0
    for _, v in blocks:
        part = probs[..., start : start + v.shape[2]]
        out = out + attention_product("bkqs,bksh->bkqh", part, v, plain)
        start += v.shape[2]
    out = out.astype(v_new.dtype)
    return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N * H)


def prefix_attention(q, k_cache, v_cache, k_new, v_new, reads: PrefixReads, plain: bool = False):
    """`attention` for a long prompt's chunk: the softmax over [committed slots | new
    tokens] computed online (a running maximum, sum and weighted values), over the cache's
    slots `reads.block` at a time and only as far as the longest row's length. Work and
    memory follow the prompt so far, not the cache's size: no [B,N,T,S] scores, and a
    32k-slot cache costs its first chunks no more than a short one. Equal to `attention`
    up to float32 rounding (the sum is taken in another order).

    q [B,T,N,H]; k/v_cache [B,K,S,H]; k/v_new [B,K,T,H] -> [B,T,N*H]. plain: products
    as `attention_product` says."""
    B, T, N, H = q.shape
    K, S = k_new.shape[1], k_cache.shape[2]
    G, block = N // K, min(reads.block, S)
    q = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    low = jnp.finfo(jnp.float32).min

    def sees_within_window(key_positions):  # [B,S'] -> [B,T,S']
        return not reads.window or within_window(reads.positions, key_positions, reads.window)

    def add(carry, k, v, sees):
        """carry (max [B,K,G,T], sum [B,K,G,T], weighted values [B,K,G,T,H]) plus keys
        and values [B,K,S',H] that each query sees where sees [B,T,S']."""
        top, total, out = carry
        scores = attention_product("bkqh,bksh->bkqs", q, k, plain)
        scores = scores.reshape(B, K, G, T, -1) / math.sqrt(H)
        sees = sees[:, None, None]
        scores = jnp.where(sees, scores, low)
        new_top = jnp.maximum(top, scores.max(-1))
        weights = jnp.where(sees, jnp.exp(scores - new_top[..., None]), 0.0)  # [B,K,G,T,S']
        rescale = jnp.exp(top - new_top)
        weights_v = weights.astype(v.dtype).reshape(B, K, G * T, -1)
        weighted = attention_product("bkqs,bksh->bkqh", weights_v, v, plain)
        weighted = weighted.reshape(B, K, G, T, H)
        return new_top, total * rescale + weights.sum(-1), out * rescale[..., None] + weighted

    def read_block(i, carry):
        start = jnp.minimum(i * block, S - block)  # the last block may overlap the one before
        k = jax.lax.dynamic_slice_in_dim(k_cache, start, block, axis=2)
        v = jax.lax.dynamic_slice_in_dim(v_cache, start, block, axis=2)
        slots = jnp.broadcast_to(start + jnp.arange(block), (B, block))
        fresh = (slots >= i * block) & (slots < reads.lengths[:, None])  # [B,S']
        return add(carry, k, v, fresh[:, None, :] & sees_within_window(slots))

    carry = (
        jnp.full((B, K, G, T), low, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
        jnp.zeros((B, K, G, T, H), jnp.float32),
    )
    first = 0  # with a window, the blocks wholly behind every query's window are skipped
    if reads.window:
        first = jnp.maximum(reads.positions.min() - reads.window + 1, 0) // block
    last = -(-reads.lengths.max() // block)
    carry = jax.lax.fori_loop(first, last, read_block, carry)
    carry = add(carry, k_new, v_new, reads.new_mask & sees_within_window(reads.positions))
    _, total, out = carry
    out = (out / total[..., None]).astype(v_new.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N * H)
