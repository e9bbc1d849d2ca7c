"""Token selection: greedy, or sampling from the temperature/top-k/top-p warped distribution.

`warped_logprobs` is *the model's distribution* that lossless speculative sampling must
reproduce exactly, so every decoder samples through it.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError, is_whole, option

NEG_INF = jnp.finfo(jnp.float32).min
NUCLEUS_CANDIDATES = (256, 4096)  # top_p alone: the nucleus is sought among this many tokens


def check_seed(seed) -> int:
    """A seed jax.random.key takes whole: an integer in [0, 2**32) (without 64-bit mode it
    keeps only the low 32 bits, so larger seeds would repeat smaller ones' samples)."""
    if not is_whole(seed) or not 0 <= seed < 2**32:
        raise JaxspecError(f"seed must be an integer from 0 to 2**32 - 1, got {seed!r}")
    return int(seed)


# logits are divided by the temperature in float32: its normal numbers (smaller ones are
# flushed to zero)
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
MAX_TEMPERATURE = float(np.finfo(np.float32).max)

# a Sampling field -> (the types it takes, its Python type, what an error calls it)
FIELD_KINDS = {
    "temperature": (numbers.Real, float, "a number"),
    "top_k": (numbers.Integral, int, "an integer"),
    "top_p": (numbers.Real, float, "a number"),
    "typical": ((bool, np.bool_), bool, "True or False"),
}


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
        for name, (kind, make, what) in FIELD_KINDS.items():
            value = getattr(self, name)
            flag = isinstance(value, (bool, np.bool_))
            if not isinstance(value, kind) or (flag and make is not bool):
                raise JaxspecError(f"{option(name)} must be {what}, got {value!r}")
            object.__setattr__(self, name, make(value))  # numpy scalars as Python's
        t = self.temperature
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):  # (NaN fails too)
            raise JaxspecError(
                f"{option('temperature')} must be 0 (greedy) or from {MIN_TEMPERATURE:.3g} to "
                f"{MAX_TEMPERATURE:.3g}, got {t}"
            )
        if not 0 < self.top_p <= 1:
            raise JaxspecError(f"{option('top_p')} must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise JaxspecError(f"{option('top_k')} must be >= 0, got {self.top_k}")
        if self.typical and self.temperature == 0:
            raise JaxspecError(
                f"{option('typical')} needs sampling: set {option('temperature')} > 0"
            )
        cut = "top_k" if self.top_k else "top_p" if self.top_p < 1 else None
        if cut and self.temperature == 0:
            raise JaxspecError(
                f"{option(cut)} {getattr(self, cut)} applies only when sampling: set "
                f"{option('temperature')} > 0, or drop it for greedy decoding"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocabulary(self, vocab_size: int) -> None:
        if self.top_k > vocab_size:
            raise JaxspecError(
                f"{option('top_k')} {self.top_k} exceeds the vocabulary ({vocab_size} tokens); "
                f"use at most {vocab_size}, or 0 for no top-k cut"
            )


def warped_logprobs(logits: jax.Array, s: Sampling) -> jax.Array:
    """logits [..., V] -> log-probabilities [..., V], -inf outside the top-k/top-p support.

    top-k keeps the k tokens jax.lax.top_k returns (the lower id first among equal logits);
    the nucleus is then taken among them, so only k values are sorted, not V: on XLA:CPU a
    verify step's [T, V] sort can cost more than its forward, hence also `_keep_nucleus`."""
    logits = logits.astype(jnp.float32)
    # shifted to a max of 0 before dividing: a tiny temperature then gives -inf, never +inf
    logits = (logits - logits.max(-1, keepdims=True)) / s.temperature
    if s.top_k:
        values, ids = jax.lax.top_k(logits, s.top_k)  # [..., k], descending
        if s.top_p < 1:
            keep = nucleus(jax.nn.softmax(values, axis=-1), s.top_p)
            values = jnp.where(keep, values, NEG_INF)
        logits = _scatter(values, ids, like=logits)
    elif s.top_p < 1:
        logits = _keep_nucleus(logits, s.top_p)
    return jax.nn.log_softmax(logits, axis=-1)


def _scatter(values: jax.Array, ids: jax.Array, like: jax.Array) -> jax.Array:
    """values, ids [..., n] -> [..., V] holding values at ids and -inf elsewhere."""
    return jnp.put_along_axis(jnp.full_like(like, NEG_INF), ids, values, axis=-1, inplace=False)


def _keep_nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """logits [..., V] -> the same with -inf outside each row's nucleus (exact).

    GPUs and TPUs sort the whole [..., V] block at once. XLA:CPU sorts a large vocabulary
    slowly, so there, row by row, the nucleus is sought among the top
    NUCLEUS_CANDIDATES tokens (only they are sorted, by jax.lax.top_k), then among more,
    and the whole row is sorted only when its nucleus is wider still (a flat row at high
    temperature). The choice is the lowering platform's (a program exported for cuda or
    tpu from a CPU host carries the sorting path), not the host's."""
    return jax.lax.platform_dependent(
        logits,
        cpu=functools.partial(_candidate_nucleus, top_p=top_p),
        default=functools.partial(_sorted_nucleus, top_p=top_p),
    )


def _candidate_nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """_keep_nucleus row by row among growing top-k candidate sets (the CPU path)."""
    V = logits.shape[-1]
    sizes = tuple(n for n in NUCLEUS_CANDIDATES if n < V)
    rows = logits.reshape(-1, V)
    kept = jax.lax.map(lambda row: _row_nucleus(row, jax.nn.logsumexp(row), top_p, sizes), rows)
    return kept.reshape(logits.shape)


def _sorted_nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """logits [..., V] -> -inf outside the nucleus, by sorting all V of each row."""
    order = jnp.argsort(-logits, axis=-1)  # stable: lower id first among equals, as top_k
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    keep = nucleus(jax.nn.softmax(sorted_logits, axis=-1), top_p)
    keep = jnp.put_along_axis(jnp.zeros_like(keep), order, keep, axis=-1, inplace=False)
    return jnp.where(keep, logits, NEG_INF)


def _row_nucleus(row: jax.Array, log_total: jax.Array, top_p: float, sizes) -> jax.Array:
    """row [V] -> row with -inf outside its nucleus, sought among its top sizes[0] tokens;
    when it keeps all of them (the mass before the last is below top_p, so the nucleus may
    go on past it), among the next size, and at the end among all V."""
    if not sizes:
        return _sorted_nucleus(row, top_p)
    values, ids = jax.lax.top_k(row, sizes[0])  # [n], descending
    keep = nucleus(jnp.exp(values - log_total), top_p)
    return jax.lax.cond(
        keep[-1],
        lambda row: _row_nucleus(row, log_total, top_p, sizes[1:]),
        lambda row: _scatter(jnp.where(keep, values, NEG_INF), ids, like=row),
        row,
    )


def nucleus(sorted_probs: jax.Array, top_p: float) -> jax.Array:
    """sorted_probs [..., n] descending -> keep [..., n]: a token stays while the mass
    strictly before it is below top_p (the first always)."""
    return (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p


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
