"""Chimera: a trigram encoder, one full-context transformer block and residual heads.

Modules (D the base model's width):
- trigram encoder (n-gram in general, `ngram` = 3 by default): the frozen embeddings of
  (x_{i-2}, x_{i-1}, x_i) concatenated [3D], a ResBlock(3D) (x + SiLU(x W + b), W
  zero-initialised), then Linear(3D->D) (initialised to pick E(x_i)). Positions before the
  first token repeat it: (x0,x0,x0), (x0,x0,x1).
  `bottom` "transformer" (trainable, initialised from the model's first layer) or
  "transformer-frozen" (the model's own first layer) replaces it by one causal decoder
  layer over the token embeddings: the paper's Table 7 ablation, for training and
  evaluation only (drafting needs the n-gram encoder).
- full-context encoder: one Llama decoder layer (initialised from the base model's last
  layer) whose queries are trigram states and whose keys/values are the base model's
  last-layer states h_j of the real tokens and the trigram states, each at its token's
  position (rotary positions of the token).
- residual heads: head d maps [norm(h) ; norm(ĥ)] (2D) by Linear(2D->D), initialised
  [I ; I], into the frozen lm_head: initially the function of the paper's [W_lm, W_lm].
  `residual=False` (the paper's Fig. 6 ablation) drops h: Linear(D->D) on norm(ĥ).
  `full_heads=True` gives each head the paper's own Linear(2D->V), initialised
  [W_lm ; W_lm] (V x 2D per head: larger than the base model at V=49152, D=576).

Drafting after a verify step, with current token x_p (the tree's root: position p, not
yet in the model's cache) and the model's state h_{p-1} that predicted it: every tree node
with children has a query, the trigram ending at its token, at position p + its depth d;
it attends to the real states h_0..h_{p-1}, the committed trigrams and the trigrams of its
own path, and head d+1 on [h_{p-1} ; ĥ] ranks its children (`draft_tree`). So head d
always works d positions past its last real state ("lag d"), and training uses the same
masks with the true tokens as the path (`training_logits`).

The encoder keeps its own cache (`ChimeraState`): keys/values of every committed token's
real state and trigram, written once when the token enters the model's cache, so the
prefix is never re-encoded. Cost of drafting per step, for a tree's I internal nodes: the
trigram encoder for I - 1 of them, one block per depth over the internal nodes above it,
and I vocabulary projections (the draft vocabulary's rows).

Trigram cache (`cache_size` > 0, the paper's §3.2.1): a direct-mapped table of trigram
encodings keyed by the token triple (each slot keeps the most recent triple hashed to it),
filled as tokens are committed and counted in `ChimeraState.lookups` (hits, lookups).
settings["cache_prefill"] (frequent answer trigrams, most frequent first, written by the
trainer) pre-fills it: `prepare` encodes them once and every generation starts from that
table.
When every trigram a computation needs is in the table the encoder MLP is skipped
(`lax.cond`); drafting only reads the table.

Draft vocabulary (settings["draft_vocab"]: token ids, e.g. the most frequent answer
tokens): the heads project onto those rows of the lm_head only (`prepare` gathers them
once), so drafting reads a fraction of the [V,D] matrix; drafts outside it are never
proposed, which costs acceptance only, never exactness.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import LlamaConfig
from jaxspec.drafters.base import Drafter, DraftInputs
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask, write_rows
from jaxspec.layers import OutIn, dense, rms_norm, rope_tables
from jaxspec.llama import (
    decoder_layer,
    draft_vocab,
    embed,
    final_norm,
    layer_kv,
    vocab_projection,
)
from jaxspec.topology import Draft, Retrieved, expand_frontier, top_log_probs
from jaxspec.tree import DynamicTree, TreeSpec

BOTTOMS = ("ngram", "transformer", "transformer-frozen")
# Slots past the model's cache length: a step writes its path and one more trigram.
SPARE_SLOTS = 2


@flax.struct.dataclass
class ChimeraState:
    tokens: jax.Array  # [B,S] every committed token, and the current one
    real_keys: jax.Array  # [B,K,S,H] the encoder's keys/values of the real states h_j
    real_values: jax.Array
    trigram_keys: jax.Array  # [B,K,S,H] ... of the trigram states T_j
    trigram_values: jax.Array
    newest: jax.Array  # [B,D] the trigram state ending at the current token
    table: jax.Array | None = None  # [C, D+n] trigram cache: encoding, then the token ids
    lookups: jax.Array | None = None  # [2] int32: cache hits, committed trigrams looked up


def cache_slots(tokens_n: jax.Array, size: int) -> jax.Array:
    """tokens_n [...,n] -> table slot [...] (a multiplicative hash of the ids)."""
    h = jnp.zeros(tokens_n.shape[:-1], jnp.uint32)
    for i in range(tokens_n.shape[-1]):
        h = (h ^ tokens_n[..., i].astype(jnp.uint32)) * jnp.uint32(0x9E3779B1)
    return (h % jnp.uint32(size)).astype(jnp.int32)


def trigram_tokens(tokens: jax.Array, at: jax.Array, n: int = 3) -> jax.Array:
    """tokens [B,N], positions at [B,Q] -> [B,Q,n]: (x_{i-n+1}, ..., x_i), clamped at 0."""
    index = jnp.maximum(at[..., None] + jnp.arange(1 - n, 1), 0)  # [B,Q,n]
    return jnp.take_along_axis(tokens[:, :, None], index.reshape(at.shape[0], -1, 1), 1).reshape(
        index.shape
    )


def encode_trigrams(base_params, trigram: dict, tokens3: jax.Array) -> jax.Array:
    """tokens3 [B,...,n] -> trigram (n-gram) states [B,...,D]."""
    e = embed(base_params, tokens3.reshape(tokens3.shape[0], -1))
    x = e.reshape(*tokens3.shape[:-1], -1).astype(jnp.float32)  # [B,...,nD]
    x = x + jax.nn.silu(dense(x, trigram["res_w"]) + trigram["res_b"])
    return dense(x, trigram["w"]) + trigram["b"]


def lag_mask(n: int, lag: int) -> jax.Array:
    """[n, 2n] for training over a whole sequence: trigram row i sees real states j <= i-lag
    and trigrams j <= i. Example n=3, lag 1:

        key:  h0 h1 h2 | T0 T1 T2
        T0     0  0  0 |  1  0  0
        T1     1  0  0 |  1  1  0
        T2     1  1  0 |  1  1  1
    """
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None]
    return jnp.concatenate([j <= i - lag, j <= i], axis=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChimeraSettings(DrafterSettings):
    """The drafter's shape (ChimeraDrafter's fields of the same names). Data: draft_vocab
    [V'] token ids the heads score, cache_prefill [N,ngram] frequent answer n-grams."""

    n_heads: int
    ngram: int = 3
    residual: bool = True
    cache_size: int = 0
    full_heads: bool = False
    bottom: str = "ngram"

    DATA = ("draft_vocab", "cache_prefill")


@dataclasses.dataclass(frozen=True)
class ChimeraDrafter(Drafter):
    cfg: LlamaConfig  # the base model's
    n_heads: int = 4
    ngram: int = 3
    residual: bool = True
    cache_size: int = 0  # trigram cache entries (0: no cache)
    full_heads: bool = False
    bottom: str = "ngram"  # or a transformer layer (BOTTOMS): a training-only ablation

    def __post_init__(self):
        if not 1 <= self.ngram <= 8 or self.n_heads < 1:
            raise JaxspecError(
                f"Chimera needs 1 <= ngram <= 8 and >= 1 head, got ngram={self.ngram}, "
                f"n_heads={self.n_heads}"
            )
        if self.bottom not in BOTTOMS:
            raise JaxspecError(
                f"unknown Chimera bottom encoder {self.bottom!r}; known: {', '.join(BOTTOMS)}"
            )

    @property
    def collect(self) -> tuple[int, ...]:
        return (self.cfg.n_layers,)

    @property
    def draft_depth(self) -> int:
        return self.n_heads

    @classmethod
    def from_settings(cls, cfg: LlamaConfig, settings: ChimeraSettings, **options):
        s = settings
        return cls(cfg, s.n_heads, s.ngram, s.residual, s.cache_size, s.full_heads, s.bottom)

    def init(self, base_params, key=None) -> dict:
        D, n = self.cfg.dim, self.ngram
        eye = jnp.eye(D)
        head_w = jnp.concatenate([eye, eye]) if self.residual else eye
        if self.full_heads:  # [W_lm ; W_lm]: the factorised heads' initial function
            lm = (
                base_params["embed_tokens"].T if self.cfg.tie_embeddings else base_params["lm_head"]
            )
            head_w = jnp.concatenate([lm, lm]) if self.residual else jnp.array(lm)
        as_f32 = lambda tree: jax.tree.map(lambda x: jnp.array(x, jnp.float32), tree)  # noqa: E731
        bottom = {}  # "transformer-frozen" reads the model's own first layer: nothing to train
        if self.bottom == "ngram":
            bottom["trigram"] = {
                "res_w": jnp.zeros((n * D, n * D)),
                "res_b": jnp.zeros((n * D,)),
                "w": jnp.concatenate([jnp.zeros(((n - 1) * D, D)), eye]),
                "b": jnp.zeros((D,)),
            }
        elif self.bottom == "transformer":
            bottom["bottom"] = as_f32(base_params["layers"][0])
        return {
            **bottom,
            "encoder": as_f32(base_params["layers"][-1]),
            "heads": [
                {"w": head_w, "b": jnp.zeros((head_w.shape[1],))} for _ in range(self.n_heads)
            ],
        }

    def head_logits(self, base_params, params, h_real, h_enc, head: int):
        """Head `head` (1-based): h_real [...,D] the model's last-layer state, h_enc [...,D]
        the encoder's output -> logits [...,V] float32."""
        x = final_norm(base_params, self.cfg, h_enc)
        if self.residual:
            x = jnp.concatenate([final_norm(base_params, self.cfg, h_real), x], -1)
        x = x.astype(jnp.float32)
        p = params["heads"][head - 1]
        y = dense(x, p["w"]) + p["b"]
        if self.full_heads:
            return y.astype(jnp.float32)  # already [...,V]
        if "vocab" in params:  # [V',D] rows of the lm_head: logits over the draft vocabulary
            return dense(y, OutIn(params["vocab"]["matrix"]))
        return vocab_projection(base_params, self.cfg, y)

    def prepare(self, params, drafter_params, data):
        if self.cache_size and len(data.get("cache_prefill", ())):
            table = self.prefilled_table(params, drafter_params, data["cache_prefill"])
            drafter_params = {**drafter_params, "cache_table": table}
        if not len(data.get("draft_vocab", ())) or self.full_heads:
            return drafter_params
        return {**drafter_params, "vocab": draft_vocab(params, self.cfg, data["draft_vocab"])}

    def prefilled_table(self, params, drafter_params, grams) -> jax.Array:
        """grams [N,n] token ids, most frequent first -> a cache table [C,D+n] holding their
        encodings; of the grams that share a slot, the most frequent keeps it."""
        grams = np.asarray(grams, np.int32).reshape(-1, self.ngram)
        slots = np.asarray(cache_slots(jnp.asarray(grams), self.cache_size))
        _, first = np.unique(slots, return_index=True)  # the first (most frequent) per slot
        grams, slots = grams[first], slots[first]
        encoded = encode_trigrams(params, drafter_params["trigram"], jnp.asarray(grams)[None])[0]
        table = jnp.full((self.cache_size, self.cfg.dim + self.ngram), -1.0, jnp.float32)
        return table.at[slots].set(jnp.concatenate([encoded, grams.astype(np.float32)], -1))

    def to_tokens(self, drafter_params, index: jax.Array) -> jax.Array:
        """Indices into the heads' logits -> token ids."""
        if "vocab" in drafter_params:
            return drafter_params["vocab"]["ids"][index]
        return index.astype(jnp.int32)

    def check_tree(self, tree: TreeSpec) -> None:
        if self.bottom != "ngram":
            raise JaxspecError(
                f"this Chimera drafter has a {self.bottom} bottom encoder, a training-only "
                "ablation (paper Table 7); generate with an n-gram drafter (the shipped one)"
            )
        if tree.max_depth > self.n_heads:
            raise JaxspecError(
                f"tree depth {tree.max_depth} exceeds the drafter's {self.n_heads} Chimera heads; "
                "pick a shallower tree"
            )

    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None):
        shape = (batch, cfg.n_kv_heads, max_len + SPARE_SLOTS, cfg.head_dim)
        zeros = lambda: jnp.zeros(shape, jnp.float32)  # noqa: E731
        tokens = jnp.zeros((batch, max_len + SPARE_SLOTS), jnp.int32)
        newest = jnp.zeros((batch, cfg.dim), jnp.float32)
        table = lookups = None
        if self.cache_size:
            if drafter_params and "cache_table" in drafter_params:  # a copy: states are donated
                table = jnp.copy(drafter_params["cache_table"])
            else:
                table = jnp.full((self.cache_size, cfg.dim + self.ngram), -1.0, jnp.float32)
            lookups = jnp.zeros((2,), jnp.int32)
        return ChimeraState(tokens, zeros(), zeros(), zeros(), zeros(), newest, table, lookups)

    def state_shardings(self, state, layout):
        """The encoder's keys/values split like the model's cache (its layer's weights are
        split like the model's, mesh.table_specs), the trigram table replicated."""
        kv, rows, whole = layout.kv, layout.rows, layout.replicated
        table, lookups = (None, None) if state.table is None else (whole, whole)
        return ChimeraState(rows, kv, kv, kv, kv, rows, table, lookups)

    def encode(self, params, drafter_params, tokens_n, table=None, needed=None):
        """tokens_n [B,Q,n] -> (trigram states [B,Q,D], which were cache hits [B,Q]).
        With a table, the encoder runs only if some `needed` [B,Q] trigram misses."""
        compute = lambda: encode_trigrams(params, drafter_params["trigram"], tokens_n)  # noqa: E731
        if table is None:
            return compute(), jnp.zeros(tokens_n.shape[:-1], bool)
        D = self.cfg.dim
        entry = table[cache_slots(tokens_n, table.shape[0])]  # [B,Q,D+n]
        hit = jnp.all(entry[..., D:] == tokens_n.astype(jnp.float32), -1)
        needed = jnp.ones_like(hit) if needed is None else needed
        states = jax.lax.cond(
            jnp.all(hit | ~needed),
            lambda: entry[..., :D],
            lambda: jnp.where(hit[..., None], entry[..., :D], compute()),
        )
        return states, hit

    def advance(self, params, drafter_params, inputs: DraftInputs) -> ChimeraState:
        """Encode what entered the cache (real states at their positions, and the trigrams
        up to the current token) into the encoder's cache."""
        st, new = inputs.state, inputs.entered
        B, M = new.tokens.shape
        enc = drafter_params["encoder"]
        tokens = jax.vmap(lambda row, x, at: jax.lax.dynamic_update_slice(row, x, (at,)))(
            st.tokens, new.tokens, new.start
        )
        tokens = tokens.at[jnp.arange(B), inputs.position].set(inputs.current)

        positions = new.start[:, None] + jnp.arange(M)  # [B,M]
        real = rms_norm(new.hidden[self.cfg.n_layers], enc["input_layernorm"], self.cfg.norm_eps)
        real_k, real_v = layer_kv(self.cfg, enc, real.astype(jnp.float32), *rope_tables(
            self.cfg, positions))  # fmt: skip
        # Trigrams at start..start+M: the ones ending at each entered token and at current.
        tri_pos = new.start[:, None] + jnp.arange(M + 1)
        tri_tokens = trigram_tokens(tokens, tri_pos, self.ngram)  # [B,M+1,n]
        valid = tri_pos <= inputs.position[:, None]
        tri, hit = self.encode(params, drafter_params, tri_tokens, st.table, valid)
        table, lookups = st.table, st.lookups
        if table is not None:
            slots = cache_slots(tri_tokens, table.shape[0])
            fresh = jnp.concatenate([tri, tri_tokens.astype(jnp.float32)], -1)
            table = table.at[slots].set(jnp.where((valid & ~hit)[..., None], fresh, table[slots]))
            # not counted yet: past the start, or the first (a row idle in a prompt chunk
            # enters nothing at 0)
            first = (tri_pos == 0) & (new.count[:, None] > 0)
            new_here = valid & ((tri_pos > new.start[:, None]) | first)
            lookups = lookups + jnp.stack([(hit & new_here).sum(), new_here.sum()]).astype(
                jnp.int32
            )
        tri_k, tri_v = layer_kv(
            self.cfg, enc, rms_norm(tri, enc["input_layernorm"], self.cfg.norm_eps),
            *rope_tables(self.cfg, tri_pos),
        )  # fmt: skip
        return ChimeraState(
            tokens,
            write_rows(st.real_keys, real_k, new.start),
            write_rows(st.real_values, real_v, new.start),
            write_rows(st.trigram_keys, tri_k, new.start),
            write_rows(st.trigram_values, tri_v, new.start),
            jnp.take_along_axis(tri, new.count[:, None, None], axis=1)[:, 0],  # at position
            table,
            lookups,
        )

    def draft_tree(self, params, drafter_params, inputs: DraftInputs, tree: TreeSpec):
        """-> (candidates [B,T-1], logits [B,I,V]): every node with children (I of them, in
        node order; the root first) drafts them from its own path. Its query is the trigram
        ending at its token, at position p + its depth; it sees the real states h_j (j < p),
        the committed trigrams and its ancestors' trigrams; head depth+1 on [h_{p-1} ; ĥ]
        ranks its children (child of rank r: the rank-r token). Depth by depth, since a
        node's trigram needs its token."""
        st, p = inputs.state, inputs.position
        B, S = st.tokens.shape
        n, T = self.ngram, tree.n_nodes
        enc = drafter_params["encoder"]
        context_k = jnp.concatenate([st.real_keys, st.trigram_keys], axis=2)  # [B,K,2S,H]
        context_v = jnp.concatenate([st.real_values, st.trigram_values], axis=2)
        before = jnp.arange(S)[None] < p[:, None]  # [B,S]: real h_j and committed T_j, j < p
        context = jnp.concatenate([before, before], axis=1)[:, None]  # [B,1,2S]
        window = trigram_tokens(st.tokens, p[:, None], n)[:, 0]  # [B,n] ending at x_p
        internal = np.flatnonzero(np.isin(np.arange(T), tree.parent))  # [I] static
        grams = tree_ngram_index(tree, n)[internal]  # [I,n] into [window[:n-1] ; node tokens]
        nodes = jnp.zeros((B, T), jnp.int32).at[:, 0].set(inputs.current)
        states = jnp.zeros((B, len(internal), self.cfg.dim), jnp.float32)
        h_real = inputs.hidden[self.cfg.n_layers]
        logits = []  # per depth: [B,level,V]
        for d in range(1, tree.max_depth + 1):
            level = np.flatnonzero(tree.depth[internal] == d - 1)  # slots of depth d-1
            if d == 1:  # the root's trigram: `advance` just encoded it
                states = states.at[:, 0].set(st.newest)
            else:
                source = jnp.concatenate([window[:, : n - 1], nodes], axis=1)
                encoded, _ = self.encode(params, drafter_params, source[:, grams[level]], st.table)
                states = states.at[:, level].set(encoded)
            seen = np.flatnonzero(tree.depth[internal] <= d - 1)  # a prefix: nodes by depth
            queries = internal[seen]
            positions = p[:, None] + jnp.asarray(tree.depth[queries])
            among = jnp.asarray(tree.mask[queries][:, queries])  # ancestors among the queries
            mask = jnp.concatenate([
                jnp.broadcast_to(context, (B, len(seen), 2 * S)),
                jnp.broadcast_to(among, (B, len(seen), len(seen))),
            ], -1)  # fmt: skip
            out, _, _ = decoder_layer(
                self.cfg, enc, states[:, seen], *rope_tables(self.cfg, positions), context_k,
                context_v, mask,
            )  # fmt: skip
            h = jnp.broadcast_to(h_real[:, None], (B, len(level), h_real.shape[-1]))
            logits.append(self.head_logits(params, drafter_params, h, out[:, level], d))
            children = np.flatnonzero(tree.depth == d)
            top = jax.lax.top_k(logits[-1], int(tree.rank[children].max()) + 1)[1]
            parent = np.searchsorted(level, np.searchsorted(internal, tree.parent[children]))
            picked = top[:, parent, tree.rank[children]]  # [B,children]
            nodes = nodes.at[:, children].set(self.to_tokens(drafter_params, picked))
        return nodes[:, 1:], jnp.concatenate(logits, axis=1)

    def draft_dynamic(self, params, dp, inputs: DraftInputs, tree: DynamicTree,
                      extra: Retrieved | None = None) -> Draft:  # fmt: skip
        """Per-node expansion (EAGLE-2's, with Chimera's per-path drafting): the root's
        top-`width` guesses, then depth by depth the `width` best nodes by path probability
        (the frontier) run the encoder on their own n-grams, each seeing its ancestors'
        entries, and head d+1 guesses their children; the tree is the N best of all."""
        st, p = inputs.state, inputs.position
        B, S = st.tokens.shape
        n, k, K, H = self.ngram, tree.width, self.cfg.n_kv_heads, self.cfg.head_dim
        enc = dp["encoder"]
        context_k = jnp.concatenate([st.real_keys, st.trigram_keys], axis=2)  # [B,K,2S,H]
        context_v = jnp.concatenate([st.real_values, st.trigram_values], axis=2)
        before = jnp.arange(S)[None] < p[:, None]  # [B,S]: real h_j and committed T_j, j < p
        context = jnp.concatenate([before, before], axis=1)[:, None]  # [B,1,2S]
        h_real = inputs.hidden[self.cfg.n_layers]

        def run(states, depth, above, ks, vs):
            """Queries states [B,Q,D] at depth `depth`, their ancestors above [B,Q,E] among
            the entries ks, vs [B,K,E,H] -> (outputs, their keys, values)."""
            Q = states.shape[1]
            itself = jnp.broadcast_to(jnp.eye(Q, dtype=bool), (B, Q, Q))
            mask = jnp.concatenate([jnp.broadcast_to(context, (B, Q, 2 * S)), above, itself], -1)
            positions = jnp.broadcast_to(p[:, None] + depth, (B, Q))
            return decoder_layer(
                self.cfg, enc, states, *rope_tables(self.cfg, positions),
                jnp.concatenate([context_k, ks], 2), jnp.concatenate([context_v, vs], 2), mask,
            )  # fmt: skip

        def guesses(out, head):  # -> top-k log probabilities and tokens [B,Q,k]
            h = jnp.broadcast_to(h_real[:, None], out.shape)
            lp, index = top_log_probs(self.head_logits(params, dp, h, out, head), k)
            return lp, self.to_tokens(dp, index)

        empty = jnp.zeros((B, K, 0, H), jnp.float32)
        out, ks, vs = run(st.newest[:, None], 0, jnp.zeros((B, 1, 0), bool), empty, empty)
        score, token = (x[:, 0] for x in guesses(out, 1))  # [B,k]: depth 1
        window = jnp.broadcast_to(trigram_tokens(st.tokens, p[:, None], n), (B, k, n))

        def expand(d, paths, carry, above, ks, vs):
            grams = jnp.concatenate([window, paths], -1)[..., -n:]  # [B,k,n] ending at each
            states, _ = self.encode(params, dp, grams, st.table)
            out, new_keys, new_values = run(states, d - 1, above, ks, vs)
            return *guesses(out, d), new_keys, new_values, carry

        # every node descends from the root's entry
        above = jnp.ones((B, k, 1), bool)
        return expand_frontier(score, token, tree, expand, None, above, ks, vs, extra)

    def propose(self, params, drafter_params, tree: TreeSpec, inputs, key):
        if isinstance(tree, DynamicTree):
            return self.draft_dynamic(params, drafter_params, inputs, tree)
        if tree.n_nodes == 1:
            return jnp.zeros((inputs.current.shape[0], 0), jnp.int32)
        return self.draft_tree(params, drafter_params, inputs, tree)[0]


def tree_ngram_index(tree: TreeSpec, n: int) -> np.ndarray:
    """[T,n] where each node's n-gram (the last n tokens of its path, oldest first) sits in
    [x_{p-n+1} .. x_{p-1} ; node tokens] (n-1 + T entries; node 0 is the root x_p)."""
    index = np.zeros((tree.n_nodes, n), np.int32)
    for node in range(tree.n_nodes):
        path = [node]
        while path[-1] != 0:
            path.append(int(tree.parent[path[-1]]))
        last = [n - 1 + i for i in reversed(path)]  # root .. node, in the source
        index[node] = ([*range(n - 1), *last])[-n:]
    return index


def bottom_states(drafter: ChimeraDrafter, base_params, params, tokens, positions):
    """Whole sequences: tokens, positions [B,n] -> the bottom encoder's states [B,n,D]: the
    n-gram ending at each token, or a causal decoder layer over the embeddings (state j
    reads tokens <= j, so the n-gram masks hold for it too)."""
    if drafter.bottom == "ngram":
        windows = trigram_tokens(tokens, positions, drafter.ngram)
        return encode_trigrams(base_params, params["trigram"], windows)
    layer = params["bottom"] if drafter.bottom == "transformer" else base_params["layers"][0]
    x = embed(base_params, tokens).astype(jnp.float32)
    mask = causal_mask(*tokens.shape)
    out, _, _ = decoder_layer(
        drafter.cfg, layer, x, *rope_tables(drafter.cfg, positions), None, None, mask
    )
    return out


def encoder_context(drafter: ChimeraDrafter, base_params, params, tokens, hidden):
    """Whole sequences: tokens [B,n], the model's last-layer states hidden [B,n,D] ->
    (trigram states [B,n,D], the encoder's keys and values over [real ; trigrams], each
    [B,Kv,2n,H])."""
    cfg, enc = drafter.cfg, params["encoder"]
    B, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (B, n))
    cos, sin = rope_tables(cfg, positions)
    tri = bottom_states(drafter, base_params, params, tokens, positions)
    both = jnp.concatenate([hidden.astype(jnp.float32), tri], axis=1)
    normed = rms_norm(both, enc["input_layernorm"], cfg.norm_eps)
    keys, values = layer_kv(
        cfg, enc, normed, jnp.tile(cos, (1, 2, 1, 1)), jnp.tile(sin, (1, 2, 1, 1))
    )
    return tri, keys, values


def encoder_outputs(drafter, base_params, params, tokens, hidden, rows, lag, context=None):
    """The encoder at trigram rows [B,R] under lag_mask(n, lag) -> [B,R,D]."""
    cfg = drafter.cfg
    B, n = tokens.shape
    tri, keys, values = context or encoder_context(drafter, base_params, params, tokens, hidden)
    queries = jnp.take_along_axis(tri, rows[..., None], axis=1)
    seen = lag_mask(n, lag)[rows]  # [B,R,2n]
    mask = jnp.concatenate([seen, jnp.zeros((*rows.shape, rows.shape[1]), bool)], -1)
    out, _, _ = decoder_layer(
        cfg, params["encoder"], queries, *rope_tables(cfg, rows), keys, values, mask
    )
    return out


def training_logits(drafter: ChimeraDrafter, base_params, params, tokens, hidden, rows):
    """Whole sequences at once: tokens [B,n], the model's last-layer states hidden [B,n,D],
    rows [B,R] (each >= n_heads) -> logits [B,R,K,V]: head d at row i guesses token i+1
    from [h_{i-d} ; the encoder at trigram i under lag_mask(n, d)], exactly what drafting
    at depth d computes when x_{i-d+1..i} are the chain's tokens."""
    context = encoder_context(drafter, base_params, params, tokens, hidden)
    logits = []
    for d in range(1, drafter.n_heads + 1):
        out = encoder_outputs(drafter, base_params, params, tokens, hidden, rows, d, context)
        h_real = jnp.take_along_axis(hidden, (rows - d)[..., None], axis=1)
        logits.append(drafter.head_logits(base_params, params, h_real, out, d))
    return jnp.stack(logits, 2)
