"""Dynamic trees: each step the N drafted nodes of highest path probability, chosen on
device with static shapes; their topology verified and accepted like a static tree's, and
decoding that stays AR's (the sampling distribution: tests/test_speculative.py)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import export
from jaxspec.errors import JaxspecError
from jaxspec.topology import (
    Retrieved,
    expand_frontier,
    parent_topology,
    select_nodes,
    static_topology,
    tree_topology,
)
from jaxspec.tree import DynamicTree, tree_preset


def brute_force_scores(logits: np.ndarray, depth: int, width: int, calibration=()) -> np.ndarray:
    """Every path of top-`width` ranks up to `depth` -> its log path probability, best
    first (one row of per-depth logits [K,V]; each factor calibrated when asked)."""
    logp = np.array(jax.nn.log_softmax(jnp.asarray(logits[:depth], jnp.float32), axis=-1))
    for d, (slope, shift) in enumerate(calibration[:depth]):
        logp[d] = np.minimum(0.0, slope * logp[d] + shift)
    top = np.sort(logp, axis=-1)[:, ::-1][:, :width]  # [depth,width]
    paths = [p for n in range(1, depth + 1) for p in itertools.product(range(width), repeat=n)]
    scores = [sum(top[d, r] for d, r in enumerate(path)) for path in paths]
    return np.sort(scores)[::-1]


@pytest.mark.parametrize("nodes, depth, width", [(6, 3, 3), (16, 4, 4), (10, 2, 5)])
def test_chosen_nodes_are_the_best_by_the_drafters_scores(nodes, depth, width):
    tree = DynamicTree(nodes + 1, depth, width)  # `nodes` drafted nodes and the root
    logits = 2.0 * jax.random.normal(jax.random.key(nodes), (3, depth, 17))
    draft = select_nodes(logits, tree)
    logp = jax.nn.log_softmax(logits, axis=-1)
    for b in range(3):
        tokens, parent, d = (np.asarray(x[b]) for x in (draft.tokens, draft.parent, draft.depth))
        # each node's score: its parent's plus its own token's log probability at its depth
        score = np.zeros(nodes + 1)
        depth_of = np.concatenate([[0], d])
        for n in range(1, nodes + 1):
            p = parent[n - 1]
            assert p < n and depth_of[n] == depth_of[p] + 1  # parents first, one level up
            score[n] = score[p] + float(logp[b, depth_of[n] - 1, tokens[n - 1]])
        best = brute_force_scores(np.asarray(logits[b]), depth, width)[:nodes]
        np.testing.assert_allclose(np.sort(score[1:])[::-1], best, rtol=1e-5, atol=1e-5)
        siblings = [(parent[i], tokens[i]) for i in range(nodes)]
        assert len(set(siblings)) == nodes  # no node twice


CALIBRATION = ((0.9, -0.3), (0.5, -2.0), (1.2, 0.4), (1.0, -0.1))


@pytest.mark.parametrize("nodes, depth, width", [(6, 3, 3), (16, 4, 4)])
def test_calibrated_nodes_are_the_best_by_the_calibrated_scores(nodes, depth, width):
    tree = DynamicTree(nodes + 1, depth, width)
    logits = 2.0 * jax.random.normal(jax.random.key(nodes + 1), (2, depth, 17))
    draft = select_nodes(logits, tree, calibration=CALIBRATION)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for b in range(2):
        tokens, parent, d = (np.asarray(x[b]) for x in (draft.tokens, draft.parent, draft.depth))
        score, depth_of = np.zeros(nodes + 1), np.concatenate([[0], d])
        for n in range(1, nodes + 1):
            slope, shift = CALIBRATION[depth_of[n] - 1]
            own = min(0.0, slope * float(logp[b, depth_of[n] - 1, tokens[n - 1]]) + shift)
            score[n] = score[parent[n - 1]] + own
        best = brute_force_scores(np.asarray(logits[b]), depth, width, CALIBRATION)[:nodes]
        np.testing.assert_allclose(np.sort(score[1:])[::-1], best, rtol=1e-5, atol=1e-5)
    # the calibration moves nodes: the raw scores choose another tree
    raw = select_nodes(logits, tree)
    assert not np.array_equal(np.asarray(raw.depth), np.asarray(draft.depth))


def test_ties_keep_every_parent():
    """Uniform guesses tie every node of a depth: parents still come first."""
    draft = select_nodes(jnp.zeros((1, 3, 9)), DynamicTree(13, 3, 3))
    parent = np.asarray(draft.parent[0])
    assert all(p < n for n, p in enumerate(parent, start=1))
    assert sorted(np.asarray(draft.depth[0]).tolist()) == [1] * 3 + [2] * 9


@pytest.mark.parametrize("name", ["cpu-8", "comb-2-3", "gpu-32"])
def test_topology_from_parents_equals_the_static_trees(name):
    tree = tree_preset(name)
    static = static_topology(tree, 1)
    built = parent_topology(
        jnp.asarray(np.maximum(tree.parent, 0))[None], jnp.asarray(tree.depth)[None],
        tree.max_depth, tree.children.shape[1],
    )  # fmt: skip
    np.testing.assert_array_equal(built.mask, static.mask)
    np.testing.assert_array_equal(built.children, static.children)  # rank order = node order
    leaves = [row[row >= 0][-1] for row in tree.retrieve]
    np.testing.assert_array_equal(built.paths[0, leaves], static.paths[0])


def test_dynamic_tree_names_and_bad_sizes():
    assert tree_preset("dynamic-16") == DynamicTree(16, 0, 8)
    assert tree_preset("dynamic-16-3-5") == DynamicTree(16, 3, 5)
    assert tree_preset("dynamic-16").at_depth(4).max_depth == 4
    assert tree_preset("dynamic-7-2-2").n_nodes == 7  # the root and all 6 nodes of depth <= 2
    with pytest.raises(JaxspecError, match="only 6 nodes within depth 2"):
        tree_preset("dynamic-8-2-2")


PROMPTS = ["w5 w9 w7 w11", "w8 w30 w8"]


@pytest.mark.parametrize("method, tree", [("medusa", "dynamic-8"), ("medusa", "dynamic-16-2-10"),
                                          ("firp", "dynamic-8"), ("chimera", "dynamic-8"),
                                          ("chimera", "dynamic-12-2-6")])  # fmt: skip
def test_dynamic_trees_decode_ars_tokens(tiny_model, tiny_drafters, method, tree):
    ar = jaxspec.Generator(tiny_model).generate(PROMPTS, max_new_tokens=16)
    gen = jaxspec.Generator(tiny_model, method, drafter=tiny_drafters / method, tree=tree)
    got = gen.generate(PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert sum(r.steps for r in got) < sum(r.steps for r in ar)  # drafts were accepted


def test_drafters_of_fixed_trees_refuse_dynamic_ones(tiny_model, tiny_drafters):
    with pytest.raises(JaxspecError, match="chooses its nodes each step"):
        jaxspec.Generator(tiny_model, "sdsat", drafter=tiny_drafters / "sdsat", tree="dynamic-8")
    with pytest.raises(JaxspecError, match="pseudo chains go on every node"):
        jaxspec.Generator(tiny_model, "firp", drafter=tiny_drafters / "firp", tree="dynamic-8",
                          firp_chains=2)  # fmt: skip


@pytest.mark.parametrize("method, retrieval", [("medusa", None), ("eagle", 2)])
def test_export_dynamic_tree_step(tiny_model, tiny_drafters, method, retrieval):
    """The verify step with a topology chosen on device (with retrieved chains merged in
    by scatter-max) lowers for cuda and tpu."""
    from jaxspec.methods import build_generator

    decoder = build_generator(tiny_model, method, tiny_drafters / method, tree="dynamic-8",
                              retrieval=retrieval)  # fmt: skip
    plan = decoder.lowerings(*decoder.example_inputs(2, 16, 64))
    exported = export.export_all({k: plan[k] for k in ("prefill", "step")})
    assert set(exported["step"]) == set(export.ACCELERATORS)


def test_tree_topology_of_a_draft_is_the_drafts():
    tree = DynamicTree(5, 2, 2)
    draft = select_nodes(jax.random.normal(jax.random.key(3), (1, 2, 7)), tree)
    tokens, topo = tree_topology(jnp.array([5]), draft, tree)
    assert tokens[0, 0] == 5 and tokens.shape == (1, 5)
    parent = np.concatenate([[0], np.asarray(draft.parent[0])])
    for n in range(5):  # a node sees itself and its ancestors, nothing else
        expected, m = np.zeros(5, bool), n
        while True:
            expected[m] = True
            if m == 0:
                break
            m = parent[m]
        np.testing.assert_array_equal(topo.mask[0, n], expected)


def test_tree_topology_of_a_batch_is_each_rows_own():
    """Rows of a batch choose different trees: each row's topology is the one it gets
    alone (no row reads another's parents or depths)."""
    tree = DynamicTree(5, 3, 2)
    sure = jnp.zeros((3, 7)).at[:, 1].set(8.0)  # row 0: one sure guess a depth (a chain)
    draft = select_nodes(jnp.stack([sure, jnp.zeros((3, 7))]), tree)  # row 1: flat (a bush)
    np.testing.assert_array_equal(draft.depth, [[1, 2, 3, 1], [1, 1, 2, 2]])
    current = jnp.array([5, 6])
    tokens, topo = tree_topology(current, draft, tree)
    for b in range(2):
        row = jax.tree.map(lambda x, b=b: x[b : b + 1], draft)
        own_tokens, own = tree_topology(current[b : b + 1], row, tree)
        np.testing.assert_array_equal(tokens[b], own_tokens[0])
        for got, want in zip(jax.tree.leaves(topo), jax.tree.leaves(own), strict=True):
            np.testing.assert_array_equal(got[b], want[0])


def chosen_paths(draft, b: int) -> list[tuple[int, ...]]:
    """Each chosen node's token path from the root (row b)."""
    parent, tokens = np.asarray(draft.parent[b]), np.asarray(draft.tokens[b])
    paths = {0: ()}
    for n in range(1, len(tokens) + 1):
        paths[n] = paths[int(parent[n - 1])] + (int(tokens[n - 1]),)
    return [paths[n] for n in range(1, len(tokens) + 1)]


def test_a_retrieved_chain_wins_nodes_by_the_drafters_own_scores():
    """Top-1 guesses alone give 1 and 1 -> 5; the retrieved 2 (almost as likely as 1 at
    depth 1) beats 1 -> 5, so a 3-node tree takes it; an unknown token adds nothing."""
    logits = jnp.full((1, 2, 8), -9.0)
    logits = logits.at[0, 0, 1].set(3.0).at[0, 0, 2].set(2.9)  # depth 1: 1, 2 close behind
    logits = logits.at[0, 1, 5].set(1.0).at[0, 1, 6].set(0.9)  # depth 2: 5, 6 close behind
    tree = DynamicTree(3, 2, 1)
    assert chosen_paths(select_nodes(logits, tree), 0) == [(1,), (1, 5)]
    chains = jnp.array([[[2, 5], [-1, -1]]])  # [B,X,D]
    none = jnp.full(chains.shape, -jnp.inf)  # no confidence of their own
    assert chosen_paths(select_nodes(logits, tree, Retrieved(chains, none)), 0) == [(1,), (2,)]
    # its own confidence (log 0.9, 0.9 * 0.8: above the drafter's ~0.5) takes both places
    sure = jnp.log(jnp.array([[[0.9, 0.72], [0.9, 0.72]]]))
    assert chosen_paths(select_nodes(logits, tree, Retrieved(chains, sure)), 0) == [(2,), (2, 5)]


def chain_scores(rng, X: int, D: int) -> np.ndarray:
    """Random own scores [1,X,D], non-increasing along each chain; some chains none."""
    own = np.cumsum(np.log(rng.uniform(0.05, 1.0, (1, X, D))), axis=2)
    own[0, rng.random(X) < 0.3] = -np.inf
    return own.astype(np.float32)


@pytest.mark.parametrize("seed", range(6))
def test_chosen_nodes_are_the_best_of_guesses_and_retrieved_paths(seed):
    """Random guesses and chains (one repeating a guessed path, one known a token ahead)
    with random own scores: the chosen paths are distinct, each a guessed path or a
    chain's prefix, and the N best of their union, a path scoring the higher of the
    drafter's path probability and the best own score of a chain node on it."""
    N, D, k, V = 9, 3, 2, 6
    key = jax.random.key(seed)
    rng = np.random.default_rng(seed)
    logits = 2.0 * jax.random.normal(key, (1, D, V))
    logp = np.asarray(jax.nn.log_softmax(logits, -1))[0]
    top = np.argsort(-logp, axis=-1)[:, :k]
    chains = np.array(jax.random.randint(jax.random.fold_in(key, 1), (1, 3, D), 0, V))
    chains[0, 0] = top[np.arange(D), 0]  # the best guessed path, retrieved again
    chains[0, 2, 1:] = -1  # known only one token ahead
    own = chain_scores(rng, 3, D) if seed % 3 else np.full((1, 3, D), -np.inf, np.float32)
    draft = select_nodes(logits, DynamicTree(N + 1, D, k),
                         Retrieved(jnp.asarray(chains), jnp.asarray(own)))  # fmt: skip
    paths = chosen_paths(draft, 0)
    assert len(set(paths)) == N
    mine = {}  # path -> the best own score a chain gives it
    for x, chain in enumerate(chains[0].tolist()):
        for n in range(D):
            if -1 not in chain[: n + 1]:
                path = tuple(chain[: n + 1])
                mine[path] = max(mine.get(path, -np.inf), own[0, x, n])

    def score(path):
        return max(sum(logp[d, t] for d, t in enumerate(path)), mine.get(path, -np.inf))

    guessed = {tuple(top[d, r] for d, r in enumerate(ranks)) for n in range(1, D + 1)
               for ranks in itertools.product(range(k), repeat=n)}  # fmt: skip
    union = guessed | set(mine)
    assert set(paths) <= union
    best = sorted((score(p) for p in union), reverse=True)[:N]
    np.testing.assert_allclose(sorted(map(score, paths), reverse=True), best, rtol=1e-5)


def toy_expansion(table: jax.Array, k: int):
    """A drafter for expand_frontier whose guesses after a path depend on its last token:
    log-probability table [V,V] -> (the root's top-k, expand)."""
    lp_of = jax.nn.log_softmax(table, -1)

    def expand(d, paths, carry, above, keys, values):
        lp, token = jax.lax.top_k(lp_of[paths[:, :, -1]], k)  # [B,k,k]
        B = paths.shape[0]
        empty = jnp.zeros((B, 1, k, 1))
        return lp, token, empty, empty, carry

    score, token = jax.lax.top_k(lp_of[:1], k)  # the root is token 0
    return score, token, expand


@pytest.mark.parametrize("seed", range(3))
def test_per_node_expansion_takes_confident_retrieved_chains(seed):
    """expand_frontier with chains: without own scores the tree is the drafter's alone; a
    chain certain of itself (score 0 = probability 1) is in the tree whole, the other
    places go to the drafter's best nodes, and every parent comes before its children."""
    N, D, k, V = 10, 4, 3, 12
    table = 3.0 * jax.random.normal(jax.random.key(seed), (V, V))
    score, token, expand = toy_expansion(table, k)
    tree = DynamicTree(N + 1, D, k)
    empty = jnp.zeros((1, 1, 0, 1))

    def run(extra):
        front = jnp.zeros((1, k, 0), bool)
        return expand_frontier(score, token, tree, expand, None, front, empty, empty, extra)

    alone = chosen_paths(run(None), 0)
    chains = jnp.asarray(np.random.default_rng(seed).integers(0, V, (1, 2, D)))
    ignored = run(Retrieved(chains, jnp.full((1, 2, D), -jnp.inf)))
    assert chosen_paths(ignored, 0) == alone
    sure = run(Retrieved(chains, jnp.zeros((1, 2, D)).at[0, 1].set(-jnp.inf)))
    paths = chosen_paths(sure, 0)
    whole = [tuple(np.asarray(chains[0, 0, : n + 1]).tolist()) for n in range(D)]
    assert set(whole) <= set(paths) and len(set(paths)) == N
    rest = [p for p in alone if p not in whole]
    assert set(paths) - set(whole) == set(rest[: N - D])
    parent = np.asarray(sure.parent[0])
    assert all(p < n for n, p in enumerate(parent, start=1))


@pytest.mark.parametrize("method", ["medusa", "firp", "chimera", "eagle"])
def test_retrieval_candidates_decode_ars_tokens(tiny_model, tiny_drafters, method):
    """Repeating prompts: the untrained drafters' guesses are near uniform, so confident
    retrieved chains take nodes, and many steps accept more than lookup-free trees do."""
    prompts = ["w5 w9 w7 w11 w5 w9 w7 w11 w5 w9", "w8 w8 w8"]
    ar = jaxspec.Generator(tiny_model).generate(prompts, max_new_tokens=16)
    runs = {}
    for retrieval in (None, 2):
        gen = jaxspec.Generator(tiny_model, method, drafter=tiny_drafters / method,
                                tree="dynamic-8", retrieval=retrieval)  # fmt: skip
        runs[retrieval] = gen.generate(prompts, max_new_tokens=16)
        assert [r.token_ids for r in runs[retrieval]] == [r.token_ids for r in ar]
    steps = {r: sum(x.steps for x in got) for r, got in runs.items()}
    assert steps[2] < steps[None]  # the retrieved nodes were accepted


def test_own_scores_are_the_measured_confidences():
    from jaxspec.drafters.medusa import MedusaDrafter
    from jaxspec.drafters.retrieval import LOOKUP_CONFIDENCE, RetrievalDrafter

    drafter = RetrievalDrafter(MedusaDrafter(None, 2), 3)
    got = np.asarray(drafter.own_scores(jnp.array([[3, 1, 0]]), 8))
    table = np.asarray(LOOKUP_CONFIDENCE)
    np.testing.assert_allclose(np.exp(got[0, 0, :2]), [table[2, 0], table[2, 0] * table[2, 1]],
                               rtol=1e-5)  # fmt: skip
    ratio = np.exp(got[0, 1, 7] - got[0, 1, 6])
    np.testing.assert_allclose(ratio, table[0, -1], rtol=1e-5)  # past the table: its last
    assert np.all(got[0, 2] == -np.inf)  # no match
    none = RetrievalDrafter(MedusaDrafter(None, 2), 3, confidence=None)
    assert np.all(np.asarray(none.own_scores(jnp.array([[3]]), 2)) == -np.inf)


def test_retrieval_needs_a_dynamic_tree_and_a_drafter_with_dynamic_trees(tiny_model, tiny_drafters):
    from jaxspec.drafters.registry import parse_row

    with pytest.raises(JaxspecError, match="retrieval candidates join dynamic trees"):
        jaxspec.Generator(tiny_model, "medusa", drafter=tiny_drafters / "medusa", tree="cpu-8",
                          retrieval=2)  # fmt: skip
    with pytest.raises(
        JaxspecError, match=r"retrieval \(--retrieval\) applies to method medusa, firp, chim"
    ):
        jaxspec.Generator(tiny_model, "sdsat", drafter=tiny_drafters / "sdsat", retrieval=2)
    assert parse_row("eagle@dynamic-16+2:bfloat16") == (
        "eagle",
        {"tree": "dynamic-16", "retrieval": 2},
        "bfloat16",
    )
    with pytest.raises(JaxspecError, match=r"\+R .* applies to medusa, firp, chimera, eagle"):
        parse_row("sdsat+2")


@pytest.mark.parametrize("method", ["chimera", "eagle"])
def test_per_node_expansion_of_one_guess_a_node_is_the_top1_chain(tiny_model, method):
    """dynamic-4-3-1 (one guess a node: the frontier is the top-1 path) drafts exactly
    the static chain-3's tokens (per-node expansion computes what static drafting does)."""
    from jaxspec.decode import prefill_and_draft
    from jaxspec.drafters.eagle import EagleDrafter
    from jaxspec.sampling import Sampling
    from tests.test_chimera import random_chimera
    from tests.test_eagle import trained_like

    cfg, params = tiny_model.cfg, tiny_model.params
    if method == "chimera":
        drafter, dparams = random_chimera(cfg, params, n_heads=3)
    else:
        drafter = EagleDrafter(cfg, (1, 1, 2), 3)
        dparams = trained_like(drafter, params, seed=3)
    tokens = jnp.asarray([[5, 9, 7, 11, 5, 2], [8, 30, 8, 0, 0, 0]])
    lengths = jnp.asarray([6, 3])
    drafts = {}
    for tree in ("chain-3", "dynamic-4-3-1"):
        state = drafter.init_state(cfg, 2, 32, jnp.float32)
        _, drafts[tree], _, _ = prefill_and_draft(
            params, dparams, tokens, lengths, jax.random.key(0), state, cfg=cfg,
            sampling=Sampling(), tree=tree_preset(tree), drafter=drafter,
        )  # fmt: skip
    dynamic = drafts["dynamic-4-3-1"]
    np.testing.assert_array_equal(dynamic.tokens, drafts["chain-3"])
    np.testing.assert_array_equal(dynamic.parent, [[0, 1, 2]] * 2)


def beam_pool(log_probs, depth: int, k: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2's search, by hand: each depth's `k` best nodes by path probability expand
    their top-k guesses (log_probs(path) [V]: the guesses after a token path) -> every
    scored path and its log path probability."""

    def children(path, score):
        lp = log_probs(path)
        return [(path + (int(t),), score + float(lp[t]))
                for t in np.argsort(-lp, kind="stable")[:k]]  # fmt: skip

    front, pool = children((), 0.0), {}
    pool.update(front)
    for _ in range(2, depth + 1):
        grown = [c for path, score in front for c in children(path, score)]
        pool.update(grown)
        front = sorted(grown, key=lambda c: -c[1])[:k]
    return pool


def assert_the_n_best_of(pool: dict, paths: list, n: int, tol: float) -> None:
    """The chosen paths are n distinct ones of the search's pool, and its n best."""
    assert len(set(paths)) == n and set(paths) <= set(pool)
    best = sorted(pool.values(), reverse=True)[:n]
    chosen = sorted((pool[p] for p in paths), reverse=True)
    np.testing.assert_allclose(chosen, best, rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(3))
def test_per_node_expansion_expands_the_width_best_of_each_depth(seed):
    """expand_frontier against the search by hand: the frontier of each depth is its k
    best nodes (not any k), each node scores its parent's score plus its own guess's,
    and the tree is the N best of every scored node."""
    N, D, k, V = 12, 4, 3, 16
    table = 3.0 * jax.random.normal(jax.random.key(10 + seed), (V, V))
    score, token, expand = toy_expansion(table, k)
    front = jnp.zeros((1, k, 0), bool)
    empty = jnp.zeros((1, 1, 0, 1))
    draft = expand_frontier(score, token, DynamicTree(N + 1, D, k), expand, None, front,
                            empty, empty)  # fmt: skip
    lp_of = np.asarray(jax.nn.log_softmax(table, -1))  # guesses after a path's last token
    pool = beam_pool(lambda path: lp_of[path[-1] if path else 0], D, k)  # the root is 0
    paths = chosen_paths(draft, 0)
    assert_the_n_best_of(pool, paths, N, 1e-5)
    assert max(len(p) for p in paths) == D  # the search reached the depth bound


def test_a_calibration_above_one_is_capped_so_parents_stay_chosen():
    """A calibration mapping a confident guess above probability 1 is capped at 1 (log 0):
    a child never outscores its parent, so a one-node tree is a depth-1 node, not an
    orphaned depth-2 one."""
    from jaxspec.topology import calibrated

    lp = jnp.log(jnp.array([[[0.9, 0.05], [0.99, 0.001]]]))  # [B,D,k]
    got = np.asarray(calibrated(lp, ((1.0, 0.0), (1.2, 0.4))))
    np.testing.assert_allclose(got[0, 0], np.log([0.9, 0.05]), rtol=1e-6)
    assert got[0, 1, 0] == 0.0 and got[0, 1, 1] < 0
    logits = jnp.array([[[2.0, 0.0, -1.0], [6.0, -2.0, -2.0]]])  # depth 2 near certain
    draft = select_nodes(logits, DynamicTree(2, 2, 2), calibration=((1.0, 0.0), (1.0, 0.5)))
    assert draft.depth.tolist() == [[1]] and draft.tokens.tolist() == [[0]]


def test_per_node_expansion_ranks_the_roots_guesses_as_static_drafting(tiny_model):
    """dynamic-13-1-12 (the root's 12 best guesses, best first) drafts what the static
    comb-1-12 (ranks 0..11 of depth 1) does: the same guesses, in the same order (the
    root's entry run at the same position)."""
    from jaxspec.decode import prefill_and_draft
    from jaxspec.sampling import Sampling
    from tests.test_chimera import random_chimera

    cfg, params = tiny_model.cfg, tiny_model.params
    drafter, dparams = random_chimera(cfg, params, n_heads=3)
    tokens = jnp.asarray([[5, 9, 7, 11, 5, 2], [8, 30, 8, 0, 0, 0]])
    drafts = {}
    for tree in ("comb-1-12", "dynamic-13-1-12"):
        state = drafter.init_state(cfg, 2, 32, jnp.float32)
        _, drafts[tree], _, _ = prefill_and_draft(
            params, dparams, tokens, jnp.asarray([6, 3]), jax.random.key(0), state, cfg=cfg,
            sampling=Sampling(), tree=tree_preset(tree), drafter=drafter,
        )  # fmt: skip
    np.testing.assert_array_equal(drafts["dynamic-13-1-12"].tokens, drafts["comb-1-12"])
