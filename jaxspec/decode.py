"""The generic speculative decoding loop: any drafter, any tree; AR is the empty tree.

Candidates: [B,T-1] tokens for a static tree, a topology.Draft (tokens, parents, depths)
for a dynamic one; the step reads the tree's shape from either (topology.tree_topology).

Each step is one compiled program: forward the tree [root = the newest token ; drafted
candidates] against the cache with the tree mask and depth positions, accept a path, and
let the drafter propose the next step's candidates from what the model just computed.
A second, donated program commits the accepted path's keys/values to the cache.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig
from jaxspec.drafters.base import Drafter, DraftInputs, Entered, NoDrafter
from jaxspec.errors import JaxspecError, option
from jaxspec.generate import (
    MIN_PROMPT_BUCKET,
    GenerationResult,
    bucket,
    cache_len,
    checked_max_len,
)
from jaxspec.kv_cache import KVCache, causal_mask, commit, init_cache, prompt_reads
from jaxspec.layers import EXACT_ROUNDING
from jaxspec.llama import (
    embed,
    final_norm,
    lm_logits,
    plain_products,
    run_layers,
    vocab_projection,
)
from jaxspec.mesh import Layout, as_mesh, check_divides, mesh_of, place, table_specs
from jaxspec.sampling import Sampling, check_seed, position_keys, select_tokens
from jaxspec.topology import tree_topology
from jaxspec.tree import DynamicTree, TreeSpec
from jaxspec.verify import (
    accept_greedy,
    accept_sampling,
    accept_typical,
    gather_path,
)

# Prompts longer than this are prefilled in chunks of this many tokens (one program per
# chunk size, whatever the prompt's length): a one-shot prefill of T tokens holds a
# [heads, T, T] float32 score tensor per layer, which a 32k prompt cannot fit anywhere.
# Per platform: on CPU 1024-token chunks prefill 2k-8k prompts fastest (BENCHMARKS.md,
# "Long prompts read the cache in blocks"); on an H200 2048-token chunks prefill an 8k
# prompt fastest, 4096 within noise, 1024 slower (BENCHMARKS.md, "fifth GPU run"). TPU takes
# the GPU's until a TPU is measured.
PREFILL_CHUNK = {"cpu": 1024, "gpu": 2048, "tpu": 2048}

# Verify rows + drafter rows projected together up to this many rows per batch row: on
# XLA:CPU a [rows, D] x [D, V] product costs about the same for a few rows as for one and
# grows slowly past that (BENCHMARKS.md, "forward cost vs new rows"), so one read of the
# [V, D] matrix beats two up to here.
FUSED_ROWS = 32

# How bfloat16 weights multiply (layers.dense): "exact" everywhere (float32-accurate, so a
# verify step's rows agree with AR's to float32 rounding); one bfloat16 pass, the
# attention's products included (layers.attention_product), in the prefill only
# ("plain-prefill": every method computes the prompt's rows exactly as AR's prefill does,
# so match_ar holds), or everywhere ("plain": whether greedy outputs still match AR is for
# the device campaign to measure).
PRODUCTS = ("exact", "plain-prefill", "plain")
# The default by backend: plain-prefill where the device campaign measured it faster with
# the same tokens (a GPU: BENCHMARKS.md, the first GPU run); exact elsewhere (TPU unmeasured).
DEFAULT_PRODUCTS = {"gpu": "plain-prefill"}


def default_products() -> str:
    return DEFAULT_PRODUCTS.get(jax.default_backend(), "exact")


def checked_products(products: str | None) -> str:
    """One of PRODUCTS (None: this backend's default), or a clear error."""
    products = products or default_products()
    if products not in PRODUCTS:
        raise JaxspecError(f"unknown products {products!r}; one of {', '.join(PRODUCTS)}")
    return products


def prefill_shape(prompt_len: int, min_prompt_len: int, chunk: int, S: int):
    """A prompt of prompt_len tokens (programs sized for at least min_prompt_len) and an
    S-slot cache -> (whether it is prefilled in chunks, the prefill's width: the prompt
    bucket or the chunk size, the cache length). Every generator prefills by it, so the
    same prompt is padded and split alike (the same bits) whatever decodes it."""
    if chunk < prompt_len:  # the last chunk is written whole, padding included:
        return True, chunk, max(S, -(-prompt_len // chunk) * chunk)  # room past the prompt
    width = max(prompt_len, min(min_prompt_len, chunk))
    return False, min(bucket(width, MIN_PROMPT_BUCKET), S), S


# On a mesh, each program's arguments and results by kind, which decides their shardings
# (`SpeculativeGenerator._sharding`): "placed" (weights, as the generator placed them),
# "host" (small per-row arrays the host writes or reads: replicated, so every process
# of a multi-host mesh holds them whole), "rows" [B,...] split over `data`, "key",
# "cache" (a KVCache), "block" (a KVBlock), "state" (the drafter's); and the argument
# each program donates.
SIGNATURES = {
    "prefill": (("placed", "placed", "host", "host", "key", "state", "cache"),
                ("host", "rows", "block", "state")),
    "step": (("placed", "placed", "cache", "host", "rows", "key", "state"),
             ("host", "host", "host", "rows", "block", "state")),
    "commit_prompt": (("cache", "block", "host"), "cache"),
    "commit_path": (("cache", "block", "host"), "cache"),
    "extend": (("placed", "placed", "cache", "host", "host", "host", "state"), ("block", "state")),
    "redraft": (("placed", "placed", "cache", "host"), "rows"),
}  # fmt: skip
DONATED = {"prefill": 5, "step": 6, "extend": 6, "commit_prompt": 0, "commit_path": 0}


def _collected_layers(drafter: Drafter, cfg: LlamaConfig) -> tuple[int, ...]:
    """The drafter's layers plus the last one (the model's own logits)."""
    return tuple(sorted(set(drafter.collect) | {cfg.n_layers}))


# The drafter's branch of the seed's key: no position reaches it, so a drafter that folds in
# rows or positions never draws with the randomness that samples and accepts tokens
# (sampling.position_keys folds positions into the same key).
DRAFT_KEY_BRANCH = 2**32 - 1


def _draft(drafter, params, drafter_params, tree, inputs: DraftInputs, key):
    """-> (candidates [B,T-1], the drafter's new state)."""
    state = drafter.advance(params, drafter_params, inputs)
    inputs = dataclasses.replace(inputs, state=state)
    draft_key = jax.random.fold_in(key, DRAFT_KEY_BRANCH)
    return drafter.propose(params, drafter_params, tree, inputs, draft_key), state


def check_tree_width(tree: TreeSpec, cfg: LlamaConfig) -> None:
    """A node's guesses are the top `tree.width` tokens of a distribution: at most V."""
    if tree.width > cfg.vocab_size:
        raise JaxspecError(
            f"{tree.label} takes the top {tree.width} guesses per node, more than the model's "
            f"vocabulary of {cfg.vocab_size} tokens; pick a tree with at most "
            f"{cfg.vocab_size} guesses per node"
        )


def step_bytes(cfg: LlamaConfig, n_nodes: int, batch: int, cache_len: int) -> int:
    """Rough peak bytes of a verify step over T = n_nodes tree nodes, batch B and an
    S = cache_len slot cache (counted too); activations and cache are float32. Of three
    stages whose big buffers are never live together the largest counts: attention, a layer
    at a time (scores and probabilities [B,N,T,S+T], the mask [B,T,S+T] bool), the MLP
    (gate, up and their product [B,T,F]), the logits [B,T,V]. Live throughout: the cache and
    the tree's new keys and values of every layer, [B,K,S+T,H] each. Close to what XLA:CPU
    plans for the step (tests/test_speculative.py)."""
    B, T, S = batch, n_nodes, cache_len
    attention = B * T * (S + T) * (2 * 4 * cfg.n_heads + 1)
    mlp = 4 * B * T * 3 * cfg.ffn_dim
    logits = 4 * B * T * cfg.vocab_size
    kv = 4 * 2 * cfg.n_layers * B * cfg.n_kv_heads * (S + T) * cfg.head_dim
    return max(attention, mlp, logits) + kv


def available_bytes() -> tuple[int, str]:
    """-> (bytes a generation may still allocate, where): this process's first device's
    limit less what is in use (the weights) on an accelerator, else the host's MemAvailable
    (its physical memory where /proc/meminfo is missing)."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.platform} device"
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host"  # kB
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host"


@partial(jax.jit, static_argnames=("cfg", "drafter"), donate_argnames=("state",))
def extend_prompt(params, drafter_params, cache, tokens, counts, following, state, *, cfg, drafter):
    """A chunk of a long prompt: tokens [B,C] (the first counts [B] valid; 0: the row's
    prompt is already in) after the cache's, followed by the prompt tokens `following` [B]
    -> the chunk's KVBlock (commit `counts` of it) and the drafter's state after it."""
    B, C = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(C)
    _, block, states = run_layers(
        params, cfg, embed(params, tokens), positions, prompt_reads(cache, C), causal_mask(B, C),
        collect=_collected_layers(drafter, cfg),
    )  # fmt: skip
    entered = Entered(tokens, cache.lengths, counts, states)
    inputs = DraftInputs({}, following, cache.lengths + counts, None, entered, state)
    return block, drafter.advance(params, drafter_params, inputs)


@partial(
    jax.jit, static_argnames=("cfg", "sampling", "tree", "drafter"), donate_argnames=("state",)
)
def prefill_and_draft(
    params, drafter_params, tokens, lengths, key, state, cache=None, *, cfg, sampling, tree,
    drafter,
):  # fmt: skip
    """tokens [B,P] right-padded, lengths [B] -> first token [B], candidates [B,T-1], the
    prompt's KVBlock (commit `lengths` of it), the drafter's state. With `cache`, the
    tokens follow the prompt part already in it (a long prompt's last chunk)."""
    B, P = tokens.shape
    start = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
    cache = prompt_reads(cache, P)
    positions = start[:, None] + jnp.arange(P)
    collect = _collected_layers(drafter, cfg)
    last = (lengths - 1)[:, None]  # [B,1]
    _, block, states, drafted = drafter.prefill_model(
        params, drafter_params, cfg, embed(params, tokens), positions, cache,
        causal_mask(B, P), last, collect, tree.max_depth,
    )  # fmt: skip
    entered = Entered(tokens, start, lengths, states)
    h_at = {i: jnp.take_along_axis(h, last[:, :, None], axis=1)[:, 0] for i, h in states.items()}
    last_logits = lm_logits(params, cfg, h_at[cfg.n_layers][:, None])[:, 0]
    position = start + lengths  # the first new token's
    current = select_tokens(last_logits, position_keys(key, position), sampling)
    drafted = None if drafted is None else drafted[:, 0]
    inputs = DraftInputs(h_at, current, position, drafted, entered, state)
    candidates, state = _draft(drafter, params, drafter_params, tree, inputs, key)
    return current, candidates, block, state


@partial(
    jax.jit, static_argnames=("cfg", "sampling", "tree", "drafter"), donate_argnames=("state",)
)
def speculative_step(
    params,
    drafter_params,
    cache: KVCache,
    current,
    candidates,
    key,
    state,
    *,
    cfg,
    sampling,
    tree,
    drafter,
):
    """One verify step -> emitted [B,D+1] (valid up to n_emitted [B]), the new root token
    [B], next candidates [B,T-1], the accepted path's KVBlock (commit n_emitted of it), the
    drafter's state."""
    B = current.shape[0]
    tokens, topo = tree_topology(current, candidates, tree)  # [B,T], the tree's shape
    positions = cache.lengths[:, None] + topo.depth
    mask = topo.mask
    collect = _collected_layers(drafter, cfg)
    every_node = jnp.broadcast_to(jnp.arange(tree.n_nodes), (B, tree.n_nodes))
    _, block, states, drafted = drafter.run_model(
        params, drafter_params, cfg, embed(params, tokens), positions, cache, mask, every_node,
        collect, tree.max_depth,
    )  # fmt: skip
    h = states[cfg.n_layers]
    rows = drafter.projected_rows(params, drafter_params, h, drafted, tree.max_depth)
    if rows is not None and tree.n_nodes * (1 + rows.shape[2]) <= FUSED_ROWS:
        x = jnp.concatenate([final_norm(params, cfg, h)[:, :, None], rows.astype(h.dtype)], 2)
        projected = vocab_projection(params, cfg, x)  # [B,T,1+R,V]
        logits, row_logits = projected[:, :, 0], projected[:, :, 1:]
    else:
        logits, row_logits = lm_logits(params, cfg, h), None  # [B,T,V]
    # Keyed by the first position drawn here, the root's next: the root's own key drew
    # the root (in the prefill, for a first step), and one key drawing both correlated
    # them (the draft's uniform was the first token's Gumbel noise).
    keys = position_keys(key, cache.lengths + 1)
    if sampling.greedy:
        nodes, n_accepted, bonus = accept_greedy(topo, tokens, logits)
    elif sampling.typical and tree.n_nodes > 1:  # nothing drafted (AR): plain sampling
        nodes, n_accepted, bonus = accept_typical(topo, tokens, logits, keys, sampling)
    else:
        nodes, n_accepted, bonus = accept_sampling(topo, tokens, logits, keys, sampling)
    # Emitted: the accepted drafted tokens, then the bonus token.
    path_tokens = jnp.take_along_axis(tokens, nodes, axis=1)  # [B,D+1], root first
    emitted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    slot = jnp.arange(tree.max_depth + 1)[None]
    emitted = jnp.where(slot == n_accepted[:, None], bonus[:, None], emitted)
    n_emitted = n_accepted + 1
    last = jnp.take_along_axis(nodes, n_accepted[:, None], axis=1)[:, 0]
    at_last = lambda x: jnp.take_along_axis(x, last.reshape((B,) + (1,) * (x.ndim - 1)), 1)[:, 0]  # noqa: E731
    h_at = {i: at_last(h) for i, h in states.items()}
    drafted = None if drafted is None else at_last(drafted)
    draft_logits = None if row_logits is None else at_last(row_logits)
    on_path = lambda x: jnp.take_along_axis(x, nodes[:, :, None], axis=1)  # noqa: E731
    entered = Entered(
        path_tokens, cache.lengths, n_emitted, {i: on_path(h) for i, h in states.items()}
    )
    position = cache.lengths + n_emitted
    inputs = DraftInputs(h_at, bonus, position, drafted, entered, state, draft_logits)
    candidates, state = _draft(drafter, params, drafter_params, tree, inputs, key)
    return emitted, n_emitted, bonus, candidates, gather_path(block, nodes), state


@partial(jax.jit, static_argnames=("tree", "drafter"))
def redraft(params, drafter_params, cache: KVCache, current, *, tree, drafter):
    """The drafter's own forward over the committed cache -> candidates [B,T-1]."""
    return drafter.draft_from_cache(params, drafter_params, cache, current, tree)


class SpeculativeGenerator:
    """Generation with a drafter and a tree (static, or chosen every step), one prompt or
    a batch.

    Executables are compiled ahead of time per (prompt bucket, cache length), so timings
    exclude compilation and steps never recompile.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        params,
        drafter: Drafter | None = None,
        drafter_params=None,
        tree: TreeSpec | None = None,
        sampling: Sampling | None = None,
        max_len: int | None = None,
        prefill_chunk: int | None = None,
        products: str | None = None,
        mesh=None,
    ):
        """prefill_chunk: prompts longer than this many tokens are prefilled in chunks of
        it (None: PREFILL_CHUNK for this backend); products: one of PRODUCTS (None:
        default_products()); mesh: a jax.sharding.Mesh (jaxspec.mesh) to decode on,
        tensor-parallel over its `model` axis and rows over `data` (params and drafter
        params are placed on it by the parameter table, `mesh.table_specs`, unless they
        already are); None: the mesh the params are placed on (load_model(mesh=...)), if
        any, else one device."""
        products = checked_products(products)
        mesh = mesh_of(params) if mesh is None else as_mesh(mesh)
        if mesh is not None:
            check_divides(cfg, mesh)
            params = place(params, table_specs(cfg, params), mesh)
            drafter_params = place(drafter_params, table_specs(cfg, drafter_params), mesh)
        params = plain_products(params) if products == "plain" else params
        self.prefill_params = plain_products(params) if products == "plain-prefill" else params
        self.cfg, self.params, self.mesh = cfg, params, mesh
        self.drafter = drafter or NoDrafter()
        self.drafter_params = drafter_params
        self.tree = self._checked_tree(tree or TreeSpec(()))
        self.sampling = sampling or Sampling()
        self.max_len = checked_max_len(max_len, cfg.max_position)
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK.get(jax.default_backend(), 2048)
        # Programs are sized as for prompts of at least this many tokens (no longer than a
        # chunk): one shape for prompts of many lengths, where compiles are slow (a GPU).
        self.min_prompt_len = 0
        check_tree_width(self.tree, cfg)
        self.drafter.check_tree(self.tree)
        self.drafter_state = None
        self._executables: dict[tuple, tuple[Callable, ...]] = {}
        self._compiling = threading.Lock()  # threads generating at once compile a key once
        self._makers: dict[tuple, Callable] = {}  # (kind, batch, cache_len): its maker on the mesh

    def _checked_tree(self, tree):
        """A dynamic tree needs a drafter that fills one (Drafter.draft_depth); its depth,
        unset, becomes the drafter's."""
        if not isinstance(tree, DynamicTree):
            return tree
        depth = self.drafter.draft_depth
        if depth is None:
            raise JaxspecError(
                f"{tree.label} needs a drafter that chooses its nodes each step (medusa, "
                "firp, chimera, eagle); this one drafts fixed trees: pick chain-N, comb-N-W "
                "or a searched tree"
            )
        return tree.at_depth(depth)

    @property
    def _static(self) -> dict:
        return dict(cfg=self.cfg, sampling=self.sampling, tree=self.tree, drafter=self.drafter)

    def cache_len(self, prompt_len: int, max_new_tokens: int) -> int:
        # A step may write its accepted path (up to max_depth + 1 slots) past the last token
        # kept, and a finished row commits one more step before the host sees it finished
        # (generate_batch).
        return cache_len(prompt_len, max_new_tokens, 2 * (self.tree.max_depth + 1), self.max_len)

    def _new_cache(self, batch: int, cache_len: int) -> KVCache:
        return self._created("cache", batch, cache_len)

    def _new_state(self, batch: int, cache_len: int):
        """The drafter's state for a generation (its arrays on the mesh, if any)."""
        return self._created("state", batch, cache_len)

    def _created(self, kind: str, batch: int, cache_len: int):
        """A new cache or drafter state (kind) for `batch` rows and `cache_len` slots, made
        where it lives: on a mesh each device makes only its own shards (nothing whole on
        one device first), by a program compiled once per (kind, batch, cache_len)."""

        def make(dp):
            if kind == "cache":
                return init_cache(self.cfg, batch, cache_len)
            return self.drafter.init_state(self.cfg, batch, cache_len, jnp.float32, dp)

        if self.mesh is None:
            return make(self.drafter_params)
        key = (kind, batch, cache_len)
        if key not in self._makers:
            shape = jax.eval_shape(make, self.drafter_params)
            shardings = self._sharding(kind, shape, Layout(self.mesh, batch))
            self._makers[key] = jax.jit(make, out_shardings=shardings)
        return self._makers[key](self.drafter_params)

    def _sharding(self, kind: str, value, layout: Layout):
        """The shardings of an argument or result of a SIGNATURES kind (`value`: it, or
        the argument it has the structure of)."""
        if value is None:
            return None
        if kind == "placed":
            return layout.placed(value)
        if kind == "cache":
            return layout.kv_tree(value)
        if kind == "state":
            return self.drafter.state_shardings(value, layout)
        return {"rows": layout.rows, "host": layout.replicated, "key": layout.replicated,
                "block": layout.kv}[kind]  # fmt: skip

    def _sharded(self, name: str, program: Callable, args: tuple, static: dict) -> Callable:
        """`program` with its static keywords, jitted for explicit shardings on the mesh:
        results come back where the next program expects them, so steps run from AOT
        executables as on one device; nothing is gathered that the layout splits."""
        kinds, results = SIGNATURES[name]
        layout = Layout(self.mesh, args[kinds.index("host")].shape[0])
        ins = tuple(self._sharding(k, a, layout) for k, a in zip(kinds, args, strict=True))
        like = {"cache": args[kinds.index("cache")] if "cache" in kinds else None,
                "state": args[kinds.index("state")] if "state" in kinds else None}  # fmt: skip
        one = isinstance(results, str)  # a single result
        outs = [self._sharding(k, like.get(k, 0), layout) for k in ([results] if one else results)]
        outs = outs[0] if one else tuple(outs)
        donate = (DONATED[name],) if name in DONATED else ()
        return jax.jit(
            partial(program, **static), in_shardings=ins, out_shardings=outs, donate_argnums=donate
        )

    def shapes(self, prompt_len: int, max_new_tokens: int) -> tuple[bool, int, int]:
        """What a request compiles for -> (whether its prompt is prefilled in chunks, the
        prefill's width: the prompt bucket or the chunk size, the cache length). Programs
        are compiled once per distinct value (and batch size)."""
        S = self.cache_len(max(prompt_len, self.min_prompt_len), max_new_tokens)
        return prefill_shape(prompt_len, self.min_prompt_len, self.prefill_chunk, S)

    def check_memory(self, batch: int, cache_len: int) -> None:
        """Refuse, before allocating, a step that would not fit in the memory available."""
        need = step_bytes(self.cfg, self.tree.n_nodes, batch, cache_len)
        need //= self.mesh.size if self.mesh is not None else 1  # split about evenly
        have, where = available_bytes()
        if need > have:
            raise JaxspecError(
                f"a verify step of {self.tree.label} with batch {batch} and a {cache_len}-slot "
                f"cache needs about {need / 1e9:.1f} GB, more than the {have / 1e9:.1f} GB "
                f"available ({where}); use a smaller tree, fewer prompts at once or a smaller "
                f"{option('max_new_tokens')}"
            )

    def lowerings(self, pre_args, cache: KVCache) -> dict[str, tuple[Callable, tuple, dict]]:
        """The jitted programs a generation with these prefill arguments and this cache
        runs -> name: (program, arguments, static keywords) to lower it with (arrays or
        ShapeDtypeStructs): prefill, step, commit_prompt, commit_path; extend (a long
        prompt's chunks) when the prefill follows a cache; redraft for drafters that draft
        from the cache."""
        static = self._static
        first, candidates, prompt_block, state = jax.eval_shape(
            partial(prefill_and_draft, **static), *pre_args
        )
        step_args = (self.params, self.drafter_params, cache, first, candidates, pre_args[4], state)
        *_, path_block, _ = jax.eval_shape(partial(speculative_step, **static), *step_args)
        lengths = pre_args[3]
        plan = {
            "prefill": (prefill_and_draft, pre_args, static),
            "step": (speculative_step, step_args, static),
            "commit_prompt": (commit, (cache, prompt_block, lengths), {}),
            "commit_path": (commit, (cache, path_block, lengths), {}),
        }
        if pre_args[6] is not None:
            chunk_args = (pre_args[0], self.drafter_params, cache, pre_args[2], lengths, lengths,
                          pre_args[5])  # fmt: skip
            plan["extend"] = (extend_prompt, chunk_args, dict(cfg=self.cfg, drafter=self.drafter))
        if self.drafter.drafts_from_cache:
            redraft_args = (self.params, self.drafter_params, cache, first)
            plan["redraft"] = (redraft, redraft_args, dict(tree=self.tree, drafter=self.drafter))
        if self.mesh is not None:
            plan = {
                name: (self._sharded(name, *entry), entry[1], {}) for name, entry in plan.items()
            }
        return plan

    def example_inputs(self, batch: int, prompt_bucket: int, cache_len: int, chunked=False):
        """(prefill arguments, cache) of a generation of `batch` prompts in a prompt_bucket
        (chunked: the last chunk of a long prompt, after a cache) and a cache_len-slot
        cache, as generate_batch makes them (zero tokens)."""
        tokens = np.zeros((batch, prompt_bucket), np.int32)
        lengths = jnp.ones((batch,), jnp.int32)
        state = self._new_state(batch, cache_len)
        cache = self._new_cache(batch, cache_len)
        pre_args = (self.prefill_params, self.drafter_params, tokens, lengths, jax.random.key(0),
                    state, cache if chunked else None)  # fmt: skip
        return pre_args, cache

    def _programs(self, pre_args, cache: KVCache) -> tuple[dict[str, Callable], float]:
        """AOT-compiled programs (`lowerings`) for this prompt bucket, prefill kind and cache
        length -> (name: executable, compile seconds; 0 when already compiled)."""
        key = (pre_args[2].shape, pre_args[6] is not None, cache.max_len)
        with self._compiling:
            if key in self._executables:
                return self._executables[key], 0.0
            start = time.perf_counter()
            plan = self.lowerings(pre_args, cache)
            programs = {  # roundings as written: EXACT_ROUNDING
                name: p.lower(*args, **kw).compile(EXACT_ROUNDING)
                for name, (p, args, kw) in plan.items()
            }
            self._warm_up(programs, pre_args, cache.max_len)
            self._executables[key] = programs
            return programs, time.perf_counter() - start

    def _warm_up(self, programs: dict[str, Callable], pre_args, max_len: int) -> None:
        """Run fresh executables once on throwaway inputs: on XLA:CPU an executable's first
        run costs several later ones (BENCHMARKS.md, "warm-up runs of fresh executables"), a
        one-time cost that belongs with compilation, not with generation."""
        prefill_params, dp, tokens, lengths, key, _, prefix = pre_args
        params, B = self.params, tokens.shape[0]
        state = self._new_state(B, max_len)
        cache = self._new_cache(B, max_len)
        if "extend" in programs:
            block, state = programs["extend"](
                prefill_params, dp, cache, tokens, lengths, lengths, state
            )
            cache = programs["commit_prompt"](cache, block, lengths)
        current, candidates, block, state = programs["prefill"](
            prefill_params, dp, tokens, lengths, key, state, cache if prefix is not None else None
        )
        cache = programs["commit_prompt"](cache, block, lengths)
        if "redraft" in programs:
            candidates = programs["redraft"](params, dp, cache, current)
        _, n, *_, block, state = programs["step"](
            params, dp, cache, current, candidates, key, state
        )
        jax.block_until_ready(
            programs["commit_path"](cache, block, _only_active(n, np.ones(B, bool)))
        )

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """One prompt; on_tokens(new_ids) streams each step's tokens."""
        stream = (lambda row, ids: on_tokens(ids)) if on_tokens else None  # noqa: E731
        return self.generate_batch([prompt_ids], max_new_tokens, seed, stream)[0]

    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        seed: int = 0,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[GenerationResult]:
        """Several prompts decoded together, one row each (rows accept independently).

        A row that is done (EOS or max_new_tokens) stops committing while the others go on.
        Timings in the results are the whole batch's. Greedy outputs equal one-at-a-time
        generation; sampled ones depend on the row (keys fold in the row index).
        """
        if not prompts:
            raise JaxspecError("no prompts: pass at least one")
        B, P = len(prompts), max(len(p) for p in prompts)
        for p in prompts:
            self.cache_len(len(p), max_new_tokens)  # clear errors for empty/too long prompts
        chunked, width, S = self.shapes(P, max_new_tokens)
        self.check_memory(B, S)
        if chunked:
            chunks, (tokens, tail) = prompt_chunks(prompts, width)
        else:
            chunks, (tokens, tail) = [], _padded(prompts, width)
        cache = self._new_cache(B, S)
        key = jax.random.key(check_seed(seed))
        lengths = jnp.asarray(tail)
        dp = self.drafter_params

        state = self._new_state(B, S)
        pre_args = (self.prefill_params, dp, tokens, lengths, key, state, cache if chunks else None)
        programs, compile_s = self._programs(pre_args, cache)
        run_step, commit_path = programs["step"], programs["commit_path"]
        run_redraft, commit_prompt = programs.get("redraft"), programs["commit_prompt"]

        eos = set(self.cfg.eos_token_ids)
        outs: list[list[int]] = [[] for _ in range(B)]
        steps = [1] * B
        accepted: list[list[int]] = [[] for _ in range(B)]  # per row, per verify step
        done = np.zeros(B, bool)

        def take(row: int, new: list[int]) -> None:
            new = _until_eos(new, eos)[: max_new_tokens - len(outs[row])]
            outs[row] += new
            done[row] = len(outs[row]) >= max_new_tokens or outs[row][-1] in eos
            if on_tokens:
                on_tokens(row, new)

        start = time.perf_counter()
        for chunk, counts, following in chunks:
            block, state = programs["extend"](self.prefill_params, dp, cache, chunk, counts,
                                              following, state)  # fmt: skip
            cache = commit_prompt(cache, block, counts)
        current, candidates, block, state = programs["prefill"](
            self.prefill_params, dp, tokens, lengths, key, state, cache if chunks else None
        )
        cache = commit_prompt(cache, block, lengths)
        for row, token in enumerate(np.asarray(current).tolist()):
            take(row, [token])
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        # Pipelined one step behind: step k+1 (and its commit) is dispatched before the host
        # reads step k's tokens, so the device never waits for Python. A row found finished
        # in step k has committed step k+1 too (cache_len leaves room); its tokens are dropped.
        in_flight = None  # (emitted, n) of the last dispatched step, not yet read
        while in_flight is not None or not done.all():
            launched = None
            if not done.all():
                if run_redraft is not None:
                    candidates = run_redraft(self.params, dp, cache, current)
                emitted, n, current, candidates, block, state = run_step(
                    self.params, dp, cache, current, candidates, key, state
                )
                if done.any():  # rows known to be finished stop advancing
                    n = _only_active(n, ~done)
                cache = commit_path(cache, block, n)
                launched = (emitted, n)
            if in_flight is not None:
                emitted, n = (np.asarray(x) for x in in_flight)
                for row in np.flatnonzero(np.where(done, 0, n)):
                    take(int(row), emitted[row, : n[row]].tolist())
                    steps[row] += 1
                    accepted[row].append(int(n[row]) - 1)
            in_flight = launched
        decode_s = time.perf_counter() - start
        self.drafter_state = state  # inspectable (e.g. Chimera's trigram cache counters)
        return [
            GenerationResult(list(p), out, n, prefill_s, decode_s, compile_s, accepted=acc)
            for p, out, n, acc in zip(prompts, outs, steps, accepted, strict=True)
        ]


def _padded(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (tokens [B,width] right-padded, lengths [B])."""
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


def prompt_chunks(prompts: list[list[int]], C: int):
    """Prompts, the longest over C tokens -> (the chunks before each row's last: a list of
    (tokens [B,C], counts [B], the token following each row's part [B]), (the last chunk's
    tokens [B,C], their counts [B])). Row r's last chunk starts at the multiple of C below
    its length, so all rows move through the same chunk positions. The last chunk keeps the
    full width: padding costs less than a program per tail length would."""
    full, lengths = _padded(prompts, (max(map(len, prompts)) // C + 1) * C + 1)
    heads = (lengths - 1) // C * C  # [B] tokens before each row's last chunk
    rows = np.arange(len(prompts))
    chunks = []
    for start in range(0, int(heads.max()), C):
        counts = np.where(heads > start, C, 0).astype(np.int32)
        following = full[rows, np.minimum(start, heads) + counts]
        chunks.append((full[:, start : start + C], counts, following))
    last = np.stack([full[r, h : h + C] for r, h in zip(rows, heads, strict=True)])
    return chunks, (last, (lengths - heads).astype(np.int32))


@jax.jit
def _only_active(n_emitted, active):
    """n_emitted [B] with the inactive rows' set to 0 (they commit nothing)."""
    return jnp.where(active, n_emitted, 0)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
