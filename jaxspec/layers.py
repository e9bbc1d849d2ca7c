"""Llama building blocks: RMSNorm, RoPE (HF split-half convention), SwiGLU, attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig, RopeScaling


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


# XLA:CPU picks its matmul kernel by row count; 16-bit products with >= 3 rows and a
# float32 result run on one AMX/AVX512-BF16 kernel whose rows do not depend on how many
# are computed. One or two 16-bit rows fall to other kernels (one row: a loop ~10x slower).
MIN_16BIT_ROWS = 3


def dense(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x [...,in] times w [in,out] (w [out,in] when transposed) -> [...,out] float32,
    accumulated in float32. With 16-bit weights, x is cast to their dtype and padded to
    MIN_16BIT_ROWS rows, so a row's result is the same bits whether it is computed alone
    (AR) or among a tree's (verify)."""
    rows = x.reshape(-1, x.shape[-1])  # [R,in]
    n = rows.shape[0]
    if jnp.dtype(w.dtype).itemsize == 2:
        rows = rows.astype(w.dtype)
        if n < MIN_16BIT_ROWS:
            rows = jnp.concatenate([rows, jnp.zeros((MIN_16BIT_ROWS - n, rows.shape[1]), w.dtype)])
    spec = "ri,oi->ro" if transposed else "ri,io->ro"
    y = jnp.einsum(spec, rows, w, preferred_element_type=jnp.float32)[:n]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def swiglu_mlp(x: jax.Array, linear) -> jax.Array:
    """x [B,T,D] -> [B,T,D]: down(silu(gate(x)) * up(x)); linear(x, name) applies a weight."""
    return linear(jax.nn.silu(linear(x, "gate_proj")) * linear(x, "up_proj"), "down_proj")


def attention(q, k_cache, v_cache, k_new, v_new, mask):
    """Grouped-query attention over [committed cache | new tokens], one softmax over both.

    q [B,T,N,H]; k/v_cache [B,K,S,H] or None (no context: a prefill); k/v_new [B,K,T,H];
    mask [B,T,S+T] (True = may attend) -> [B,T,N*H]. Query heads are grouped per kv head
    as rows q = (g, t).
    """
    B, T, N, H = q.shape
    K = k_new.shape[1]
    G = N // K
    blocks = [(k_new, v_new)] if k_cache is None else [(k_cache, v_cache), (k_new, v_new)]
    q = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    scores = jnp.concatenate(
        [
            jnp.einsum("bkqh,bksh->bkqs", q, k, preferred_element_type=jnp.float32)
            for k, _ in blocks
        ],
        axis=-1,
    ).reshape(B, K, G, T, -1) / math.sqrt(H)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_new.dtype).reshape(B, K, G * T, -1)
    out, start = 0.0, 0
    for _, v in blocks:
        part = probs[..., start : start + v.shape[2]]
        out = out + jnp.einsum("bkqs,bksh->bkqh", part, v, preferred_element_type=jnp.float32)
        start += v.shape[2]
    out = out.astype(v_new.dtype)
    return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N * H)
