"""The drafter protocol: what a drafter sees after the model ran (`DraftInputs`), what it
must provide (`Drafter`), and the empty drafter of plain AR decoding. Each method's drafter
lives in its own module beside this one; `registry` names them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import LlamaConfig
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import KVCache
from jaxspec.llama import run_layers
from jaxspec.topology import Calibration, Draft, Retrieved, select_nodes
from jaxspec.tree import DynamicTree, TreeSpec, tree_preset

# On CPU a 1-deep chain: larger trees cost more than their extra accepted tokens gain there.
CPU_TREE = "chain-1"


def default_tree(settings: DrafterSettings) -> str:
    """On CPU the tree measured fastest for the drafter (its `cpu_tree` setting, else
    CPU_TREE); on accelerators its `gpu_tree`, else its own 64-node searched tree when it
    ships one, else the 63-node preset."""
    if jax.default_backend() == "cpu":
        return settings.cpu_tree or CPU_TREE
    if settings.gpu_tree:
        return settings.gpu_tree
    return "searched-64" if "searched-64" in settings.trees else "gpu-63"


def resolve_tree(
    name: str | TreeSpec | DynamicTree, settings: DrafterSettings | None = None
) -> TreeSpec | DynamicTree:
    """A tree the drafter ships (its settings' trees) or a preset, by name; a TreeSpec or
    DynamicTree as given."""
    if isinstance(name, (TreeSpec, DynamicTree)):
        return name
    own = settings.trees if settings is not None else {}
    if isinstance(name, str) and name in own:
        return TreeSpec(own[name])
    try:
        return tree_preset(name)
    except JaxspecError as e:
        if not own:
            raise
        raise JaxspecError(f"{e}; this drafter's own: {', '.join(own)}") from None


@dataclasses.dataclass(frozen=True)
class Entered:
    """The tokens that entered the model's cache this round (prefill: the prompt; a verify
    step: the root and the accepted drafts): tokens [B,M] at positions start + 0..M-1,
    the first `count` [B] valid, and their states {layer count: [B,M,D]}."""

    tokens: jax.Array
    start: jax.Array
    count: jax.Array
    hidden: dict[int, jax.Array]


@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """What a drafter sees after the model ran (prefill or a verify step), per row:

    hidden: layer count -> [B,D] state (after that many layers) at the node whose
    prediction is `current`; current [B]: the newest token (next step's root), not yet in
    the cache; position [B]: its position; drafted: what the drafter's own `run_model`
    computed for that node (FIRP: pseudo states), else None;
    entered: what joined the cache this round; state: the drafter's own (see Drafter);
    draft_logits [B,R,V]: the vocabulary projection of the drafter's `projected_rows` at
    that node, when the step computed it together with the verify logits.
    """

    hidden: dict[int, jax.Array]
    current: jax.Array
    position: jax.Array
    drafted: jax.Array | None = None
    entered: Entered | None = None
    state: object = None
    draft_logits: jax.Array | None = None


class Drafter:
    """Base drafter. Subclasses are frozen dataclasses (hashable: they are static in jit).

    `collect`: the layer counts whose hidden states `propose` needs.
    `check_tree(tree)`: raise JaxspecError if the drafter cannot fill this tree.
    `run_model(...)`: the model's forward; drafters that draft inside it (FIRP) override it,
    and `prefill_model(...)` too (the prompt's forward: its rows alone, then the drafts').
    `propose(params, drafter_params, tree, inputs, key)` -> candidates [B, T-1] int32,
    the token for every non-root tree node (for a dynamic tree: a topology.Draft, the
    nodes it chose with their tokens). `key` is the drafter's own, apart from every key
    that samples or accepts tokens (fold in `inputs.position` or rows to vary it).
    Drafters with their own memory across steps (Chimera's encoder cache) override
    `init_state` and `advance`: the state is created once per generation (it may start from
    the drafter params, e.g. a pre-filled table), updated from `inputs.entered` before every
    `propose` (which reads it as `inputs.state`), and donated between steps so its buffers
    are updated in place.
    Drafters that need a forward of their own over the committed cache (SDSAT's adaptive
    tokens) set `drafts_from_cache`: their `draft_from_cache` runs as a separate program
    after each commit and its candidates replace `propose`'s.
    """

    collect: tuple[int, ...] = ()
    drafts_from_cache: bool = False
    # The deepest dynamic tree `propose` fills: from path-independent guesses
    # (tree_candidates: Medusa, FIRP) or by expanding node by node
    # (topology.expand_frontier: Chimera, EAGLE); None: static trees only.
    draft_depth: int | None = None
    # Drafters with path-independent guesses: per depth (slope, shift) mapping a guess's log
    # probability to its estimated acceptance in dynamic trees (topology.calibrated).
    calibration: Calibration = ()

    @classmethod
    def from_settings(cls, cfg: LlamaConfig, settings: DrafterSettings, **options) -> Drafter:
        """The drafter a folder's settings describe (its drafter.json), with the method's
        options (`registry.Method.options`) given."""
        raise NotImplementedError

    def select_tree(
        self, name: str | TreeSpec | DynamicTree | None, settings: DrafterSettings
    ) -> TreeSpec | DynamicTree:
        """The tree to verify: `name` (a preset or one of the drafter's own trees, or a tree
        built by hand), None: the drafter's default for this backend."""
        return resolve_tree(default_tree(settings) if name is None else name, settings)

    def for_tree(self, tree: TreeSpec, settings: DrafterSettings, data, **options) -> Drafter:
        """This drafter specialised for `tree` (FIRP places its pseudo chains); data: the
        folder's data arrays by name."""
        return self

    def check_tree(self, tree: TreeSpec) -> None:
        pass

    def run_model(
        self, params, drafter_params, cfg, h, positions, cache, new_mask, anchors, collect, depth
    ):
        """h [B,T,D] embedded new tokens -> (last-layer states [B,T,D], KVBlock of the T
        tokens, collected states, per-anchor drafts [B,A,...] or None). anchors [B,A]: the
        new tokens whose drafts may be needed (the last prompt token; every tree node);
        depth: how many draft depths the tree uses."""
        h, block, states = run_layers(params, cfg, h, positions, cache, new_mask, collect=collect)
        return h, block, states, None

    def prefill_model(self, *args):
        """run_model for a prompt (anchors: its last token). Drafters whose drafts run
        beside the real tokens override it to compute the prompt's rows exactly as the
        plain forward does (AR's prefill), bit for bit on any backend."""
        return self.run_model(*args)

    def propose(self, params, drafter_params, tree: TreeSpec, inputs: DraftInputs, key):
        raise NotImplementedError

    def guesses(self, params, drafter_params, tree, inputs: DraftInputs) -> jax.Array:
        """Drafters with path-independent guesses: per-depth guess logits [B,K,V] at the
        accepted node, which `propose` turns into candidates (tree_candidates)."""
        raise NotImplementedError

    def draft_dynamic(self, params, drafter_params, inputs: DraftInputs, tree: DynamicTree,
                      extra: Retrieved | None = None) -> Draft:  # fmt: skip
        """Drafters with a `draft_depth`: a dynamic tree's nodes, chosen among the
        drafter's guesses and `extra`'s retrieved chains (topology.select_nodes; drafters
        that expand node by node override it)."""
        logits = self.guesses(params, drafter_params, tree, inputs)
        return select_nodes(logits, tree, extra, self.calibration)

    def draft_from_cache(self, params, drafter_params, cache: KVCache, current, tree: TreeSpec):
        """cache: committed up to `current` [B] (the next root, not in it) -> candidates
        [B,T-1]. Used when `drafts_from_cache`; must not depend on random draws (the lossless
        sampler needs drafts fixed before its randomness)."""
        raise NotImplementedError

    def projected_rows(self, params, drafter_params, h, drafted, depth: int):
        """h [B,T,D] last-layer states of every tree node, drafted: run_model's drafts ->
        [B,T,R,D] vectors whose vocabulary projection `propose` will need at the accepted
        node (the step projects them with the verify rows: the [V,D] matrix is read once
        instead of twice), or None."""
        return None

    def prepare(self, params, drafter_params, data: dict):
        """-> the drafter params used for generation, from the loaded ones and the
        folder's data arrays (e.g. tables derived from the base model's weights)."""
        return drafter_params

    def init_state(self, cfg: LlamaConfig, batch: int, max_len: int, dtype, drafter_params=None):
        return None

    def advance(self, params, drafter_params, inputs: DraftInputs):
        """-> the drafter's state after `inputs.entered` joined the context."""
        return inputs.state

    def state_shardings(self, state, layout):
        """The state's tree of shardings on a mesh (a mesh.Layout): every array by rows."""
        return jax.tree.map(lambda _: layout.rows, state)


def tree_candidates(logits: jax.Array, tree: TreeSpec | DynamicTree,
                    calibration: Calibration = ()):  # fmt: skip
    """Per-depth guesses logits [B,K,V] (K >= max depth) -> candidates [B,T-1]: the node at
    depth d and rank r gets the rank-r token of depth d's guess; for a dynamic tree, the
    nodes of highest (calibrated) path probability (a topology.Draft)."""
    if isinstance(tree, DynamicTree):
        return select_nodes(logits, tree, calibration=calibration)
    top = jax.lax.top_k(logits, tree.width)[1]  # [B,K,width]
    depth, rank = jnp.asarray(tree.depth[1:]) - 1, jnp.asarray(tree.rank[1:])
    return top[:, depth, rank].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NoDrafter(Drafter):
    """Proposes nothing: with the empty tree, plain autoregressive decoding."""

    def propose(self, params, drafter_params, tree, inputs, key):
        return jnp.zeros((inputs.current.shape[0], tree.n_nodes - 1), jnp.int32)
