"""The speculative engine: tree constants, lossless greedy and sampling, compile reuse."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import LlamaConfig, preset
from jaxspec.decode import (
    SpeculativeGenerator,
    prefill_and_draft,
    redraft,
    speculative_step,
    step_bytes,
)
from jaxspec.drafters.base import Drafter
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask, commit, init_cache
from jaxspec.llama import compute_params, forward, init_params, lm_logits
from jaxspec.sampling import Sampling, warped_logprobs
from jaxspec.topology import static_topology
from jaxspec.tree import DynamicTree, TreeSpec, expected_tokens_per_step, search_tree, tree_preset
from jaxspec.verify import accept_greedy, accept_sampling
from tests.drafters import OracleDrafter, RandomDrafter
from tests.test_generate import n_programs

TREES = ["chain-4", "cpu-8", "cpu-16", "cpu-24"]


def test_tree_constants_literal():
    tree = TreeSpec([(1,), (0, 0), (0,)])
    assert tree.paths == ((0,), (1,), (0, 0))
    np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2])
    np.testing.assert_array_equal(tree.parent, [-1, 0, 0, 1])
    np.testing.assert_array_equal(
        tree.mask, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    )
    np.testing.assert_array_equal(tree.retrieve, [[0, 2, -1], [0, 1, 3]])
    np.testing.assert_array_equal(tree.children, [[1, 2], [3, -1], [-1, -1], [-1, -1]])
    assert hash(tree) == hash(TreeSpec([(0,), (1,), (0, 0)]))


def test_empty_tree_is_ar():
    tree = TreeSpec(())
    assert tree.n_nodes == 1 and tree.max_depth == 0
    np.testing.assert_array_equal(tree.retrieve, [[0]])


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0,), (1, 0)], "has no parent"),
        ([(0,), (0,)], "listed twice"),
        ([(0,), (-1,)], "ranks >= 0"),
        ([()], "non-empty"),
    ],
)
def test_bad_trees_are_clear_errors(paths, message):
    with pytest.raises(JaxspecError, match=message):
        TreeSpec(paths)
    with pytest.raises(JaxspecError, match="unknown tree"):
        tree_preset("nope")


@pytest.mark.parametrize("name", ["chain-99999", "comb-2000-3"])
def test_trees_deeper_than_any_drafter_are_refused_before_they_are_built(name):
    """(chain-99999's paths would hold ~5e9 ranks: the process would die for memory.)"""
    with pytest.raises(JaxspecError, match=f"tree {name} is \\d+ tokens deep; trees go at most"):
        tree_preset(name)
    assert tree_preset("chain-1024").n_nodes == 1025


def test_tree_search_is_optimal_on_a_small_case():
    acc = np.array([[0.7, 0.2], [0.5, 0.1]])
    tree = search_tree(acc, 4)  # values: (0)=.7 (0,0)=.35 (1)=.2 (0,1)=.07 (1,0)=.1
    assert tree.paths == ((0,), (1,), (0, 0))
    assert tree_preset("gpu-63").n_nodes == 64 and tree_preset("cpu-16").n_nodes == 16
    # Expected tokens per step from the cumulative top-k accuracy: 1 (bonus) + .7 + .2 + .35.
    assert expected_tokens_per_step(tree, [[0.7, 0.9], [0.5, 0.6]]) == pytest.approx(2.25)


def tiny(name="tiny-gqa", vocab=None) -> tuple[LlamaConfig, dict]:
    cfg = dataclasses.replace(preset(name), eos_token_ids=())
    if vocab:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    return cfg, init_params(cfg, jax.random.key(0), scale=0.3)


def random_and_oracle_vs_ar(cfg, params, tree):
    """-> (AR's tokens, a random drafter's, the oracle drafter's generation result)."""
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 40).token_ids
    random = SpeculativeGenerator(cfg, params, RandomDrafter(cfg.vocab_size), None, tree)
    reference = jnp.asarray(prompt + ar + [0] * 16, jnp.int32)
    oracle = SpeculativeGenerator(cfg, params, OracleDrafter(cfg.vocab_size), reference, tree)
    return ar, random.generate(prompt, 40).token_ids, oracle.generate(prompt, 40)


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mqa"])
@pytest.mark.parametrize("tree_name", TREES)
def test_greedy_is_lossless_with_random_and_oracle_drafters(name, tree_name):
    cfg, params = tiny(name)
    tree = tree_preset(tree_name)
    ar, random, oracle = random_and_oracle_vs_ar(cfg, params, tree)
    assert random == ar
    assert oracle.token_ids == ar
    # Right guesses are accepted: nearly max_depth + 1 tokens per step.
    assert oracle.mean_accepted > tree.max_depth * 0.8


@pytest.mark.parametrize("tree_name", ["chain-4", "cpu-16"])
def test_bfloat16_weights_decode_like_ar_on_a_tiny_model(tree_name):
    """bfloat16 weights (float32-exact activations, `layers.dense`) through the whole loop:
    the random and the oracle drafter give AR's output in that precision too."""
    cfg, params = tiny("tiny-mqa")
    ar, random, oracle = random_and_oracle_vs_ar(
        cfg, compute_params(params, "bfloat16"), tree_preset(tree_name)
    )
    assert random == ar
    assert oracle.token_ids == ar


@pytest.mark.parametrize("tree_name", [None, "cpu-8"])
def test_batch_rows_equal_single_prompts(tree_name):
    cfg, params = tiny()
    prompts = [[5, 6, 7, 8, 9], [3, 1], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    # An EOS the first prompt reaches early, so rows finish at different steps.
    eos = SpeculativeGenerator(cfg, params).generate(prompts[0], 30).token_ids[6]
    cfg = dataclasses.replace(cfg, eos_token_ids=(eos,))
    singles = [SpeculativeGenerator(cfg, params).generate(p, 30).token_ids for p in prompts]
    assert len(singles[0]) <= 7 and singles[0][-1] == eos
    tree = tree_preset(tree_name) if tree_name else None
    gen = SpeculativeGenerator(cfg, params, RandomDrafter(cfg.vocab_size), None, tree)
    results = gen.generate_batch(prompts, 30)
    assert [r.token_ids for r in results] == singles
    assert results[0].steps < results[1].steps or singles[1][-1] == eos
    with pytest.raises(JaxspecError, match="empty prompt"):
        gen.generate_batch([[1, 2], []], 5)


@pytest.mark.parametrize("tree_name", [None, "cpu-16"])
def test_steps_never_recompile(tree_name):
    cfg, params = tiny()
    tree = tree_preset(tree_name) if tree_name else None
    gen = SpeculativeGenerator(cfg, params, RandomDrafter(cfg.vocab_size), None, tree)
    gen.generate([5, 6, 7], 30)
    count = n_programs(gen)
    assert count == 4  # prefill, step, and the two commits
    b = gen.generate([9, 8, 7, 6], 25)  # same buckets: nothing new compiles
    assert b.compile_s == 0 and n_programs(gen) == count


@pytest.mark.parametrize("tree_name", TREES)
def test_sampling_is_reproducible_and_varies_with_seed(tree_name):
    cfg, params = tiny()
    gen = SpeculativeGenerator(
        cfg, params, RandomDrafter(cfg.vocab_size), None, tree_preset(tree_name), Sampling(1.0)
    )
    a = gen.generate([5, 6, 7], 30, seed=3).token_ids
    assert a == gen.generate([5, 6, 7], 30, seed=3).token_ids
    assert a != gen.generate([5, 6, 7], 30, seed=4).token_ids


def pooled_chisquare_pvalue(observed, expected) -> float:
    """Chi-square p-value of counts against expected counts (any shape), the cells expected
    below 5 pooled into one; expected rescaled to the observed total (float32
    probabilities sum to 1 within ~1e-7)."""
    from scipy.stats import chisquare

    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def exact_joint_distribution(cfg, params, context, sampling, n: int = 2):
    """p(x1, ..., xn | context) [V]*n from the model's warped distributions."""
    V = cfg.vocab_size
    prefixes = itertools.product(range(V), repeat=n - 1)  # every x1..x(n-1)
    seqs = jnp.asarray([context + list(x) for x in prefixes], jnp.int32)  # [V^(n-1),C+n-1]
    N, T = seqs.shape
    logits, _, _ = forward(
        params, cfg, seqs, jnp.broadcast_to(jnp.arange(T), seqs.shape),
        init_cache(cfg, N, T), causal_mask(N, T),
    )  # fmt: skip
    p = np.exp(np.asarray(warped_logprobs(logits, sampling), np.float64))
    p = p.reshape(*(V,) * (n - 1), T, V)
    joint = p[(0,) * (n - 1)][T - n]  # p(x1)
    for k in range(1, n):  # times p(x(k+1) | x1..xk)
        joint = joint[..., None] * p[(slice(None),) * k + (0,) * (n - 1 - k)][..., T - n + k, :]
    return joint


def sampling_test_drafter(name: str, cfg: LlamaConfig, params):
    """-> (drafter, its params): random guesses, FIRP with random maps (its pseudo chains
    join the verify forward, which must leave the verified logits alone), or a random
    Chimera (drafts from its own state carried between steps), or a random SDSAT adapter
    (drafts from its own forward over the committed cache; with one_forward, from adaptive
    chains in the verify forward)."""
    if name == "random":
        return RandomDrafter(cfg.vocab_size), None
    if name.startswith("sdsat"):  # sdsat-one-forward: chains in the verify step, like FIRP
        from tests.test_sdsat import random_sdsat

        return random_sdsat(cfg, params, one_forward=name == "sdsat-one-forward")
    if name == "chimera":
        from tests.test_chimera import random_chimera

        return random_chimera(cfg, params, 4)
    if name == "eagle":  # a random layer on fused states (drafts from its own cache)
        from jaxspec.drafters.eagle import EagleDrafter
        from tests.test_eagle import trained_like

        drafter = EagleDrafter(cfg, (1, 1, 2), 3)
        return drafter, trained_like(drafter, params, seed=4)
    if name == "medusa":  # heads perturbed from zero: guesses near the model's own
        from jaxspec.drafters.medusa import MedusaDrafter

        drafter = MedusaDrafter(cfg, 3)
        heads = drafter.init(params)
        noise = jax.random.normal(jax.random.key(6), (3, cfg.dim, cfg.dim)) / np.sqrt(cfg.dim)
        return drafter, {"heads": [{**h, "w": noise[i]} for i, h in enumerate(heads["heads"])]}
    from jaxspec.drafters.firp import FirpDrafter

    drafter = FirpDrafter(cfg, (1, 2))
    D = cfg.dim
    w = jax.random.normal(jax.random.key(5), (2, D, D)) / np.sqrt(D)
    return drafter, {"maps": [{"w": w[i], "b": jnp.zeros(D)} for i in range(2)]}


@pytest.mark.parametrize(
    "tree_name, sampling, drafter_name",
    [
        ("chain-4", Sampling(1.0), "random"),
        ("cpu-8", Sampling(0.7), "random"),
        ("cpu-16", Sampling(1.0, top_p=0.8), "random"),
        ("cpu-24", Sampling(1.3, top_k=5), "random"),
        ("chain-2", Sampling(1.0, top_p=0.9), "firp"),
        ("cpu-8", Sampling(0.8), "chimera"),
        ("comb-3-3", Sampling(1.0, top_p=0.95), "sdsat"),
        ("comb-2-2", Sampling(0.9), "sdsat-one-forward"),
        ("dynamic-6-3-3", Sampling(1.0), "medusa"),
        ("dynamic-8-2-4", Sampling(0.8, top_p=0.9), "firp"),
        ("dynamic-8-2-3", Sampling(0.9), "chimera"),
        ("cpu-8", Sampling(0.9), "eagle"),
        ("dynamic-8-3-3", Sampling(1.0, top_p=0.9), "eagle"),
    ],
)
def test_tree_rejection_sampling_preserves_the_distribution(tree_name, sampling, drafter_name):
    cfg, params = tiny("tiny-mqa", vocab=6)
    drafter, dparams = sampling_test_drafter(drafter_name, cfg, params)
    check_two_token_distribution(cfg, params, tree_preset(tree_name), sampling, drafter, dparams)


def check_two_token_distribution(cfg, params, tree, sampling, drafter, dparams, place=None):
    """Chi-square of the first two emitted tokens over many rows against the exact
    two-token distribution, for drafts that are often right (tiny vocabulary). place(kind,
    value): puts the cache, the drafter state and the row arrays ("cache", "state", "rows")
    where the programs should run (on a mesh); None: one device."""

    place = place or (lambda kind, value: value)
    prompt, root, N = [1, 4, 2, 5], 3, 12000
    static = dict(cfg=cfg, sampling=sampling, tree=tree, drafter=drafter)
    cache = place("cache", init_cache(cfg, N, 32))
    tokens = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (N, len(prompt)))
    tokens, lengths = place("rows", (tokens, jnp.full((N,), len(prompt), jnp.int32)))
    state = place("state", drafter.init_state(cfg, N, 32, jnp.float32))
    _, drafted, block, state = prefill_and_draft(
        params, dparams, tokens, lengths, jax.random.key(0), state, **static
    )
    cache = commit(cache, block, lengths)
    current = place("rows", jnp.full((N,), root, jnp.int32))
    # first-step drafts from a proposal sharper than the model's first token (fixed before
    # the step's randomness): with uniform ones even acceptance that forgets rejected
    # tokens would give p exactly
    expected = exact_joint_distribution(cfg, params, prompt + [root], sampling)  # [V,V]
    sharp = 2 * jnp.log(jnp.asarray(expected.sum(1), jnp.float32) + 1e-6)
    candidates = jax.random.categorical(jax.random.key(1), sharp, shape=(N, tree.n_nodes - 1))
    if isinstance(tree, DynamicTree):  # its topology too is the drafter's: take its draft
        candidates = drafted
    candidates = place("rows", candidates)
    if drafter.drafts_from_cache:
        candidates = redraft(params, dparams, cache, current, tree=tree, drafter=drafter)
    emitted, n, current, candidates, block, state = speculative_step(
        params, dparams, cache, current, candidates, jax.random.key(2), state, **static
    )
    cache = commit(cache, block, n)
    if drafter.drafts_from_cache:
        candidates = redraft(params, dparams, cache, current, tree=tree, drafter=drafter)
    emitted2, *_ = speculative_step(
        params, dparams, cache, current, candidates, jax.random.key(3), state, **static
    )
    emitted, n, emitted2 = np.asarray(emitted), np.asarray(n), np.asarray(emitted2)
    x1 = emitted[:, 0]
    x2 = np.where(n >= 2, emitted[:, 1], emitted2[:, 0])
    assert (n >= 2).mean() > 0.1  # drafts were accepted often enough to matter

    expected = expected * N
    observed = np.zeros_like(expected)
    np.add.at(observed, (x1, x2), 1)
    assert observed[expected == 0].sum() == 0  # nothing outside top-k / top-p support
    assert pooled_chisquare_pvalue(observed, expected) > 1e-3


@pytest.mark.parametrize("tree_name", [None, "chain-1"])
def test_generated_tokens_follow_the_models_joint_distribution_across_steps(tree_name):
    """Many rows of one prompt through generate_batch (one seed: every step gets the same
    key, so its randomness must come from the positions): the first three tokens (the
    prefill's, then two steps') jointly follow the model's distribution."""

    cfg, params = tiny("tiny-mqa", vocab=6)
    sampling, prompt, N = Sampling(1.0), [1, 4, 2, 5], 3000
    tree = tree_preset(tree_name) if tree_name else None
    drafter = RandomDrafter(cfg.vocab_size) if tree else None
    gen = SpeculativeGenerator(cfg, params, drafter, None, tree, sampling)
    out = np.array([r.token_ids for r in gen.generate_batch([prompt] * N, 3, seed=5)])
    expected = exact_joint_distribution(cfg, params, prompt, sampling, 3) * N  # 216 cells
    observed = np.zeros_like(expected)
    np.add.at(observed, (out[:, 0], out[:, 1], out[:, 2]), 1)
    assert pooled_chisquare_pvalue(observed, expected) > 1e-3


def test_a_drafted_token_outside_the_support_is_never_accepted(monkeypatch):
    """Every uniform draw 0 (the smallest jax.random.uniform gives): a drafted token of
    probability 0 under the warped distribution (outside top-k) is still rejected, and the
    bonus token is drawn from the support; a token of positive probability is accepted."""
    real_uniform = jax.random.uniform
    monkeypatch.setattr(jax.random, "uniform", lambda key, shape, *a, **k: jnp.zeros(shape))
    tree = TreeSpec([(0,), (1,)])  # two children of the root
    topo = static_topology(tree, 2)
    logits = jnp.array([0.0, 3.0, 2.0, 1.0, -1.0, -2.0])[None, None].repeat(3, 1).repeat(2, 0)
    s = Sampling(1.0, top_k=2)  # support {1, 2}
    # row 0: both drafts outside the support (rejected); row 1: the first outside, the
    # second in it (accepted)
    tokens = jnp.array([[0, 4, 5], [0, 5, 2]])
    keys = jax.random.split(jax.random.key(0), 2)
    nodes, n, bonus = accept_sampling(topo, tokens, logits, keys, s)
    monkeypatch.setattr(jax.random, "uniform", real_uniform)
    np.testing.assert_array_equal(n, [0, 1])
    np.testing.assert_array_equal(nodes[:, 1], [0, 2])
    assert int(bonus[0]) in (1, 2)


def test_accept_greedy_literal():
    """paths (0,) (1,) (0,0): nodes 1, 2 under the root, 3 under 1. The model's argmax is
    2 at the root, 4 at node 1, 0 at node 2 and 1 at node 3."""
    tree = TreeSpec([(0,), (1,), (0, 0)])
    topo = static_topology(tree, 3)
    argmax = jnp.array([2, 4, 0, 1])
    logits = jax.nn.one_hot(argmax, 6)[None].repeat(3, 0)  # [B,T,V]
    # row 0: nodes 1 then 3 right: 2 accepted, bonus 1 (node 3's); row 1: 1 right, 3 wrong:
    # 1 accepted, bonus 4 (node 1's); row 2: node 2 right, a leaf: 1 accepted, bonus 0 (node
    # 2's), though the root's token 0 is node 2's argmax (what a -1 pad's slot would read)
    tokens = jnp.array([[9, 2, 7, 4], [9, 2, 7, 5], [0, 3, 2, 4]])
    nodes, n, bonus = accept_greedy(topo, tokens, logits)
    np.testing.assert_array_equal(n, [2, 1, 1])
    np.testing.assert_array_equal(bonus, [1, 4, 0])
    np.testing.assert_array_equal(nodes, [[0, 1, 3], [0, 1, 0], [0, 2, 0]])  # 0 past the end


@dataclasses.dataclass(frozen=True)
class ProbeDrafter(Drafter):
    """Records what a step hands the drafter: its state counts the entered tokens and keeps
    the position it was given; it proposes the model's own argmax at the hidden state it
    was given (the node whose prediction is `current`, so in greedy: `current` itself)."""

    cfg: LlamaConfig

    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None):
        return jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32)

    def advance(self, params, drafter_params, inputs):
        entered, _ = inputs.state
        return entered + inputs.entered.count, inputs.position

    def propose(self, params, drafter_params, tree, inputs, key):
        h = inputs.hidden[self.cfg.n_layers][:, None]
        guess = jnp.argmax(lm_logits(params, self.cfg, h)[:, 0], -1).astype(jnp.int32)
        return jnp.broadcast_to(guess[:, None], (guess.shape[0], tree.n_nodes - 1))


def test_a_step_hands_the_drafter_the_last_accepted_nodes_state():
    """After a greedy step the drafter sees the state of the last accepted node (the one
    that predicted the bonus token), the bonus token's position, and every committed token
    counted once, for a row accepting all of a chain, one accepting part and one none."""
    cfg, params = tiny()
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 8).token_ids
    tree, drafter = tree_preset("chain-4"), ProbeDrafter(cfg)
    static = dict(cfg=cfg, sampling=Sampling(), tree=tree, drafter=drafter)
    B, P = 3, len(prompt)
    tokens = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (B, P))
    lengths = jnp.full((B,), P, jnp.int32)
    state = drafter.init_state(cfg, B, 32, jnp.float32)
    current, candidates, block, state = prefill_and_draft(
        params, None, tokens, lengths, jax.random.key(0), state, **static
    )
    cache = commit(init_cache(cfg, B, 32), block, lengths)
    np.testing.assert_array_equal(current, [ar[0]] * B)
    np.testing.assert_array_equal(candidates[:, 0], current)  # the prompt's last state
    np.testing.assert_array_equal(state[0], cache.lengths)
    np.testing.assert_array_equal(state[1], cache.lengths)
    right = jnp.asarray(ar[1:5], jnp.int32)
    wrong = (right + 1) % cfg.vocab_size
    candidates = jnp.stack([right, right.at[2].set(wrong[2]), wrong])  # 4, 2, 0 accepted
    emitted, n, current, candidates, block, state = speculative_step(
        params, None, cache, current, candidates, jax.random.key(1), state, **static
    )
    np.testing.assert_array_equal(n, [5, 3, 1])
    cache = commit(cache, block, n)
    np.testing.assert_array_equal(current, [ar[5], ar[3], ar[1]])
    np.testing.assert_array_equal(candidates[:, 0], current)  # the last accepted node's state
    np.testing.assert_array_equal(state[0], cache.lengths)  # each committed token once
    np.testing.assert_array_equal(state[1], cache.lengths)  # current's position


def test_typical_acceptance_accepts_likely_drafts_and_needs_sampling():
    cfg, params = tiny()
    prompt = [5, 6, 7, 8, 9]
    greedy_ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    reference = jnp.asarray(prompt + greedy_ar + [0] * 16, jnp.int32)
    typical = Sampling(temperature=0.01, typical=True)  # near-greedy: oracle drafts pass
    gen = SpeculativeGenerator(
        cfg, params, OracleDrafter(cfg.vocab_size), reference, tree_preset("chain-4"), typical
    )
    result = gen.generate(prompt, 30)
    assert result.token_ids == greedy_ar and result.mean_accepted > 3
    # AR drafts nothing: with typical acceptance asked it samples exactly as plain sampling
    sampled = [SpeculativeGenerator(cfg, params, sampling=Sampling(1.0, typical=t))
               .generate(prompt, 30, seed=3).token_ids for t in (True, False)]  # fmt: skip
    assert sampled[0] == sampled[1] != greedy_ar
    with pytest.raises(JaxspecError, match=r"typical \(--typical\) needs sampling"):
        Sampling(typical=True)


def test_searched_trees_from_measured_accuracy():
    from jaxspec.tree import searched_trees

    cumulative = np.array([[0.5, 0.6, 0.65], [0.3, 0.35, 0.38]])
    trees = searched_trees(cumulative, sizes=(3, 4))
    assert trees["searched-3"] == [[0], [0, 0]]  # 0.5, then 0.5*0.3=0.15 beats 0.1
    assert trees["searched-4"] == [[0], [1], [0, 0]]


def test_a_tree_wider_than_the_vocabulary_is_refused_when_built():
    cfg, params = tiny()  # V = 97
    with pytest.raises(JaxspecError, match="comb-2-500 .* top 500 guesses .* vocabulary of 97"):
        SpeculativeGenerator(cfg, params, RandomDrafter(97), None, tree_preset("comb-2-500"))
    SpeculativeGenerator(cfg, params, RandomDrafter(97), None, tree_preset("comb-2-97"))


@pytest.mark.parametrize(
    "name, tree_name, S, B",
    [("tiny-gqa", "cpu-16", 256, 1), ("tiny-gqa", "comb-4-20", 256, 2),
     ("tiny-mqa", "comb-3-90", 128, 1), ("tiny-mqa", "comb-8-60", 384, 2)],
)  # fmt: skip
def test_step_bytes_is_close_to_what_xla_plans(name, tree_name, S, B):
    """The estimate against the compiled step's temporary buffers plus its cache."""
    cfg, tree = preset(name), tree_preset(tree_name)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    cache = jax.eval_shape(lambda: init_cache(cfg, B, S))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    key = jax.eval_shape(lambda: jax.random.key(0))
    step = speculative_step.lower(
        params, None, cache, ints(B), ints(B, tree.n_nodes - 1), key, None, cfg=cfg,
        sampling=Sampling(), tree=tree, drafter=RandomDrafter(cfg.vocab_size),
    ).compile()  # fmt: skip
    planned = step.memory_analysis().temp_size_in_bytes + sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)
    )
    assert 0.8 < step_bytes(cfg, tree.n_nodes, B, S) / planned < 1.25


def test_step_bytes_on_the_default_models_shape():
    cfg = preset("smollm2-135m")  # SmolLM2-135M's config; no weights
    assert step_bytes(cfg, tree_preset("comb-4-4000").n_nodes, 1, 192) > 10e9
    assert step_bytes(cfg, tree_preset("gpu-63").n_nodes, 1, cfg.max_position) < 1e9
    assert step_bytes(cfg, 64, 3, 256) == 3 * step_bytes(cfg, 64, 1, 256)
    # While the logits are the largest buffer, a node costs its logits row and its keys and
    # values in every layer.
    per_node = 4 * cfg.vocab_size + 4 * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    grows = [step_bytes(cfg, T + 1, 1, 256) - step_bytes(cfg, T, 1, 256) for T in (8, 64, 512)]
    assert grows == [per_node] * 3


def test_a_step_too_large_for_memory_is_refused_before_compiling(monkeypatch):
    import jaxspec.decode as decode

    cfg, params = tiny()
    gen = SpeculativeGenerator(cfg, params, RandomDrafter(97), None, tree_preset("cpu-16"))
    need = step_bytes(cfg, 16, 2, gen.cache_len(3, 20))
    monkeypatch.setattr(decode, "available_bytes", lambda: (need - 1, "host"))
    message = "tree cpu-16 \\(16 nodes\\) with batch 2 and a 128-slot cache needs about"
    with pytest.raises(JaxspecError, match=message):
        gen.generate_batch([[5, 6, 7], [8, 9]], 20)
    assert gen._executables == {}
    monkeypatch.setattr(decode, "available_bytes", lambda: (need, "host"))
    gen.generate_batch([[5, 6, 7], [8, 9]], 20)
