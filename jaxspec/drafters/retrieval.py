"""Retrieval candidates in dynamic trees: a drafter with per-depth guesses (Medusa, FIRP)
whose dynamic tree also weighs lookup's continuations (what followed earlier occurrences
of the newest tokens in the prompt and output), scored with the drafter's own
probabilities, so the N-node budget keeps whichever paths are likelier (SAM-Decoding's
idea, on device with static shapes)."""

from __future__ import annotations

import dataclasses

import flax.struct

from jaxspec.drafters.base import Drafter, DraftInputs
from jaxspec.drafters.lookup import LookupDrafter, LookupState
from jaxspec.errors import JaxspecError
from jaxspec.topology import select_nodes
from jaxspec.tree import DynamicTree


@flax.struct.dataclass
class RetrievalState:
    inner: object  # the drafter's own state (None for Medusa and FIRP)
    lookup: LookupState


@dataclasses.dataclass(frozen=True)
class RetrievalDrafter(Drafter):
    inner: Drafter
    chains: int = 4  # retrieved continuations offered each step
    lookup: LookupDrafter = LookupDrafter()

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

    def projected_rows(self, *args):
        return self.inner.projected_rows(*args)

    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None) -> RetrievalState:
        inner = self.inner.init_state(cfg, batch, max_len, dtype, drafter_params)
        return RetrievalState(inner, self.lookup.init_state(cfg, batch, max_len, dtype))

    def advance(self, params, drafter_params, inputs: DraftInputs) -> RetrievalState:
        st = inputs.state
        inner = self.inner.advance(params, drafter_params, _with(inputs, st.inner))
        return RetrievalState(inner, self.lookup.advance(params, {}, _with(inputs, st.lookup)))

    def propose(self, params, drafter_params, tree: DynamicTree, inputs: DraftInputs, key):
        st = inputs.state
        logits = self.inner.guesses(params, drafter_params, tree, _with(inputs, st.inner))
        found = self.lookup.continuations(
            st.lookup.tokens, inputs.position, self.chains, tree.max_depth
        )  # [B,chains,D]
        return select_nodes(logits, tree, found)


def _with(inputs: DraftInputs, state) -> DraftInputs:
    return dataclasses.replace(inputs, state=state)
