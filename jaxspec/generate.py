"""Autoregressive generation: bucketed prefill, then one jit-compiled step per token.

Compiled executables are cached per (batch, prompt bucket, cache length), compiled ahead
of time, so timings never include compilation and decode steps never recompile.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import KVCache, advance, causal_mask, init_cache
from jaxspec.llama import forward
from jaxspec.sampling import Sampling, position_keys, select_tokens

MIN_PROMPT_BUCKET = 16
MIN_CACHE_LEN = 128


def bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def prefill(params, cfg: LlamaConfig, sampling: Sampling, tokens, lengths, cache: KVCache, key):
    """tokens [B,P] right-padded, lengths [B] real prompt lengths -> first new tokens [B]."""
    B, P = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(P), (B, P))
    logits, cache, _ = forward(params, cfg, tokens, positions, cache, causal_mask(B, P))
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,V]
    cache = advance(cache, lengths)
    return select_tokens(last, position_keys(key, lengths), sampling), cache


@partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def decode_step(params, cfg: LlamaConfig, sampling: Sampling, tokens, cache: KVCache, key):
    """tokens [B] at positions cache.lengths -> the following tokens [B]."""
    B = tokens.shape[0]
    positions = cache.lengths[:, None]
    logits, cache, _ = forward(params, cfg, tokens[:, None], positions, cache, causal_mask(B, 1))
    cache = advance(cache, 1)
    return select_tokens(logits[:, 0], position_keys(key, cache.lengths), sampling), cache


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only, EOS included when reached
    steps: int  # forward passes that produced tokens (prefill included)
    prefill_s: float
    decode_s: float
    compile_s: float  # compilation done for this call (0 once warm)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)


class ARGenerator:
    """Plain autoregressive decoding of one prompt at a time (batch 1)."""

    def __init__(self, cfg: LlamaConfig, params, sampling: Sampling = Sampling(), max_len=None):
        self.cfg, self.params, self.sampling = cfg, params, sampling
        self.max_len = max_len or cfg.max_position
        self._compiled: dict[tuple, Callable] = {}

    def cache_len(self, prompt_len: int, max_new_tokens: int) -> int:
        if prompt_len == 0:
            raise JaxspecError("empty prompt: pass some text (or token ids) to generate from")
        if max_new_tokens < 1:
            raise JaxspecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        needed = prompt_len + max_new_tokens
        if needed > self.max_len:
            raise JaxspecError(
                f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds the "
                f"cache of {self.max_len} positions; shorten the prompt or lower --max-new-tokens"
            )
        return min(bucket(needed, MIN_CACHE_LEN), self.max_len)

    def _compiled_fn(self, name: str, fn, shape_key: tuple, *args):
        """AOT-compiled `fn` for one shape bucket; returns (executable, compile seconds)."""
        key = (name, *shape_key)
        if key in self._compiled:
            return self._compiled[key], 0.0
        start = time.perf_counter()
        exe = fn.lower(args[0], self.cfg, self.sampling, *args[1:]).compile()
        self._compiled[key] = exe
        return exe, time.perf_counter() - start

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        P = len(prompt_ids)
        S = self.cache_len(P, max_new_tokens)
        Pb = min(bucket(P, MIN_PROMPT_BUCKET), S)
        tokens = np.zeros((1, Pb), np.int32)
        tokens[0, :P] = prompt_ids
        dtype = jax.tree.leaves(self.params)[0].dtype
        cache = init_cache(self.cfg, 1, S, dtype)
        key = jax.random.key(seed)
        lengths = jnp.array([P], jnp.int32)
        run_prefill, c1 = self._compiled_fn(
            "prefill", prefill, (Pb, S), self.params, tokens, lengths, cache, key
        )
        first = jnp.zeros((1,), jnp.int32)
        run_step, c2 = self._compiled_fn("decode", decode_step, (S,), self.params, first, cache, key)

        eos = set(self.cfg.eos_token_ids)
        start = time.perf_counter()
        token, cache = run_prefill(self.params, tokens, lengths, cache, key)
        out = [int(token[0])]
        prefill_s = time.perf_counter() - start
        if on_tokens:
            on_tokens(out[-1:])
        start = time.perf_counter()
        while len(out) < max_new_tokens and out[-1] not in eos:
            token, cache = run_step(self.params, token, cache, key)
            out.append(int(token[0]))
            if on_tokens:
                on_tokens(out[-1:])
        decode_s = time.perf_counter() - start
        out = out[:max_new_tokens]
        return GenerationResult(list(prompt_ids), out, len(out), prefill_s, decode_s, c1 + c2)
