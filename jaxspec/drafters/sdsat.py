"""SDSAT with an adapter (mode b): the base model drafts through appended adaptive tokens,
and only at their positions do extra weights act, so the verifying model stays untouched.

Drafting (the paper's draft step 1) forwards [current ; A x k] at positions n..n+k against
the committed cache (k = the tree's depth - 1). `current` is an ordinary token: its output
is exactly the base model's next-token distribution (tree depth 1); adaptive token A_j's
output guesses the token at depth j+1. Verification (step 2) is the engine's verify step
by the untouched base model: greedy output identical to AR, sampled output distributed as
the model's. A loop emits at most k+2 tokens (depths 1..k+1 accepted, then the bonus).

The adapter: adaptive-token input embeddings [n_ids, D] and, in every layer, a LoRA term
x a b (a [in,r], b [r,out], b zero-initialised) on each linear map, applied only where the
token is adaptive (jnp.where: ordinary positions compute exactly the base model's values).
Adaptive token j uses embedding row min(j, n_ids - 1): n_ids = 1 is one id repeated (the
paper's recommendation: any k works), n_ids > 1 the paper's "diverse" tokens.

The one-forward loop (`one_forward`, ours, not the paper's): no separate draft step. In
the verify step, every tree node anchors a chain of k adaptive tokens (jaxspec.chains:
at the node's position + 1..k, seeing the node's path and their own chain, unseen by the
tree), so the accepted node's chain comes out of the same forward. Its adaptive token j
stands in for the token after the node (the bonus) and guesses the one j past it: the next
tree's depth j, with k = the tree's depth. One forward per loop, but depth 1 is now a
guess (the two-step loop gets it exactly from its draft step): at most k+1 tokens a loop.
In mode (b) the adaptive ids are not in the model's vocabulary: the base lm_head scores
the original vocabulary only, so a draft is always an ordinary token. Mode (a), the paper's
full fine-tuning, extends the model's vocabulary instead (`extend_vocabulary`) and drafts
with rank 0 (no adapter): the fine-tuned model both drafts and verifies.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.chains import after_prompt, chain_mask, joint_mask, pseudo_positions
from jaxspec.config import LlamaConfig
from jaxspec.drafters.base import CPU_TREE, Drafter, resolve_tree, tree_candidates
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import KVBlock, KVCache, causal_mask
from jaxspec.layers import dense
from jaxspec.llama import embed, final_norm, lm_logits, run_layers
from jaxspec.tree import TreeSpec

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SdsatSettings(DrafterSettings):
    """`rank`: the LoRA rank (0: the whole model was tuned); `n_ids`: adaptive tokens;
    `window`: the draft chain's length in training."""

    rank: int
    n_ids: int = 1
    window: int = 8


@dataclasses.dataclass(frozen=True)
class SdsatDrafter(Drafter):
    cfg: LlamaConfig  # the base model's
    rank: int = 16
    n_ids: int = 1
    one_forward: bool = False  # adaptive chains ride in the verify step (module docstring)

    @property
    def drafts_from_cache(self) -> bool:
        return not self.one_forward

    def init(self, base_params, key) -> dict:
        """Embeddings start at the mean token embedding; LoRA a ~ N(0, 1/in), b = 0 (the
        adapter starts as the base model fed that mean embedding)."""
        mean = jnp.mean(base_params["embed_tokens"].astype(jnp.float32), axis=0)
        layers = []
        for i, layer in enumerate(base_params["layers"] if self.rank else []):
            lora = {}
            for j, name in enumerate(LORA_TARGETS):
                d_in, d_out = layer[name].shape
                a = jax.random.normal(jax.random.fold_in(key, i * 16 + j), (d_in, self.rank))
                lora[name] = {"a": a / jnp.sqrt(d_in), "b": jnp.zeros((self.rank, d_out))}
            layers.append(lora)
        return {"embed": jnp.tile(mean, (self.n_ids, 1)), "lora": layers}

    def adaptive_embeddings(self, dparams, k: int) -> jax.Array:
        """-> the inputs [k,D] of adaptive tokens 1..k."""
        return dparams["embed"][jnp.minimum(jnp.arange(k), self.n_ids - 1)]

    def linears(self, dparams, adaptive: jax.Array):
        """adaptive [B,T] bool -> run_layers' `linears`: the base maps plus LoRA at adaptive
        positions (None, the plain maps, at rank 0)."""
        if not self.rank:
            return None
        where = adaptive[..., None]

        def for_layer(i, p):
            lora = dparams["lora"][i]

            def linear(x, name):
                y = dense(x, p[name])
                low = dense(dense(x, lora[name]["a"]), lora[name]["b"])
                return jnp.where(where, y + low, y).astype(x.dtype)

            return linear

        return for_layer

    def adapted_logits(
        self, params, dparams, h, positions, cache, new_mask, adaptive, context_mask=None
    ):
        """The model with the adapter: inputs h [B,T,D] at positions [B,T], adaptive [B,T]
        -> logits [B,T,V] (float32) over the original vocabulary. Training and drafting
        both run this."""
        h, _, _ = run_layers(
            params, self.cfg, h, positions, cache, new_mask, context_mask=context_mask,
            linears=self.linears(dparams, adaptive),
        )  # fmt: skip
        return lm_logits(params, self.cfg, h)

    @classmethod
    def from_settings(cls, cfg: LlamaConfig, settings: SdsatSettings, sdsat_loop=None, **options):
        one_forward = sdsat_loop == "one-forward"
        return cls(cfg, settings.rank, settings.n_ids, one_forward)

    def select_tree(self, name: str | TreeSpec | None, settings: SdsatSettings) -> TreeSpec:
        """The one-forward loop takes presets only: the drafter's own trees were searched
        for the two-step loop (their depth 1 is the model's own token)."""
        if not self.one_forward:
            return super().select_tree(name, settings)
        if isinstance(name, str) and name in settings.trees:
            raise JaxspecError(
                f"tree {name!r} was searched for sdsat's two-step loop (its depth 1 is the "
                "model's own token); with the one-forward loop pick a preset: chain-N, comb-D-W"
            )
        return resolve_tree(CPU_TREE if name is None else name)

    def __post_init__(self):
        if self.rank < 0 or self.n_ids < 1:
            raise JaxspecError(
                f"sdsat needs rank >= 0 and n_ids >= 1, got {self.rank}, {self.n_ids}"
            )

    def check_tree(self, tree: TreeSpec) -> None:
        if tree.max_depth < 1:
            adaptive = "K" if self.one_forward else "K-1"
            raise JaxspecError(
                f"sdsat needs a tree of depth >= 1 (chain-K or comb-K-W: {adaptive} adaptive "
                "tokens)"
            )

    def run_model(
        self, params, drafter_params, cfg, h, positions, cache, new_mask, anchors, collect, depth
    ):
        """One-forward loop: the tree (or prompt) h [B,T,D] plus k = depth adaptive tokens
        chained off every anchor [B,A] -> (last states [B,T,D], the T tokens' KVBlock,
        collected states, adaptive last states [B,A,k,D]); the two-step loop: the plain
        forward."""
        if not self.one_forward:
            return super().run_model(
                params, drafter_params, cfg, h, positions, cache, new_mask, anchors, collect, depth
            )  # fmt: skip
        B, T, D = h.shape
        A = anchors.shape[1]
        adaptive_h = self.adaptive_embeddings(drafter_params, depth).astype(h.dtype)  # [k,D]
        chains = jnp.broadcast_to(jnp.repeat(adaptive_h, A, axis=0), (B, depth * A, D))
        pos = jnp.concatenate([positions, pseudo_positions(positions, anchors, depth)], axis=1)
        adaptive = jnp.broadcast_to(jnp.arange(T + depth * A) >= T, (B, T + depth * A))
        h, block, states = run_layers(
            params, cfg, jnp.concatenate([h, chains], axis=1), pos, cache,
            joint_mask(new_mask, anchors, depth), collect=collect,
            linears=self.linears(drafter_params, adaptive),
        )  # fmt: skip
        block = KVBlock(
            tuple(k[:, :, :T] for k in block.keys), tuple(v[:, :, :T] for v in block.values)
        )
        states = {i: x[:, :T] for i, x in states.items()}
        drafted = h[:, T:].reshape(B, depth, A, D).transpose(0, 2, 1, 3)
        return h[:, :T], block, states, drafted

    def prefill_model(
        self, params, drafter_params, cfg, h, positions, cache, new_mask, anchors, collect, depth
    ):
        """run_model for a prompt in two passes (one-forward loop): the prompt's rows alone
        (AR's prefill), then the adaptive chains of anchors [B,A] against its keys and
        values."""
        real = super().run_model(
            params, drafter_params, cfg, h, positions, cache, new_mask, anchors, collect, depth
        )  # fmt: skip
        if not self.one_forward:
            return real
        h, block, states, _ = real
        B, A, D = h.shape[0], anchors.shape[1], h.shape[2]
        context, prompt, sees = after_prompt(cache, block, new_mask, anchors, depth)
        adaptive_h = self.adaptive_embeddings(drafter_params, depth).astype(h.dtype)  # [k,D]
        chains = jnp.broadcast_to(jnp.repeat(adaptive_h, A, axis=0), (B, depth * A, D))
        chain = jnp.broadcast_to(jnp.asarray(chain_mask(A, depth)), (B, depth * A, depth * A))
        adapted = self.linears(drafter_params, jnp.ones((B, depth * A), bool))  # every row
        drafted, _, _ = run_layers(
            params, cfg, chains, pseudo_positions(positions, anchors, depth), context, chain,
            context_mask=sees, context_block=prompt, linears=adapted,
        )  # fmt: skip
        return h, block, states, drafted.reshape(B, depth, A, D).transpose(0, 2, 1, 3)

    def projected_rows(self, params, drafter_params, h, drafted, depth):
        """One-forward loop: every node's adaptive chain, normed [B,T,k,D]."""
        return None if drafted is None else final_norm(params, self.cfg, drafted)

    def draft_logits(self, params, dparams, cache: KVCache, current, k: int) -> jax.Array:
        """current [B] (next root, not in the cache) -> logits [B,1+k,V]: row 0 the base
        model's own next-token logits, row j adaptive token j's guess for depth j+1."""
        B = current.shape[0]
        adaptive_h = self.adaptive_embeddings(dparams, k).astype(params["embed_tokens"].dtype)
        h = jnp.concatenate(
            [embed(params, current[:, None]), jnp.broadcast_to(adaptive_h, (B, k, self.cfg.dim))],
            axis=1,
        )  # [B,1+k,D]
        positions = cache.lengths[:, None] + jnp.arange(1 + k)[None]
        adaptive = jnp.broadcast_to(jnp.arange(1 + k) >= 1, (B, 1 + k))
        return self.adapted_logits(
            params, dparams, h, positions, cache, causal_mask(B, 1 + k), adaptive
        )

    def draft_from_cache(self, params, dparams, cache, current, tree):
        logits = self.draft_logits(params, dparams, cache, current, tree.max_depth - 1)
        return tree_candidates(logits, tree)

    def propose(self, params, drafter_params, tree, inputs, key):
        if not self.one_forward:  # two-step: draft_from_cache drafts
            return jnp.zeros((inputs.current.shape[0], tree.n_nodes - 1), jnp.int32)
        logits = inputs.draft_logits  # [B,k,V] when the step projected the chains already
        if logits is None:
            logits = lm_logits(params, self.cfg, inputs.drafted)
        return tree_candidates(logits, tree)


def extend_vocabulary(cfg: LlamaConfig, params: dict, rows: jax.Array):
    """Adaptive tokens as real ids V..V+n-1 (mode a): embedding rows [n,D] appended and, for
    an untied lm_head, zero output columns (training pushes their logits down) ->
    (config with vocab_size V+n, params)."""
    params = dict(params)
    params["embed_tokens"] = jnp.concatenate(
        [params["embed_tokens"], rows.astype(params["embed_tokens"].dtype)]
    )
    if not cfg.tie_embeddings:
        head = params["lm_head"]
        params["lm_head"] = jnp.concatenate([head, jnp.zeros((cfg.dim, len(rows)), head.dtype)], 1)
    return dataclasses.replace(cfg, vocab_size=cfg.vocab_size + len(rows)), params
