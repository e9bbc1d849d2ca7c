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
from jaxspec.kv_cache import KVCache, causal_mask, commit, init_cache
from jaxspec.llama import embed, forward, lm_logits, run_layers
from jaxspec.sampling import Sampling, position_keys, select_tokens

MIN_PROMPT_BUCKET = 16
MIN_CACHE_LEN = 128


def bucket(n: int, minimum: int) -> int:
    """Smallest size >= max(n, minimum) on the ladder 16, 24, 32, 48, 64, 96, ... (2^k and
    1.5 * 2^k): at most a third of a bucket is padding, and few shapes ever compile."""
    n = max(n, minimum)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 and power >= 8 else power


@partial(jax.jit, static_argnames=("cfg", "sampling"))
def prefill(params, tokens, lengths, cache: KVCache, key, *, cfg: LlamaConfig, sampling: Sampling):
    """tokens [B,P] right-padded, lengths [B] real prompt lengths -> first new tokens [B],
    the prompt's KVBlock (commit `lengths` of it)."""
    B, P = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(P), (B, P))
    h, block, _ = run_layers(
        params, cfg, embed(params, tokens), positions, cache, causal_mask(B, P)
    )
    h_last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)  # [B,1,D]
    last = lm_logits(params, cfg, h_last)[:, 0]  # [B,V]: no vocab projection of the padding
    return select_tokens(last, position_keys(key, lengths), sampling), block


@partial(jax.jit, static_argnames=("cfg", "sampling"))
def decode_step(params, tokens, cache: KVCache, key, *, cfg: LlamaConfig, sampling: Sampling):
    """tokens [B] at positions cache.lengths -> the following tokens [B], their KVBlock."""
    B = tokens.shape[0]
    positions = cache.lengths[:, None]
    logits, block, _ = forward(params, cfg, tokens[:, None], positions, cache, causal_mask(B, 1))
    return select_tokens(logits[:, 0], position_keys(key, cache.lengths + 1), sampling), block


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

    def __init__(self, cfg: LlamaConfig, params, sampling: Sampling | None = None, max_len=None):
        self.cfg, self.params, self.sampling = cfg, params, sampling or Sampling()
        self.max_len = max_len or cfg.max_position
        self._executables: dict[tuple, Callable] = {}

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

    def _compiled(self, name: str, shape_key: tuple, jitted, *args, **static):
        """AOT-compiled `jitted` for one shape bucket -> (executable, compile seconds)."""
        key = (name, *shape_key)
        if key in self._executables:
            return self._executables[key], 0.0
        start = time.perf_counter()
        self._executables[key] = jitted.lower(*args, **static).compile()
        return self._executables[key], time.perf_counter() - start

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
        model = dict(cfg=self.cfg, sampling=self.sampling)
        prefill_args = (self.params, tokens, lengths, cache, key)
        run_prefill, c1 = self._compiled("prefill", (Pb, S), prefill, *prefill_args, **model)
        token = jnp.zeros((1,), jnp.int32)
        step_args = (self.params, token, cache, key)
        run_step, c2 = self._compiled("decode", (S,), decode_step, *step_args, **model)
        _, prompt_block = jax.eval_shape(partial(prefill, **model), *prefill_args)
        _, step_block = jax.eval_shape(partial(decode_step, **model), *step_args)
        commit_prompt, c3 = self._compiled("commit", (Pb, S), commit, cache, prompt_block, lengths)
        commit_step, c4 = self._compiled("commit", (1, S), commit, cache, step_block, lengths)

        eos = set(self.cfg.eos_token_ids)
        start = time.perf_counter()
        token, block = run_prefill(self.params, tokens, lengths, cache, key)
        cache = commit_prompt(cache, block, lengths)
        out = [int(token[0])]
        prefill_s = time.perf_counter() - start
        if on_tokens:
            on_tokens(out[-1:])
        one = jnp.ones((1,), jnp.int32)
        start = time.perf_counter()
        while len(out) < max_new_tokens and out[-1] not in eos:
            token, block = run_step(self.params, token, cache, key)
            cache = commit_step(cache, block, one)
            out.append(int(token[0]))
            if on_tokens:
                on_tokens(out[-1:])
        decode_s = time.perf_counter() - start
        out = out[:max_new_tokens]
        compile_s = c1 + c2 + c3 + c4
        return GenerationResult(list(prompt_ids), out, len(out), prefill_s, decode_s, compile_s)
