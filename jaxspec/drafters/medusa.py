"""Medusa: K heads on the base model's last (normed) hidden state; head k guesses the token
k positions after the base model's own next token.

Head k: y = x + SiLU(x W_k + b_k) (W_k zero-initialised), then the vocabulary projection:
the frozen base lm_head by default (the drafter stays ~1.3 MB per head at D=576), or a
head-owned copy initialised from it (`own_lm_head`). Tree nodes at depth d, rank r take the
rank-r token of head d. A dynamic tree scores a guess by its head's probability mapped
through the head's calibration (a head guesses without the path before it, so its raw
probability is a poor estimate of acceptance given that path; train/calibration.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import LlamaConfig
from jaxspec.drafters.base import Drafter, tree_candidates
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError
from jaxspec.layers import dense
from jaxspec.llama import final_norm, vocab_projection
from jaxspec.topology import Calibration
from jaxspec.tree import TreeSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaSettings(DrafterSettings):
    n_heads: int
    own_lm_head: bool = False  # each head with its own vocabulary projection
    # per head (slope, shift): its guesses' probabilities as acceptance estimates in dynamic
    # trees (topology.calibrated), fitted on the trainer's test answers; None: as they are
    calibration: tuple[tuple[float, float], ...] | None = None


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
    cfg: LlamaConfig  # the base model's
    n_heads: int = 4
    own_lm_head: bool = False
    calibration: Calibration = ()

    @property
    def collect(self) -> tuple[int, ...]:
        return (self.cfg.n_layers,)

    @property
    def draft_depth(self) -> int:
        return self.n_heads

    @classmethod
    def from_settings(cls, cfg: LlamaConfig, settings: MedusaSettings, **options) -> MedusaDrafter:
        calibration = tuple(tuple(pair) for pair in settings.calibration or ())
        return cls(cfg, settings.n_heads, settings.own_lm_head, calibration)

    def init(self, base_params, key=None) -> dict:
        D = self.cfg.dim
        heads = [{"w": jnp.zeros((D, D)), "b": jnp.zeros((D,))} for _ in range(self.n_heads)]
        if self.own_lm_head:
            lm = (
                base_params["embed_tokens"].T if self.cfg.tie_embeddings else base_params["lm_head"]
            )
            for head in heads:
                head["lm_head"] = jnp.array(lm)
        return {"heads": heads}

    def head_vectors(self, base_params, params, h: jax.Array, n_heads: int | None = None):
        """h [...,D] pre-norm last-layer states -> the first n_heads heads' ResBlock
        outputs [...,K,D] (default all heads)."""
        heads = params["heads"][: n_heads or self.n_heads]
        x = final_norm(base_params, self.cfg, h)
        return jnp.stack(
            [x + jax.nn.silu(dense(x, head["w"]) + head["b"]).astype(x.dtype) for head in heads],
            -2,
        )

    def head_logits(self, base_params, params, h: jax.Array, n_heads: int | None = None):
        """h [...,D] pre-norm last-layer states -> logits [...,K,V] float32."""
        ys = self.head_vectors(base_params, params, h, n_heads)
        if self.own_lm_head:
            heads = params["heads"][: ys.shape[-2]]
            return jnp.stack(
                [dense(ys[..., k, :], hd["lm_head"]) for k, hd in enumerate(heads)],
                -2,
            )
        # One projection for all heads: the [V,D] matrix is read once, not once per head.
        return vocab_projection(base_params, self.cfg, ys)

    def projected_rows(self, params, drafter_params, h, drafted, depth):
        if self.own_lm_head or depth == 0:
            return None
        return self.head_vectors(params, drafter_params, h, depth)

    def check_tree(self, tree: TreeSpec) -> None:
        if tree.max_depth > self.n_heads:
            raise JaxspecError(
                f"tree depth {tree.max_depth} exceeds the drafter's {self.n_heads} Medusa heads; "
                "pick a shallower tree"
            )

    def guesses(self, params, drafter_params, tree, inputs) -> jax.Array:
        """The heads' logits [B,d,V] at the accepted node (d = the tree's depth)."""
        if inputs.draft_logits is not None:  # the step projected the heads already
            return inputs.draft_logits
        hidden = inputs.hidden[self.cfg.n_layers]
        return self.head_logits(params, drafter_params, hidden, tree.max_depth)

    def propose(self, params, drafter_params, tree: TreeSpec, inputs, key):
        if tree.n_nodes == 1:
            return jnp.zeros((inputs.current.shape[0], 0), jnp.int32)
        logits = self.guesses(params, drafter_params, tree, inputs)
        return tree_candidates(logits, tree, self.calibration)
