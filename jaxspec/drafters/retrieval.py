"""Retrieval candidates in dynamic trees: any drafter with dynamic trees (Medusa, FIRP,
Chimera, EAGLE) also offered lookup's continuations (what followed earlier occurrences of
the newest tokens in the prompt and output), on device with static shapes.

A retrieved node is scored, as SAM-Decoding does, by a confidence of its own: how often a
continuation matching the last m tokens is right (LOOKUP_CONFIDENCE), or by the drafter's
path probability where that is higher and known (path-independent guesses: Medusa, FIRP;
nodes the drafter expanded itself). The N-node budget keeps whichever paths score best.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.base import Drafter, DraftInputs
from jaxspec.drafters.lookup import LookupDrafter, LookupState
from jaxspec.errors import JaxspecError
from jaxspec.topology import Retrieved
from jaxspec.tree import DynamicTree

# LOOKUP_CONFIDENCE[m-1][j]: how often a continuation whose occurrence matched the last m
# tokens has its token j right, its tokens 0..j-1 right (deeper tokens: the last column).
# Measured by jaxspec.drafters.retrieval_confidence on SmolLM2-135M-Instruct's own greedy
# answers to 1600 ShareGPT prompts (the test split's 60 agree within 0.02 where tried
# 400+ times); docs/design.md has the table and its counts.
LOOKUP_CONFIDENCE = (
    (0.212, 0.577, 0.680, 0.745, 0.778, 0.805),
    (0.553, 0.666, 0.753, 0.787, 0.808, 0.842),
    (0.861, 0.899, 0.916, 0.928, 0.937, 0.943),
)


@flax.struct.dataclass
class RetrievalState:
    inner: object  # the drafter's own state (None for Medusa and FIRP)
    lookup: LookupState


@dataclasses.dataclass(frozen=True)
class RetrievalDrafter(Drafter):
    inner: Drafter
    chains: int = 4  # retrieved continuations offered each step
    lookup: LookupDrafter = LookupDrafter()
    # rows by match length, columns by depth (LOOKUP_CONFIDENCE's form); None: a retrieved
    # node scores only what the drafter gives its path
    confidence: tuple[tuple[float, ...], ...] | None = LOOKUP_CONFIDENCE

    @property
    def collect(self) -> tuple[int, ...]:
        return self.inner.collect

    @property
    def draft_depth(self) -> int | None:
        return self.inner.draft_depth

    def check_tree(self, tree) -> None:
        if not isinstance(tree, DynamicTree):
            raise JaxspecError(
                "retrieval candidates join dynamic trees (their nodes are chosen each step): "
                "pick a dynamic-N tree"
            )
        self.inner.check_tree(tree)

    def run_model(self, *args):
        return self.inner.run_model(*args)

    def prefill_model(self, *args):
        return self.inner.prefill_model(*args)

    def projected_rows(self, *args):
        return self.inner.projected_rows(*args)

    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None) -> RetrievalState:
        inner = self.inner.init_state(cfg, batch, max_len, dtype, drafter_params)
        return RetrievalState(inner, self.lookup.init_state(cfg, batch, max_len, dtype))

    def state_shardings(self, state: RetrievalState, layout):
        inner = self.inner.state_shardings(state.inner, layout)
        return RetrievalState(inner, jax.tree.map(lambda _: layout.rows, state.lookup))

    def advance(self, params, drafter_params, inputs: DraftInputs) -> RetrievalState:
        st = inputs.state
        inner = self.inner.advance(params, drafter_params, _with(inputs, st.inner))
        return RetrievalState(inner, self.lookup.advance(params, {}, _with(inputs, st.lookup)))

    def propose(self, params, drafter_params, tree: DynamicTree, inputs: DraftInputs, key):
        st = inputs.state
        found, matched = self.lookup.continuations(
            st.lookup.tokens, inputs.position, self.chains, tree.max_depth
        )  # [B,chains,D], [B,chains]
        extra = Retrieved(found, self.own_scores(matched, tree.max_depth))
        return self.inner.draft_dynamic(params, drafter_params, _with(inputs, st.inner), tree,
                                        extra)  # fmt: skip

    def own_scores(self, matched: jax.Array, depth: int) -> jax.Array:
        """matched [B,X] (each continuation's match length, 0: none) -> [B,X,depth]: the log
        confidence that the path to each of its tokens is right (-inf: none)."""
        if self.confidence is None:
            return jnp.full((*matched.shape, depth), -jnp.inf)
        table = np.asarray(self.confidence, np.float64)
        columns = np.minimum(np.arange(depth), table.shape[1] - 1)
        path = np.cumsum(np.log(table[:, columns]), axis=1)  # [G,depth]
        rows = jnp.clip(matched - 1, 0, len(table) - 1)
        score = jnp.asarray(path, jnp.float32)[rows]  # [B,X,depth]
        return jnp.where((matched > 0)[..., None], score, -jnp.inf)


def _with(inputs: DraftInputs, state) -> DraftInputs:
    return dataclasses.replace(inputs, state=state)
