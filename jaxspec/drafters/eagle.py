"""EAGLE-class drafter: one decoder layer (or a few: `blocks`) drafting autoregressively at
the feature level (EAGLE-3's inputs and training, EAGLE-2's dynamic trees).

An *entry* of the layer is a token position i with two inputs: the token x_i's embedding
and a feature f_i [D]. For a committed token f_i fuses the model's states at the position
before, f_i = Linear(3D->D)([h^low_{i-1} ; h^mid_{i-1} ; h^high_{i-1}]) (EAGLE-3's low,
middle and high layers, `layers`); for a drafted token it is the drafter's own output at
its parent's entry. The entry's input x_i = Linear(2D->D)([norm(e_i) ; norm(f_i)]) runs through
one Llama decoder block (initialised from the model's last block) at rotary position i,
attending to the committed entries (the drafter's own KV cache) and to the entries of its
drafted ancestors. A drafter of several blocks runs them in turn, each with its own keys and
values (stored interleaved on the kv-head axis: head k of block b at k*blocks+b, so a mesh
splitting kv heads keeps a head's blocks together); a block beyond the first starts with
zero output projections, so it adds nothing until trained. The output y_i, through the
drafter's final norm and the model's frozen lm_head (restricted to a draft vocabulary when
the folder ships one), guesses x_{i+1}, and is the feature of x_{i+1}'s entry when x_{i+1}
is drafted.

Generation: when tokens enter the model's cache (prefill, or a verify step's accepted path)
the entries up to the new root x_p are written to the drafter's cache (`advance`; entry p
needs h_{p-1}, so it is written in the round that computes it) and the root entry's output
is kept (`EagleState.newest`). Drafting expands nodes depth by depth, one block call per
depth over that depth's expanded nodes:
- a static tree expands its nodes with children; child of rank r = the parent's rank-r guess;
- a dynamic tree (EAGLE-2) keeps a frontier of the `width` best nodes by path probability
  (the product of the drafter's probabilities along the path), expands it, and the tree is
  the N best nodes of everything scored (`topology.best_of_pool`).

Training (train/eagle.py) is EAGLE-3's training-time test: step k feeds every position the
drafter's step-(k-1) output as its feature and attends as a depth-(k-1) node would
(`training_outputs`), so the drafter learns from its own features, not only the model's.
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
from jaxspec.layers import OutIn, dense, rms_norm, rope_tables
from jaxspec.llama import decoder_layer, draft_vocab, embed, layer_kv, vocab_projection
from jaxspec.topology import Draft, Retrieved, expand_frontier, top_log_probs
from jaxspec.tree import DynamicTree, TreeSpec

# Cache slots past the model's cache length (an entry is written at its token's position).
SPARE_SLOTS = 2
DEFAULT_DEPTH = 6  # a dynamic tree's depth when the tree does not set it (EAGLE-2's)


def fused_layers(cfg: LlamaConfig) -> tuple[int, int, int]:
    """The low, middle and high layer counts whose states are fused (EAGLE-3's choice:
    after layer 2, the middle one, and the third from the top)."""
    L = cfg.n_layers
    return tuple(sorted((min(2, L), max(L // 2, 1), max(L - 3, 1))))


@flax.struct.dataclass
class EagleState:
    tokens: jax.Array  # [B,S] every committed token, and the current one
    keys: jax.Array  # [B,K*blocks,S,H] the committed entries' keys/values (slot = position)
    values: jax.Array
    newest: jax.Array  # [B,D] the drafter's output at the current token's entry


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleSettings(DrafterSettings):
    """The drafter's shape. Data: draft_vocab [V'] token ids the drafter guesses among."""

    layers: tuple[int, int, int]  # the fused layer counts (low, middle, high)
    depth: int = DEFAULT_DEPTH  # the deepest a dynamic tree drafts
    blocks: int = 1  # decoder blocks in the drafter

    DATA = ("draft_vocab",)


@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
    cfg: LlamaConfig  # the base model's
    layers: tuple[int, int, int] = (2, 15, 27)
    depth: int = DEFAULT_DEPTH
    blocks: int = 1

    def __post_init__(self):
        if len(self.layers) != 3 or not all(1 <= n <= self.cfg.n_layers for n in self.layers):
            raise JaxspecError(
                f"EAGLE fuses three layer counts within 1..{self.cfg.n_layers}, got "
                f"{self.layers}; retrain the drafter for this model"
            )
        if self.blocks < 1:
            raise JaxspecError(f"an EAGLE drafter has at least one block, got {self.blocks}")

    @property
    def collect(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.layers)))

    @property
    def draft_depth(self) -> int:
        return self.depth

    @classmethod
    def from_settings(cls, cfg, settings: EagleSettings, **options) -> EagleDrafter:
        return cls(cfg, tuple(settings.layers), settings.depth, settings.blocks)

    def init(self, base_params, key=None) -> dict:
        D = self.cfg.dim
        eye, zeros = jnp.eye(D), jnp.zeros((D, D))
        as_f32 = lambda tree: jax.tree.map(lambda x: jnp.array(x, jnp.float32), tree)  # noqa: E731
        last = as_f32(base_params["layers"][-1])
        silent = {**last, "o_proj": jnp.zeros_like(last["o_proj"]),
                  "down_proj": jnp.zeros_like(last["down_proj"])}  # fmt: skip
        upper = {"upper": [silent] * (self.blocks - 1)} if self.blocks > 1 else {}
        return {
            # starts as the high layer's state alone (EAGLE-1's feature), and e + f
            "fuse": {"w": jnp.concatenate([zeros, zeros, eye]), "b": jnp.zeros((D,))},
            "entry": {
                "w": jnp.concatenate([eye, eye]),
                "b": jnp.zeros((D,)),
                "embed_norm": jnp.ones((D,)),
                "feature_norm": jnp.ones((D,)),
            },
            "layer": last,
            **upper,  # blocks 2.. start as the identity (no output), the drafter as one block's
            "norm": jnp.array(base_params["norm"], jnp.float32),
        }

    def prepare(self, params, drafter_params, data):
        if not len(data.get("draft_vocab", ())):
            return drafter_params
        return {**drafter_params, "vocab": draft_vocab(params, self.cfg, data["draft_vocab"])}

    def check_tree(self, tree) -> None:
        if not isinstance(tree, DynamicTree):
            return
        k, D = tree.width, tree.max_depth
        scored = k + (D - 1) * k * k  # the root's guesses, then k*k a depth
        if self.depth < D:
            raise JaxspecError(
                f"{tree.label} is {D} deep; this drafter drafts at most {self.depth} deep: "
                f"pick a depth of at most {self.depth} (dynamic-N-DEPTH-WIDTH)"
            )
        if tree.n_nodes - 1 > scored:
            raise JaxspecError(
                f"{tree.label}: {D} deep at {k} guesses a node, this drafter scores {scored} "
                f"candidates, fewer than the tree's {tree.n_nodes - 1} drafted nodes; take fewer "
                "nodes or more guesses (dynamic-N-DEPTH-WIDTH)"
            )

    # -- the blocks
    def fuse(self, drafter_params, states: dict) -> jax.Array:
        """{layer count: [B,...,D]} model states -> fused features [B,...,D] float32."""
        x = jnp.concatenate([states[n].astype(jnp.float32) for n in self.layers], -1)
        p = drafter_params["fuse"]
        return dense(x, p["w"]) + p["b"]

    def entry_inputs(self, base_params, drafter_params, tokens, features):
        """tokens [B,Q], features [B,Q,D] -> the block's inputs [B,Q,D]."""
        eps, p = self.cfg.norm_eps, drafter_params["entry"]
        e = rms_norm(embed(base_params, tokens), p["embed_norm"], eps)
        f = rms_norm(features.astype(jnp.float32), p["feature_norm"], eps)
        return dense(jnp.concatenate([e, f], -1), p["w"]) + p["b"]

    def block_params(self, drafter_params) -> list[dict]:
        return [drafter_params["layer"], *drafter_params.get("upper", ())]

    def block(self, drafter_params, x, positions, keys, values, mask):
        """x [B,Q,D] at positions [B,Q], context keys/values [B,K*blocks,C,H] (a tuple of
        such, or None), mask [B,Q,C+Q] -> (outputs [B,Q,D], the entries' keys and values
        [B,K*blocks,Q,H]), the blocks run in turn."""
        rope, new_keys, new_values = rope_tables(self.cfg, positions), [], []
        for b, p in enumerate(self.block_params(drafter_params)):
            x, k, v = decoder_layer(self.cfg, p, x, *rope, self.of_block(keys, b),
                                    self.of_block(values, b), mask)  # fmt: skip
            new_keys.append(k)
            new_values.append(v)
        return x, self.interleaved(new_keys), self.interleaved(new_values)

    def of_block(self, kv, b: int):
        """Context keys or values [B,K*blocks,C,H] (a tuple of such, or None) -> block b's
        [B,K,C,H] (likewise)."""
        if kv is None or self.blocks == 1:
            return kv
        if isinstance(kv, tuple):
            return tuple(self.of_block(x, b) for x in kv)
        B, KB, C, H = kv.shape
        return kv.reshape(B, KB // self.blocks, self.blocks, C, H)[:, :, b]

    def interleaved(self, per_block: list[jax.Array]) -> jax.Array:
        """[B,K,Q,H] per block -> [B,K*blocks,Q,H], head k of block b at k*blocks+b."""
        if len(per_block) == 1:
            return per_block[0]
        B, K, Q, H = per_block[0].shape
        return jnp.stack(per_block, axis=2).reshape(B, K * len(per_block), Q, H)

    def logits(self, base_params, drafter_params, y) -> jax.Array:
        """Outputs [...,D] -> guess logits [...,V'] float32 (V' the draft vocabulary's size,
        else the model's V)."""
        x = rms_norm(y, drafter_params["norm"], self.cfg.norm_eps)
        if "vocab" in drafter_params:
            return dense(x, OutIn(drafter_params["vocab"]["matrix"]))
        return vocab_projection(base_params, self.cfg, x)

    def to_tokens(self, drafter_params, index: jax.Array) -> jax.Array:
        if "vocab" in drafter_params:
            return drafter_params["vocab"]["ids"][index]
        return index.astype(jnp.int32)

    # -- generation
    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None):
        S = max_len + SPARE_SLOTS
        kv = lambda: jnp.zeros((batch, self.kv_heads, S, cfg.head_dim), jnp.float32)  # noqa: E731
        tokens = jnp.zeros((batch, S), jnp.int32)
        return EagleState(tokens, kv(), kv(), jnp.zeros((batch, cfg.dim), jnp.float32))

    @property
    def kv_heads(self) -> int:
        """The drafter's key/value heads: the model's per block."""
        return self.cfg.n_kv_heads * self.blocks

    def state_shardings(self, state, layout):
        """The blocks' keys/values split like the model's cache, by kv head (their weights
        are split like the model's layers, mesh.table_specs)."""
        return EagleState(layout.rows, layout.kv, layout.kv, layout.rows)

    def advance(self, params, drafter_params, inputs: DraftInputs) -> EagleState:
        """Entries start+1 .. position (tokens x_{start+1..p}, features from the states at
        start..p-1 that entered) into the drafter's cache; the root entry's output kept."""
        st, new = inputs.state, inputs.entered
        B, M = new.tokens.shape
        S = st.tokens.shape[1]
        rows = jnp.arange(B)[:, None]
        tokens = jax.vmap(lambda row, x, at: jax.lax.dynamic_update_slice(row, x, (at,)))(
            st.tokens, new.tokens, new.start
        )
        tokens = tokens.at[jnp.arange(B), inputs.position].set(inputs.current)
        positions = new.start[:, None] + 1 + jnp.arange(M)  # [B,M]
        valid = jnp.arange(M)[None] < new.count[:, None]
        x = self.entry_inputs(
            params, drafter_params, jnp.take_along_axis(tokens, jnp.minimum(positions, S - 1), 1),
            self.fuse(drafter_params, new.hidden),
        )  # fmt: skip
        slots = jnp.arange(S)[None, None]
        seen = (slots >= 1) & (slots <= new.start[:, None, None])  # [B,1,S] already written
        own = valid[:, None, :] & (jnp.arange(M)[None, :, None] >= jnp.arange(M)[None, None, :])
        y, k, v = self.block(
            drafter_params, x, positions, st.keys, st.values,
            jnp.concatenate([jnp.broadcast_to(seen, (B, M, S)), own], -1),
        )  # fmt: skip
        at = jnp.where(valid, positions, S)  # invalid rows are dropped
        write = lambda buf, kv: buf.at[rows, :, at].set(kv.transpose(0, 2, 1, 3), mode="drop")  # noqa: E731
        last = jnp.take_along_axis(y, jnp.maximum(new.count - 1, 0)[:, None, None], 1)[:, 0]
        newest = jnp.where((new.count > 0)[:, None], last, st.newest)
        return EagleState(tokens, write(st.keys, k), write(st.values, v), newest)

    def expand(self, params, drafter_params, st, position, tokens, features, depth, above, ks,
               vs):  # fmt: skip
        """Drafted nodes' entries: tokens [B,Q], features [B,Q,D] (their parents' outputs),
        depth [B,Q] (>= 1), above [B,Q,E] which of the E earlier drafted entries (keys/values
        ks, vs [B,K*blocks,E,H]) are their ancestors -> (outputs [B,Q,D], keys, values
        [B,K*blocks,Q,H])."""
        B, Q = tokens.shape
        S = st.tokens.shape[1]
        positions = position[:, None] + depth
        slots = jnp.arange(S)[None, None]
        seen = (slots >= 1) & (slots <= position[:, None, None])  # committed entries 1..p
        mask = jnp.concatenate(
            [jnp.broadcast_to(seen, (B, Q, S)), above, jnp.broadcast_to(jnp.eye(Q, dtype=bool),
                                                                       (B, Q, Q))], -1)  # fmt: skip
        keys = jnp.concatenate([st.keys, ks], axis=2)
        values = jnp.concatenate([st.values, vs], axis=2)
        x = self.entry_inputs(params, drafter_params, tokens, features)
        return self.block(drafter_params, x, positions, keys, values, mask)

    def guess_log_probs(self, params, drafter_params, y, k: int):
        """Outputs [B,Q,D] -> the top-k guesses per node: (log probabilities, token ids)."""
        lp, index = top_log_probs(self.logits(params, drafter_params, y), k)
        return lp, self.to_tokens(drafter_params, index)

    def draft_static(self, params, dp, inputs: DraftInputs, tree: TreeSpec) -> jax.Array:
        """-> candidates [B,T-1]: every node with children expands them, depth by depth."""
        st, p = inputs.state, inputs.position
        B, T, K, H = p.shape[0], tree.n_nodes, self.kv_heads, self.cfg.head_dim
        internal = np.flatnonzero(np.isin(np.arange(T), tree.parent))  # [I] static
        slot = {int(node): i for i, node in enumerate(internal)}
        nodes = jnp.zeros((B, T), jnp.int32).at[:, 0].set(inputs.current)
        outputs = jnp.zeros((B, len(internal), self.cfg.dim), jnp.float32)
        outputs = outputs.at[:, 0].set(st.newest)
        ks = vs = jnp.zeros((B, K, 0, H), jnp.float32)
        entered: list[int] = []  # drafted nodes with entries, in the order of ks
        for d in range(1, tree.max_depth + 1):
            level = internal[tree.depth[internal] == d - 1]
            if d > 1:
                above = jnp.asarray(tree.mask[level][:, entered], bool)  # [Q,E] ancestors
                parents = [slot[int(tree.parent[n])] for n in level]
                y, k, v = self.expand(
                    params, dp, st, p, nodes[:, level], outputs[:, parents],
                    jnp.full((B, len(level)), d - 1), jnp.broadcast_to(above, (B, *above.shape)),
                    ks, vs,
                )  # fmt: skip
                outputs = outputs.at[:, [slot[int(n)] for n in level]].set(y)
                ks, vs = jnp.concatenate([ks, k], 2), jnp.concatenate([vs, v], 2)
                entered += level.tolist()
            children = np.flatnonzero(tree.depth == d)
            _, guess = self.guess_log_probs(
                params, dp, outputs[:, [slot[int(n)] for n in level]],
                int(tree.rank[children].max()) + 1,
            )  # fmt: skip
            parent = np.searchsorted(level, tree.parent[children])
            nodes = nodes.at[:, children].set(guess[:, parent, tree.rank[children]])
        return nodes[:, 1:]

    def draft_dynamic(self, params, dp, inputs: DraftInputs, tree: DynamicTree,
                      extra: Retrieved | None = None) -> Draft:  # fmt: skip
        """EAGLE-2: the root's top-`width` guesses, then depth by depth the `width` best
        nodes by path probability (the frontier) expand their top-`width` guesses, each
        node's entry fed its parent's output; the tree is the N best nodes of all scored
        (topology.expand_frontier)."""
        st, p = inputs.state, inputs.position
        B, k, K, H = p.shape[0], tree.width, self.kv_heads, self.cfg.head_dim
        score, token = self.guess_log_probs(params, dp, st.newest[:, None], k)

        def expand(d, paths, features, above, ks, vs):
            depth = jnp.full((B, k), d - 1)
            y, new_keys, new_values = self.expand(
                params, dp, st, p, paths[:, :, -1], features, depth, above, ks, vs
            )
            return *self.guess_log_probs(params, dp, y, k), new_keys, new_values, y

        features = jnp.broadcast_to(st.newest[:, None], (B, k, self.cfg.dim))  # the root's
        empty = jnp.zeros((B, K, 0, H), jnp.float32)
        return expand_frontier(score[:, 0], token[:, 0], tree, expand, features,
                               jnp.zeros((B, k, 0), bool), empty, empty, extra)  # fmt: skip

    def propose(self, params, drafter_params, tree, inputs, key):
        if isinstance(tree, DynamicTree):
            return self.draft_dynamic(params, drafter_params, inputs, tree)
        if tree.n_nodes == 1:
            return jnp.zeros((inputs.current.shape[0], 0), jnp.int32)
        return self.draft_static(params, drafter_params, inputs, tree)


def shifted(fused: jax.Array) -> jax.Array:
    """fused [B,n,D] states at positions 0..n-1 -> the features of entries 0..n-1 (entry i
    takes position i-1's; entry 0 none: zeros)."""
    return jnp.concatenate([jnp.zeros_like(fused[:, :1]), fused[:, :-1]], axis=1)


def committed_kv(drafter: EagleDrafter, dp, entries):
    """entries [B,n,D] (the block inputs of committed tokens at positions 0..n-1) -> their
    keys and values [B,K*blocks,n,H] as drafting's cache holds them: block 1's from the
    entries alone, block b's from block b-1's outputs, each entry attending to entries
    1..itself (entry 0, which has no feature, only to itself)."""
    cfg = drafter.cfg
    B, n, _ = entries.shape
    rope = rope_tables(cfg, jnp.broadcast_to(jnp.arange(n), (B, n)))
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None]
    mask = jnp.broadcast_to(((j >= 1) & (j <= i)) | (j == i), (B, n, n))
    h, keys, values = entries, [], []
    blocks = drafter.block_params(dp)
    for b, p in enumerate(blocks):
        if b + 1 < len(blocks):  # its outputs: the next block's entries
            h, k, v = decoder_layer(cfg, p, h, *rope, None, None, mask)
        else:  # the last block's keys alone
            k, v = layer_kv(cfg, p, rms_norm(h, p["input_layernorm"], cfg.norm_eps), *rope)
        keys.append(k)
        values.append(v)
    return drafter.interleaved(keys), drafter.interleaved(values)


def training_outputs(drafter: EagleDrafter, base_params, dp, tokens, features, steps: int,
                     first=None, width: int | None = None) -> list[jax.Array]:  # fmt: skip
    """Training-time test over whole sequences: tokens [B,n] at positions 0..n-1, features
    [B,n,D] of their entries from the model's states (`shifted`) -> `steps` drafter outputs
    [B,W,D] at the window of positions first..first+W-1 (first [B], default 0; W = `width`,
    default n). Step k's output at i is what drafting computes for the depth-(k-1) node
    holding x_i when the root is x_{i-k+1} and the path's tokens are the true ones: its
    feature is step k-1's output at i-1, and it attends to the committed entries at
    positions 1..i-k+1 (step 1's) and the path's entries (step m's at i-k+m).

    The committed entries' keys and values are computed at every position (a drafter of
    several blocks runs its lower blocks once over the whole sequence for them); the steps
    run on the window alone, so a long prompt before a short answer costs its keys (and
    blocks-1 block passes), not `steps` block passes. Step k's
    outputs at the window's first k-1 positions lack their path (left of the window): valid
    from first+k-1 on."""
    B, n = tokens.shape
    W = n if width is None else width
    first = jnp.zeros((B,), jnp.int32) if first is None else first
    entries = drafter.entry_inputs(base_params, dp, tokens, features)  # step 1's [B,n,D]
    committed_k, committed_v = committed_kv(drafter, dp, entries)
    positions = first[:, None] + jnp.arange(W)  # [B,W]
    x = jnp.take_along_axis(entries, positions[..., None], axis=1)
    tokens = jnp.take_along_axis(tokens, positions, axis=1)
    i, j = positions[:, :, None], jnp.arange(n)[None, None]  # query, committed slot
    iw, jw = jnp.arange(W)[:, None], jnp.arange(W)[None]  # window indices
    keys, values, outputs = [committed_k], [committed_v], []
    for k in range(1, steps + 1):
        if k > 1:
            x = drafter.entry_inputs(base_params, dp, tokens, shifted(outputs[-1]))
        committed = (j >= 1) & (j <= i - k + 1) & (j != i)  # step 1's own entry: from `own`
        path = [jnp.broadcast_to(jw == iw - k + m, (B, W, W)) for m in range(2, k)]
        own = jnp.broadcast_to(iw == jw, (B, W, W))
        mask = jnp.concatenate([committed, *path, own], -1)
        y, kk, vv = drafter.block(dp, x, positions, tuple(keys), tuple(values), mask)
        if k > 1:
            keys.append(kk)
            values.append(vv)
        outputs.append(y)
    return outputs
