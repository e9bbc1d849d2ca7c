"""PPD: predictive pipelined decoding, exact greedy decoding over k+1 stages: devices, or
groups of `model_split` devices that each hold the model split tensor-parallel (a data=1,
model=M mesh, jaxspec.mesh's layout).

Early prediction: the state after d̄ of the d layers, through an optional per-layer head
(ResBlock, zero-initialised, so no head = the untrained early exit) and then the model's
own final norm and lm_head, gives top-k guesses of the next token.

One round for the current token x (position n), with m = d - d̄ <= d̄:
  main device:  layers [s, d̄) of x (s = m when a sub-process handed x over, else 0)
                -> top-k early guesses c_1..c_k;
  concurrently: main runs layers [d̄, d) of x -> the next token y (greedy, the model's);
                sub-process j (device j) runs layers [0, m) of c_j at position n+1;
  then:         if y == c_j, sub-process j hands its state after m layers and its keys/
                values over, and the next round starts at layer m.
The next token is always the main device's own argmax, and a handed-over state is exactly
what the main device would have computed (same inputs, same single-token program), so
the output is identical to greedy decoding. The sub-processes keep a copy of the cache
for layers [0, m), updated with every committed token.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.config import LlamaConfig
from jaxspec.decode import PREFILL_CHUNK, checked_products, prefill_shape, prompt_chunks
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError, option
from jaxspec.generate import GenerationResult, cache_len, checked_max_len
from jaxspec.kv_cache import KVBlock, KVCache, causal_mask, commit, init_cache, prompt_reads
from jaxspec.layers import EXACT_ROUNDING, dense
from jaxspec.llama import embed, lm_logits, plain_products, run_layers
from jaxspec.mesh import check_divides, make_mesh, table_specs
from jaxspec.mesh import place as place_by_table


def early_logits(params, cfg: LlamaConfig, head, h: jax.Array) -> jax.Array:
    """h [...,D] state after d̄ layers -> early next-token logits [...,V]; head None (the
    untrained early exit) or {"w" [D,D], "b" [D]}: h + SiLU(h w + b) first."""
    if head is not None:
        h = h + jax.nn.silu(dense(h, head["w"]) + head["b"]).astype(h.dtype)
    return lm_logits(params, cfg, h)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PpdSettings(DrafterSettings):
    """`layers`: the early-prediction layers with a trained head; `default_layer`: the one
    used when none is asked for (None: half the depth, rounded up)."""

    layers: tuple[int, ...] = ()
    default_layer: int | None = None


def head_name(layer: int) -> str:
    """The key of layer's head in a PPD drafter's params (not a bare number: drafter files
    read all-digit keys back as list indices)."""
    return f"layer{layer}"


def check_settings(cfg: LlamaConfig, k: int, layer: int) -> None:
    if not 1 <= layer < cfg.n_layers:
        raise JaxspecError(f"{option('ppd_layer')} must be in 1..{cfg.n_layers - 1}, got {layer}")
    if 2 * layer < cfg.n_layers:
        raise JaxspecError(
            f"{option('ppd_layer')} {layer} is below half the depth ({cfg.n_layers} layers): PPD "
            f"needs d_bar >= d/2, use {(cfg.n_layers + 1) // 2} or more"
        )
    if k < 1:
        raise JaxspecError(f"{option('ppd_k')} must be >= 1, got {k}")


def stages(devices: list, model_split: int) -> list:
    """The devices as PPD stages: each device (model_split 1), else each run of model_split
    devices as a data=1,model=model_split mesh."""
    if model_split == 1:
        return list(devices)
    if len(devices) < model_split:
        raise JaxspecError(f"ppd on model={model_split} needs at least {model_split} devices, "
                           f"{len(devices)} found")  # fmt: skip
    return [
        make_mesh({"model": model_split}, devices[i : i + model_split])
        for i in range(0, len(devices) - model_split + 1, model_split)
    ]


def place(devices: list, k: int) -> tuple[object, list]:
    """-> (main stage, the k sub-processes' stages), from a list of stages (devices or
    meshes): one each when there are k + 1; with fewer, the sub-processes share devices[1:]
    in turn (all of them devices[0] when it is the only one), which computes the same
    tokens without the pipeline's parallelism, and says so in a warning."""
    if len(devices) > k:
        return devices[0], devices[1 : k + 1]
    per = devices[0].size if isinstance(devices[0], Mesh) else 1
    what = "device(s)" if per == 1 else f"stage(s) of {per} devices"
    warnings.warn(
        f"PPD with k={k} runs its {k} sub-processes on {max(len(devices) - 1, 1)} shared "
        f"{what} ({len(devices)} found, {k + 1} wanted): the same tokens, without the "
        f"pipeline's parallelism; on CPU set XLA_FLAGS="
        f"--xla_force_host_platform_device_count={(k + 1) * per} before jax starts",
        RuntimeWarning,
        stacklevel=3,
    )
    pool = devices[1:] or devices[:1]
    return devices[0], [pool[j % len(pool)] for j in range(k)]


def _put(x, stage):
    """Arrays (a cache, a KVBlock, states, tokens) on a stage: a device, or a mesh where
    keys/values [B,K,T,H] split by kv heads over `model` and the rest is replicated."""
    if not isinstance(stage, Mesh):
        return jax.device_put(x, stage)
    kv, whole = NamedSharding(stage, P(None, "model", None, None)), NamedSharding(stage, P())
    return jax.tree.map(lambda a: jax.device_put(a, kv if np.ndim(a) == 4 else whole), x)


def _put_params(params, cfg: LlamaConfig, stage):
    """Weights on a stage: a device, or split over a mesh by the parameter table."""
    if not isinstance(stage, Mesh):
        return jax.device_put(params, stage)
    return place_by_table(params, table_specs(cfg, params), stage)


@partial(jax.jit, static_argnames=("cfg", "start", "stop"), compiler_options=EXACT_ROUNDING)
def _layers(params, cache, h, position, *, cfg, start, stop):
    """One token's state h [1,1,D] at position [1] through layers [start, stop) against the
    cache -> (state, KVBlock of those layers)."""
    h, block, _ = run_layers(params, cfg, h, position[:, None], cache, causal_mask(1, 1),
                             start, stop)  # fmt: skip
    return h, block


@partial(jax.jit, static_argnames=("cfg", "k"), compiler_options=EXACT_ROUNDING)
def _early_top(params, head, h, *, cfg, k):
    return jax.lax.top_k(early_logits(params, cfg, head, h[:, 0]), k)[1][0].astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg",), compiler_options=EXACT_ROUNDING)
def _next_token(params, h, *, cfg):
    return jnp.argmax(lm_logits(params, cfg, h)[:, 0], -1).astype(jnp.int32)


@partial(jax.jit, compiler_options=EXACT_ROUNDING)
def _embed_token(params, token):
    return embed(params, token.reshape(1, 1))


@partial(jax.jit, static_argnames=("cfg",), compiler_options=EXACT_ROUNDING)
def _prefill(params, tokens, length, cache=None, *, cfg):
    """tokens [1,P] (the first `length` [1] real), after the cache's when one is given (a
    long prompt's last chunk) -> (the first new token [1], the tokens' KVBlock)."""
    B, P = tokens.shape
    positions = jnp.arange(P)[None] if cache is None else cache.lengths[:, None] + jnp.arange(P)
    cache = prompt_reads(cache, P)
    h, block, _ = run_layers(params, cfg, embed(params, tokens), positions, cache,
                             causal_mask(B, P))  # fmt: skip
    last = jnp.take_along_axis(h, (length - 1)[:, None, None], axis=1)
    return jnp.argmax(lm_logits(params, cfg, last)[:, 0], -1).astype(jnp.int32), block


@partial(
    jax.jit, static_argnames=("cfg",), compiler_options=EXACT_ROUNDING, donate_argnames=("cache",)
)
def _extend(params, cache, tokens, count, *, cfg):
    """A chunk of a long prompt, as SpeculativeGenerator prefills one: tokens [1,C] (the
    first count [1] real) after the cache's -> the cache with them committed."""
    C = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(C)
    _, block, _ = run_layers(params, cfg, embed(params, tokens), positions,
                             prompt_reads(cache, C), causal_mask(1, C))  # fmt: skip
    return commit(cache, block, count)


def _lower(block: KVBlock, m: int) -> KVBlock:
    return KVBlock(block.keys[:m], block.values[:m])


def _lower_cache(cache: KVCache, m: int) -> KVCache:
    """A copy of the cache's first m layers (a sub-process's own buffers)."""
    return jax.tree.map(jnp.copy, KVCache(cache.keys[:m], cache.values[:m], cache.lengths))


@dataclasses.dataclass
class PpdStats:
    matches: list[bool]  # per round after the first: was the next token an early guess?


@dataclasses.dataclass
class _Pipeline:
    """One generation's state between rounds: the main cache (layers [0,d)) and the
    sub-processes' (layers [0,m)), the current token [1] (not yet in the caches) and what
    a sub-process handed over for it (state after m layers [1,1,D], KVBlock of [0,m)) or
    None."""

    cache: KVCache
    sub_caches: list[KVCache]
    token: jax.Array
    handed: tuple[jax.Array, KVBlock] | None = None


class PpdGenerator:
    """Greedy generation with PPD on devices[0] (main) and devices[1..k] (sub-processes;
    shared when there are fewer, see `place`); with model_split M, on stages of M devices
    each holding the model tensor-parallel (devices[0:M] the main stage, and so on).

    Before a prompt bucket and cache length are first timed, every program of a generation
    (per device) is compiled and run once on throwaway inputs, as SpeculativeGenerator does:
    timings exclude compilation, which the result reports as compile_s (0 once warm).
    `seed` is accepted for the generators' common interface; greedy decoding ignores it.
    """

    def __init__(self, cfg, params, k: int = 3, layer: int | None = None, head=None,
                 max_len: int | None = None, devices=None, model_split: int = 1,
                 products: str | None = None, prefill_chunk: int | None = None):  # fmt: skip
        devices = list(devices or jax.devices())
        products = checked_products(products)
        layer = layer if layer is not None else (cfg.n_layers + 1) // 2
        check_settings(cfg, k, layer)
        self.cfg, self.k, self.layer, self.head = cfg, k, layer, head
        self.m = cfg.n_layers - layer
        self.max_len = checked_max_len(max_len, cfg.max_position)
        self.main, self.subs = place(stages(devices, model_split), k)
        if model_split > 1:
            check_divides(cfg, self.main)
        # Placed first (the parameter table reads plain arrays), then multiplied as
        # SpeculativeGenerator multiplies: AR's prefill and steps, bit for bit.
        plain = plain_products if products == "plain" else lambda placed: placed
        self.params = plain(_put_params(params, cfg, self.main))
        self.prefill_params = (
            plain_products(self.params) if products == "plain-prefill" else self.params
        )
        lower = {**params, "layers": params["layers"][: self.m]}
        self.sub_params = [plain(_put_params(lower, cfg, d)) for d in self.subs]
        self.head_main = None if head is None else _put(head, self.main)
        self.last_stats: PpdStats | None = None
        self._warm: set[tuple] = set()  # (prompt bucket or chunk, cache length, chunked) run
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK.get(jax.default_backend(), 2048)
        self.min_prompt_len = 0  # sized as for prompts of at least this many tokens

    def lowerings(self, prompt_bucket: int, cache_len: int) -> dict[str, tuple]:
        """The jitted programs of a generation with this prompt bucket and cache length ->
        name: (program, arguments as ShapeDtypeStructs, static keywords), for lowering."""
        cfg, m, dbar = self.cfg, self.m, self.layer
        # The jitted function's own body: a jit with compiler options cannot be traced inside
        # another trace, eval_shape's included.
        shape = lambda f, *a, **kw: jax.eval_shape(partial(f.__wrapped__, **kw), *a)  # noqa: E731
        cache = jax.eval_shape(lambda: init_cache(cfg, 1, cache_len))
        sub_cfg = dataclasses.replace(cfg, n_layers=m)
        sub_cache = jax.eval_shape(lambda: init_cache(sub_cfg, 1, cache_len))
        tokens = jax.ShapeDtypeStruct((1, prompt_bucket), jnp.int32)
        one = jax.ShapeDtypeStruct((1,), jnp.int32)
        token, block = shape(_prefill, self.prefill_params, tokens, one, cfg=cfg)
        h = shape(_embed_token, self.params, token)
        lower = {**self.params, "layers": self.params["layers"][:m]}
        layers = lambda p, c, a, b: (_layers, (p, c, h, one), dict(cfg=cfg, start=a, stop=b))  # noqa: E731
        return {
            "prefill": (_prefill, (self.prefill_params, tokens, one), dict(cfg=cfg)),
            "extend_prompt": (_extend, (self.prefill_params, cache, tokens, one), dict(cfg=cfg)),
            "prefill_last_chunk": (_prefill, (self.prefill_params, tokens, one, cache),
                                   dict(cfg=cfg)),
            "commit_prompt": (commit, (cache, block, one), {}),
            "embed": (_embed_token, (self.params, token), {}),
            "layers_to_early_exit": layers(self.params, cache, 0, dbar),
            "layers_from_handover": layers(self.params, cache, m, dbar),
            "layers_after_early_exit": layers(self.params, cache, dbar, cfg.n_layers),
            "sub_process_layers": layers(lower, sub_cache, 0, m),
            "early_top": (_early_top, (self.params, self.head, h), dict(cfg=cfg, k=self.k)),
            "next_token": (_next_token, (self.params, h), dict(cfg=cfg)),
            "commit_round": (commit, (cache, shape(_layers, self.params, cache, h, one, cfg=cfg,
                                                   start=0, stop=cfg.n_layers)[1], one), {}),
        }  # fmt: skip

    def _start(self, prompt_ids: list[int], P: int, S: int, chunked: bool) -> _Pipeline:
        """Prefill the prompt into S-slot caches: padded to P tokens, or in P-token chunks
        (as SpeculativeGenerator does, so that AR's prompt and PPD's are the same bits)."""
        cfg, main = self.cfg, self.main
        cache = _put(init_cache(cfg, 1, S), main)
        if chunked:
            chunks, (tokens, tail) = prompt_chunks([prompt_ids], P)
            for chunk, count, _ in chunks:
                cache = _extend(self.prefill_params, cache, _put(chunk, main), _put(count, main),
                                cfg=cfg)  # fmt: skip
            length = jnp.asarray(tail)
        else:
            tokens = np.zeros((1, P), np.int32)
            tokens[0, : len(prompt_ids)] = prompt_ids
            length = jnp.asarray([len(prompt_ids)], jnp.int32)
        token, block = _prefill(self.prefill_params, _put(tokens, main), length,
                                cache if chunked else None, cfg=cfg)  # fmt: skip
        cache = commit(cache, block, length)
        sub_caches = [_put(_lower_cache(cache, self.m), d) for d in self.subs]
        return _Pipeline(cache, sub_caches, token)

    def _round(self, pipe: _Pipeline) -> tuple[int, np.ndarray, list]:
        """One round for pipe.token (module docstring); pipe moves on to the next token ->
        (its id, the k early guesses [k], each sub-process's (state, KVBlock) for its guess)."""
        cfg, m, dbar = self.cfg, self.m, self.layer
        cache, one = pipe.cache, jnp.ones((1,), jnp.int32)
        position = cache.lengths
        if pipe.handed is None:
            h = _embed_token(self.params, pipe.token)
            h, block_a = _layers(self.params, cache, h, position, cfg=cfg, start=0, stop=dbar)
            low = _lower(block_a, m)
            mid = KVBlock(block_a.keys[m:], block_a.values[m:])
        else:
            h, low = pipe.handed
            h, mid = _layers(self.params, cache, h, position, cfg=cfg, start=m, stop=dbar)
        guesses = _early_top(self.params, self.head_main, h, cfg=cfg, k=self.k)
        # The sub-processes' caches gain the token's lower layers; then all k + 1 run.
        pipe.sub_caches = [
            commit(c, _put(low, d), _put(one, d))
            for c, d in zip(pipe.sub_caches, self.subs, strict=True)
        ]
        sub_runs = [
            _layers(p, c, _embed_token(p, _put(guesses[j], d)),
                    _put(position + 1, d), cfg=cfg, start=0, stop=m)
            for j, (p, c, d) in enumerate(zip(self.sub_params, pipe.sub_caches, self.subs,
                                              strict=True))
        ]  # fmt: skip
        h, top = _layers(self.params, cache, h, position, cfg=cfg, start=dbar, stop=cfg.n_layers)
        pipe.token = _next_token(self.params, h, cfg=cfg)
        full = KVBlock(low.keys + mid.keys + top.keys, low.values + mid.values + top.values)
        pipe.cache = commit(cache, _put(full, self.main), one)
        pipe.handed = None
        return int(pipe.token[0]), np.asarray(guesses), sub_runs

    def _warm_up(self, P: int, S: int, chunked: bool) -> float:
        """Compile and run once, on a throwaway prompt, every program that a generation with
        a P-token prompt bucket (or chunk) and an S-slot cache runs: a prefill, a round that
        starts at layer 0 and one that starts from a handed-over state -> seconds (0 if done
        before)."""
        if (P, S, chunked) in self._warm:
            return 0.0
        start = time.perf_counter()
        pipe = self._start([0] * (P + 1 if chunked else 1), P, S, chunked)
        _, _, sub_runs = self._round(pipe)
        pipe.handed = _put(sub_runs[0], self.main)
        self._round(pipe)
        jax.block_until_ready((pipe.cache, pipe.sub_caches))
        self._warm.add((P, S, chunked))
        return time.perf_counter() - start

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0,
                 on_tokens=None) -> GenerationResult:  # fmt: skip
        sized = max(len(prompt_ids), self.min_prompt_len)
        # A round writes its token's entries where AR's step does; a sub-process's guess
        # one position further is held beside the cache, not in it: no slot ahead.
        cache_len(len(prompt_ids), max_new_tokens, 0, self.max_len)
        S = cache_len(sized, max_new_tokens, 0, self.max_len)
        chunked, P, S = prefill_shape(len(prompt_ids), self.min_prompt_len, self.prefill_chunk, S)
        compile_s = self._warm_up(P, S, chunked)
        eos = set(self.cfg.eos_token_ids)

        start_time = time.perf_counter()
        pipe = self._start(prompt_ids, P, S, chunked)
        out = [int(pipe.token[0])]
        prefill_s = time.perf_counter() - start_time
        if on_tokens:
            on_tokens(out[:])
        matches: list[bool] = []
        start_time = time.perf_counter()
        while len(out) < max_new_tokens and out[-1] not in eos:
            next_id, guesses, sub_runs = self._round(pipe)
            hit = np.flatnonzero(guesses == next_id)
            matches.append(bool(hit.size))
            if hit.size:
                pipe.handed = _put(sub_runs[int(hit[0])], self.main)
            out.append(next_id)
            if on_tokens:
                on_tokens([next_id])
        decode_s = time.perf_counter() - start_time
        self.last_stats = PpdStats(matches)
        # A round emits one token (a hit on an early guess saves time, not tokens: see
        # last_stats.matches), so each round accepts 0 drafted tokens, as AR.
        accepted = [0] * (len(out) - 1)
        return GenerationResult(
            list(prompt_ids), out, len(out), prefill_s, decode_s, compile_s, accepted=accepted
        )

    def generate_batch(self, prompts, max_new_tokens, seed=0, on_tokens=None):
        """One prompt after the other (PPD pipelines a single sequence)."""
        stream = None
        results = []
        for row, prompt in enumerate(prompts):
            if on_tokens:
                stream = partial(on_tokens, row)
            results.append(self.generate(prompt, max_new_tokens, seed, stream))
        return results
