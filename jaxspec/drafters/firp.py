"""FIRP (future intermediate representation prediction): at layer t_i a linear map (D x D
+ bias) turns a token's hidden state into the *pseudo* hidden state of the position i
ahead; pseudo states run through the remaining layers beside the real tokens and the
model's own lm_head turns them into draft distributions. The drafter is K small matrices.

Pseudo chains hang off anchors: in a verify step every tree node (any node may end up the
last accepted one), in a prefill the last prompt token. For an anchor at position p, pseudo
step i sits at position p + i and sees what its anchor sees (the cache and the anchor's
tree ancestors, itself included), the earlier steps of its own chain, and itself. Real
tokens never see pseudo ones, so the logits being verified are exactly the model's.

Cost of a verify step with T tree nodes and K steps: T*K extra tokens, step i's only in
layers t_i..L (sum_i T*(L - t_i)/L token-equivalents of layer work), and K vocabulary
projections: only the accepted node's chain reaches the lm_head.

Chains on fewer nodes (`with_chains`): a step's last accepted node is most often the root
or a node on the likeliest paths, so chains may hang off only the A nodes likeliest to
end a step (from the drafter's measured accuracies), for A*K extra tokens. Any other node
drafts from its nearest chained ancestor's chain shifted by their depth difference:
step j + shift of that chain sits at the node's position + j, though it did not see the
accepted tokens in between (like the "masked" ablation); steps past the chain's end
repeat its last one. Drafts only decide what is verified, so outputs stay exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.chains import after_prompt, chain_mask, joint_mask, pseudo_positions
from jaxspec.config import LlamaConfig
from jaxspec.drafters.base import Drafter, tree_candidates
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError, option
from jaxspec.kv_cache import KVBlock, KVCache, causal_mask
from jaxspec.layers import dense
from jaxspec.llama import embed, final_norm, lm_logits, run_layers
from jaxspec.tree import DynamicTree, TreeSpec, last_accepted_probability


def apply_map(layer_map: dict, h: jax.Array) -> jax.Array:
    return (dense(h.astype(jnp.float32), layer_map["w"]) + layer_map["b"]).astype(h.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FirpSettings(DrafterSettings):
    """`layers`: the layer counts after which each pseudo step is predicted; `chains`: the
    default number of nodes given pseudo chains (0: every node). Data:
    test_topk_accuracy [K,k], the measured cumulative top-k accuracy per pseudo step,
    which places the chains."""

    layers: tuple[int, ...]
    chains: int = 0

    DATA = ("test_topk_accuracy",)


@dataclasses.dataclass(frozen=True)
class FirpDrafter(Drafter):
    cfg: LlamaConfig  # the base model's
    layers: tuple[int, ...]  # t_1 < ... < t_K: step i maps the state after t_i layers
    # Verify steps over chain_tree carry chains on chain_nodes only (empty: every node).
    chain_tree: TreeSpec | None = None
    chain_nodes: tuple[int, ...] = ()

    def __post_init__(self):
        layers = tuple(self.layers)
        if not layers or list(layers) != sorted(set(layers)):
            raise JaxspecError(f"FIRP layers must be increasing and distinct, got {layers}")
        if layers[0] < 1 or layers[-1] > self.cfg.n_layers:
            raise JaxspecError(
                f"FIRP layers must lie in 1..{self.cfg.n_layers} for this model, got {layers}"
            )

    @classmethod
    def from_settings(cls, cfg: LlamaConfig, settings: FirpSettings, **options) -> FirpDrafter:
        return cls(cfg, settings.layers)

    def for_tree(self, tree: TreeSpec, settings: FirpSettings, data, firp_chains=None, **options):
        """Pseudo chains on the `firp_chains` nodes of `tree` likeliest to end a step (None:
        the drafter's `chains` setting; 0 or absent: every node)."""
        if isinstance(tree, DynamicTree):  # its nodes change every step
            if firp_chains:
                raise JaxspecError(
                    f"pseudo chains go on every node of {tree.label}: drop {option('firp_chains')}"
                )
            return self
        n_chains = settings.chains if firp_chains is None else firp_chains
        if n_chains < 0:
            raise JaxspecError(
                f"{option('firp_chains')} must be >= 0 (0 = every node), got {n_chains}"
            )
        if 0 < n_chains < tree.n_nodes and "test_topk_accuracy" not in data:
            raise JaxspecError(
                "this FIRP drafter has no measured accuracies to place chains with; "
                f"retrain it or set {option('firp_chains')} to 0 (every node)"
            )
        return self.with_chains(tree, data.get("test_topk_accuracy"), n_chains)

    @property
    def n_steps(self) -> int:
        return len(self.layers)

    @property
    def draft_depth(self) -> int:
        return self.n_steps

    def init(self, base_params=None, key=None) -> dict:
        """Identity maps: before training a pseudo state starts as a copy of its anchor (the
        arguments, which other drafters' init uses, are not needed)."""
        D = self.cfg.dim
        return {"maps": [{"w": jnp.eye(D), "b": jnp.zeros((D,))} for _ in self.layers]}

    def with_chains(self, tree: TreeSpec, topk_accuracy, n_chains: int) -> FirpDrafter:
        """This drafter for `tree` with chains on the n_chains nodes likeliest to end a
        step as the last accepted one (the root always among them), from the measured
        cumulative top-k accuracy per step [K, k]; 0 or >= the tree's size: every node."""
        if n_chains <= 0 or n_chains >= tree.n_nodes:
            return self
        likely = last_accepted_probability(tree, topk_accuracy)
        likely[0] = np.inf
        nodes = np.sort(np.argsort(-likely, kind="stable")[:n_chains])
        return dataclasses.replace(self, chain_tree=tree, chain_nodes=tuple(map(int, nodes)))

    def chain_sources(self) -> tuple[np.ndarray, np.ndarray]:
        """For every node of chain_tree: the slot in chain_nodes of its nearest chained
        ancestor (itself when chained) [T], and their depth difference [T]."""
        tree, slot_of = self.chain_tree, {n: s for s, n in enumerate(self.chain_nodes)}
        slot, shift = np.zeros((2, tree.n_nodes), np.int32)
        for i in range(tree.n_nodes):
            j = i
            while j not in slot_of:
                j = int(tree.parent[j])
            slot[i], shift[i] = slot_of[j], tree.depth[i] - tree.depth[j]
        return slot, shift

    def check_tree(self, tree: TreeSpec) -> None:
        if self.chain_tree is not None and tree != self.chain_tree:
            raise JaxspecError("this FIRP drafter's chains were placed for another tree")
        if tree.max_depth > self.n_steps:
            raise JaxspecError(
                f"tree depth {tree.max_depth} exceeds the drafter's {self.n_steps} FIRP steps; "
                "pick a shallower tree"
            )

    def run_model(
        self, params, drafter_params, cfg, h, positions, cache, new_mask, anchors, collect, depth
    ):
        """The forward with pseudo chains joining at layers t_i -> (real last states
        [B,T,D], the real tokens' KVBlock, collected real states, pseudo last states
        [B,A,K,D]). Only the K = min(steps, depth) steps the tree uses are computed. In a
        verify step with chains on some nodes only, the others get their source's shifted
        chain (A = T)."""
        B, T, D = h.shape
        sparse = bool(self.chain_nodes) and anchors.shape[1] == self.chain_tree.n_nodes
        if sparse:
            anchors = anchors[:, np.asarray(self.chain_nodes)]
        A, K = anchors.shape[1], min(self.n_steps, depth)
        mask = joint_mask(new_mask, anchors, K)
        pos = jnp.concatenate([positions, pseudo_positions(positions, anchors, K)], axis=1)
        bounds = (0, *self.layers[:K], cfg.n_layers)
        keys, values, states = [], [], {}
        for s in range(K + 1):
            n = T + s * A  # real tokens and the pseudo steps joined so far
            h, block, got = run_layers(
                params, cfg, h, pos[:, :n], cache, mask[:, :n, :n], bounds[s], bounds[s + 1],
                collect,
            )  # fmt: skip
            keys += [k[:, :, :T] for k in block.keys]
            values += [v[:, :, :T] for v in block.values]
            states.update({i: x[:, :T] for i, x in got.items()})
            if s < K:
                at_anchor = jnp.take_along_axis(h[:, :T], anchors[:, :, None], axis=1)  # [B,A,D]
                h = jnp.concatenate([h, apply_map(drafter_params["maps"][s], at_anchor)], 1)
        pseudo = h[:, T:].reshape(B, K, A, D).transpose(0, 2, 1, 3)
        if sparse:
            slot, shift = self.chain_sources()
            step = np.minimum(shift[:, None] + np.arange(K), K - 1)  # [T,K]
            pseudo = pseudo[:, slot[:, None], step]  # [B,T,K,D]
        return h[:, :T], KVBlock(tuple(keys), tuple(values)), states, pseudo

    def prefill_model(
        self, params, drafter_params, cfg, h, positions, cache, new_mask, anchors, collect, depth
    ):
        """run_model for a prompt in two passes: the prompt's rows alone (AR's prefill),
        then the pseudo chains of anchors [B,A] against its keys and values."""
        B, T, D = h.shape
        A, K = anchors.shape[1], min(self.n_steps, depth)
        bounds = (0, *self.layers[:K], cfg.n_layers)
        h, block, states = run_layers(
            params, cfg, h, positions, cache, new_mask, collect=(*collect, *bounds[1 : K + 1])
        )  # fmt: skip
        context, prompt, sees = after_prompt(cache, block, new_mask, anchors, K)
        pos = pseudo_positions(positions, anchors, K)  # [B,K*A]
        chain = jnp.broadcast_to(jnp.asarray(chain_mask(A, K)), (B, K * A, K * A))
        pseudo = jnp.zeros((B, 0, D), h.dtype)
        for s in range(K):  # step s joins at layer t_s, from its anchor's state there
            at_anchor = jnp.take_along_axis(states[bounds[s + 1]], anchors[:, :, None], axis=1)
            pseudo = jnp.concatenate([pseudo, apply_map(drafter_params["maps"][s], at_anchor)], 1)
            n = (s + 1) * A
            pseudo, _, _ = run_layers(
                params, cfg, pseudo, pos[:, :n], context, chain[:, :n, :n], bounds[s + 1],
                bounds[s + 2], context_mask=sees[:, :n], context_block=prompt,
            )  # fmt: skip
        pseudo = pseudo.reshape(B, K, A, D).transpose(0, 2, 1, 3)
        return h, block, {i: states[i] for i in collect}, pseudo

    def guesses(self, params, drafter_params, tree, inputs) -> jax.Array:
        """The pseudo chain's logits [B,d,V] at the accepted node (d = the tree's depth)."""
        if inputs.draft_logits is not None:  # the step projected the chains already
            return inputs.draft_logits
        return lm_logits(params, self.cfg, inputs.drafted[:, : tree.max_depth])

    def propose(self, params, drafter_params, tree: TreeSpec, inputs, key):
        if tree.n_nodes == 1:
            return jnp.zeros((inputs.current.shape[0], 0), jnp.int32)
        return tree_candidates(self.guesses(params, drafter_params, tree, inputs), tree)

    def projected_rows(self, params, drafter_params, h, drafted, depth):
        """Every node's pseudo chain, normed: [B,T,K,D]."""
        return None if depth == 0 else final_norm(params, self.cfg, drafted[:, :, :depth])


def real_context(params, cfg: LlamaConfig, tokens, layers):
    """The real tokens' pass that training's pseudo chains attend to: tokens [B,n] ->
    (last states [B,n,D], KVBlock of every layer, states after each of `layers`)."""
    B, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (B, n))
    return run_layers(
        params, cfg, embed(params, tokens), positions, None, causal_mask(B, n), collect=layers
    )


def pseudo_forward(
    params, cfg: LlamaConfig, maps, layers, keys, values, states, anchors, chained=True,
    collect=(), teacher_forced=False,
):  # fmt: skip
    """Pseudo chains of K = len(maps) steps against real context: keys/values per layer
    [B,Kv,n,H] (None below layers[0]), states {t_i: [B,n,D]}, anchors [B,A] -> (pseudo last
    states [B,A,K,D], {layer count in collect: [B,m,D] the m pseudo tokens joined by then,
    step-major}). Anchor a's chain sees real tokens <= a, as in a verify step;
    teacher_forced: step i's pseudo state sees the real tokens <= a + i - 1 instead (the FIRP
    paper's training, §3.3: only real tokens precede each pseudo one)."""
    B, A, K, D = *anchors.shape, len(maps), cfg.dim
    n = states[layers[0]].shape[1]
    context = KVCache(tuple(keys), tuple(values), jnp.zeros((B,), jnp.int32))
    seen = (
        anchors[:, None, :, None]
        + (jnp.arange(K) if teacher_forced else jnp.zeros(K, int))[None, :, None, None]
    )  # [B,K,A,1]: the last real position each step's pseudo state sees
    context_mask = (jnp.arange(n) <= seen).reshape(B, K * A, n)  # step-major rows
    chain = jnp.asarray(chain_mask(A, K, chained))
    pos = pseudo_positions(jnp.broadcast_to(jnp.arange(n), (B, n)), anchors, K)
    bounds = (*layers[:K], cfg.n_layers)
    h = jnp.zeros((B, 0, D), states[layers[0]].dtype)
    collected = {}
    for s in range(K):
        at_anchor = jnp.take_along_axis(states[layers[s]], anchors[:, :, None], axis=1)
        h = jnp.concatenate([h, apply_map(maps[s], at_anchor)], axis=1)
        m = (s + 1) * A
        h, _, got = run_layers(
            params, cfg, h, pos[:, :m], context, jnp.broadcast_to(chain[:m, :m], (B, m, m)),
            bounds[s], bounds[s + 1], collect, context_mask=context_mask[:, :m],
        )  # fmt: skip
        collected.update(got)
    return h.reshape(B, K, A, D).transpose(0, 2, 1, 3), collected
