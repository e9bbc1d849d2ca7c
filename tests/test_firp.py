"""FIRP: pseudo-state masks and positions, training/inference agreement, losslessness."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.chains import chain_mask, joint_mask, pseudo_positions
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.firp import (
    FirpDrafter,
    FirpSettings,
    pseudo_forward,
    real_context,
)
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import embed, init_params, run_layers
from jaxspec.sampling import Sampling
from jaxspec.tree import TreeSpec, last_accepted_probability, tree_preset
from tests.conftest import tiny_training_args, train_on_made_up_conversations
from tests.test_speculative import tiny


def random_maps(cfg, n_steps, seed=0):
    D = cfg.dim
    w = jax.random.normal(jax.random.key(seed), (n_steps, D, D)) / np.sqrt(D)
    b = 0.1 * jax.random.normal(jax.random.key(seed + 1), (n_steps, D))
    return {"maps": [{"w": w[i], "b": b[i]} for i in range(n_steps)]}


def test_chain_mask_literal():
    # Rows/cols: step1 of anchors 0,1 then step2 of anchors 0,1.
    np.testing.assert_array_equal(
        chain_mask(2, 2), [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]
    )
    # The "masked" ablation: step 2 does not see step 1.
    np.testing.assert_array_equal(chain_mask(2, 2, chained=False), np.eye(4))


def test_joint_mask_and_positions_literal():
    """Tree root + two rank siblings at depth 1 (nodes 0,1,2), chains of 2 on every node."""
    tree = TreeSpec([(0,), (1,)])
    new_mask = jnp.asarray(tree.mask)[None]
    anchors = jnp.arange(3)[None]
    mask = np.asarray(joint_mask(new_mask, anchors, 2))[0].astype(int)
    # cols: n0 n1 n2 | p1(n0) p1(n1) p1(n2) | p2(n0) p2(n1) p2(n2)
    expected = [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1, 0, 0, 1],
    ]
    np.testing.assert_array_equal(mask, expected)
    positions = jnp.asarray([[7, 8, 8]])
    np.testing.assert_array_equal(pseudo_positions(positions, anchors, 2), [[8, 9, 9, 9, 10, 10]])


@pytest.mark.parametrize("window", [0, 4])  # 4: Mistral's sliding window, narrower than 9
def test_pseudo_chains_leave_the_real_tokens_alone_and_match_training(window):
    cfg, params = tiny()
    cfg = dataclasses.replace(cfg, sliding_window=window)
    drafter = FirpDrafter(cfg, (1, 2))
    dparams = random_maps(cfg, 2)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    anchors = jnp.asarray([[0, 4, 8], [2, 3, 5]])
    h = embed(params, tokens)
    h_real, block, states, pseudo = drafter.run_model(
        params, dparams, cfg, h, positions, None, causal_mask(2, 9), anchors, (2,), 2
    )
    plain, plain_block, plain_states = run_layers(
        params, cfg, h, positions, None, causal_mask(2, 9), collect=(2,)
    )
    np.testing.assert_allclose(h_real, plain, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(states[2], plain_states[2], rtol=1e-4, atol=1e-4)
    for k, k_plain in zip(block.keys, plain_block.keys, strict=True):
        np.testing.assert_allclose(k, k_plain, rtol=1e-4, atol=1e-4)
    assert pseudo.shape == (2, 3, 2, cfg.dim)
    # as the trainer's cache of real passes gives them: no keys/values below layers[0]
    _, full, states = real_context(params, cfg, tokens, (1, 2))
    keys, values = (None, *full.keys[1:]), (None, *full.values[1:])
    cached, _ = pseudo_forward(params, cfg, dparams["maps"], (1, 2), keys, values, states, anchors)
    np.testing.assert_allclose(cached, pseudo, rtol=1e-4, atol=1e-4)


def test_teacher_forced_steps_see_the_real_states_before_their_position():
    """The paper's training (§3.3): step i's pseudo state for position a+i sees the real
    tokens <= a+i-1; as when drafting, it sees only those <= a."""
    cfg, params = tiny()
    maps, layers, anchors = random_maps(cfg, 2)["maps"], (1, 2), jnp.asarray([[3]])
    tokens = jax.random.randint(jax.random.key(3), (1, 9), 0, cfg.vocab_size)

    def steps(tokens, **how):  # -> [K,D]: the anchor's pseudo states
        _, block, states = real_context(params, cfg, tokens, layers)
        pseudo, _ = pseudo_forward(params, cfg, maps, layers, block.keys, block.values, states,
                                   anchors, chained=False, **how)  # fmt: skip
        return np.asarray(pseudo[0, 0])

    at_4, at_5 = tokens.at[0, 4].add(1), tokens.at[0, 5].add(1)  # a+1, a+2 changed
    forced, drafting = steps(tokens, teacher_forced=True), steps(tokens)
    np.testing.assert_allclose(forced[0], drafting[0], rtol=1e-5, atol=1e-5)  # both see <= a
    np.testing.assert_allclose(steps(at_4), drafting, rtol=1e-5, atol=1e-5)
    changed = steps(at_4, teacher_forced=True)
    np.testing.assert_allclose(changed[0], forced[0], rtol=1e-5, atol=1e-5)
    assert np.abs(changed[1] - forced[1]).max() > 1e-3  # step 2 sees a+1
    np.testing.assert_allclose(steps(at_5, teacher_forced=True), forced, rtol=1e-5, atol=1e-5)


def deeper(name: str, n_layers: int = 5):
    cfg, _ = tiny(name)
    cfg = dataclasses.replace(cfg, n_layers=n_layers)
    return cfg, init_params(cfg, jax.random.key(0), scale=0.3)


ACCURACY = [[0.5, 0.7, 0.8], [0.3, 0.45, 0.5], [0.2, 0.3, 0.35], [0.1, 0.15, 0.2]]


@pytest.mark.parametrize(
    ("tree_name", "n_chains", "name"),
    [  # both kv layouts, a chain and both trees, every pseudo-chain count in the fast set
        ("chain-2", 0, "tiny-mqa"),
        ("cpu-16", 0, "tiny-gqa"),
        ("cpu-8", 1, "tiny-mqa"),
        ("cpu-16", 4, "tiny-gqa"),
        *(
            pytest.param(tree, n, name, marks=pytest.mark.slow)
            for tree, n, name in [("chain-2", 0, "tiny-gqa"), ("cpu-8", 0, "tiny-gqa"),
                                  ("cpu-8", 0, "tiny-mqa"), ("cpu-16", 0, "tiny-mqa"),
                                  ("cpu-8", 1, "tiny-gqa"), ("cpu-16", 4, "tiny-mqa")]
        ),
    ],
)  # fmt: skip
def test_greedy_firp_is_lossless(tree_name, n_chains, name):
    cfg, params = deeper(name)
    tree = tree_preset(tree_name)
    layers = (1, 2, 3, 5)  # deeper than some trees: only the steps a tree uses run
    drafter = FirpDrafter(cfg, layers).with_chains(tree, ACCURACY, n_chains)
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 40).token_ids
    gen = SpeculativeGenerator(cfg, params, drafter, random_maps(cfg, len(layers)), tree)
    assert gen.generate(prompt, 40).token_ids == ar
    batch = gen.generate_batch([prompt, [3, 4]], 20)
    assert batch[0].token_ids == ar[:20]


def test_last_accepted_probability_literal():
    tree = TreeSpec([(0,), (1,), (0, 0)])  # nodes: root, (0,), (1,), (0, 0)
    # Per rank: depth 1 rank 0 / 1 right with 0.5 / 0.2; depth 2 rank 0 with 0.4.
    got = last_accepted_probability(tree, [[0.5, 0.7], [0.4, 0.6]])
    # Reached: 1, 0.5, 0.2, 0.5 * 0.4; last: minus what a child reaches.
    np.testing.assert_allclose(got, [1 - 0.5 - 0.2, 0.5 - 0.2, 0.2, 0.2])
    drafter = FirpDrafter(tiny()[0], (1, 2)).with_chains(tree, [[0.5, 0.7], [0.4, 0.6]], 2)
    assert drafter.chain_nodes == (0, 1)  # the root, then the likeliest: (0,) over (1,)
    slot, shift = drafter.chain_sources()
    np.testing.assert_array_equal(slot, [0, 1, 0, 1])  # (1,) borrows the root's chain
    np.testing.assert_array_equal(shift, [0, 0, 1, 1])


@pytest.mark.slow  # CI time (~45 s)
def test_unchained_nodes_draft_from_their_ancestor_shifted_chain():
    cfg, params = deeper("tiny-gqa")
    tree = tree_preset("cpu-16")
    full = FirpDrafter(cfg, (1, 2, 3, 5))
    sparse = full.with_chains(tree, ACCURACY, 5)
    assert len(sparse.chain_nodes) == 5 and sparse.chain_nodes[0] == 0
    dparams = random_maps(cfg, 4)
    T, K = tree.n_nodes, tree.max_depth
    tokens = jax.random.randint(jax.random.key(2), (1, T), 0, cfg.vocab_size)
    positions = jnp.asarray(tree.depth)[None]
    args = (cfg, embed(params, tokens), positions, None, jnp.asarray(tree.mask)[None],
            jnp.arange(T)[None], (), K)  # fmt: skip
    h_full, _, _, chains = full.run_model(params, dparams, *args)
    h_sparse, _, _, drafted = sparse.run_model(params, dparams, *args)
    np.testing.assert_allclose(h_sparse, h_full, rtol=1e-4, atol=1e-4)
    assert drafted.shape == chains.shape == (1, T, K, cfg.dim)
    slot, shift = sparse.chain_sources()
    for node in range(T):
        source = sparse.chain_nodes[slot[node]]
        steps = np.minimum(np.arange(K) + shift[node], K - 1)
        np.testing.assert_allclose(drafted[0, node], chains[0, source, steps], rtol=1e-4, atol=1e-4)
    with pytest.raises(JaxspecError, match="placed for another tree"):
        sparse.check_tree(tree_preset("cpu-8"))


def test_identity_maps_draft_the_anchor_own_prediction_plus_context():
    """Untrained (identity) maps: a first-step pseudo state at the last layer is the
    anchor's own final state, so its draft equals the model's current prediction."""
    cfg, params = tiny()
    drafter = FirpDrafter(cfg, (cfg.n_layers,))
    tokens = jax.random.randint(jax.random.key(1), (1, 6), 0, cfg.vocab_size)
    positions = jnp.arange(6)[None]
    h_real, _, _, pseudo = drafter.run_model(
        params, drafter.init(), cfg, embed(params, tokens), positions, None, causal_mask(1, 6),
        jnp.asarray([[5]]), (), 1,
    )  # fmt: skip
    np.testing.assert_allclose(pseudo[0, 0, 0], h_real[0, 5], atol=1e-6)


def test_bad_layers_and_trees_are_clear_errors():
    cfg, params = tiny()
    with pytest.raises(JaxspecError, match="increasing and distinct"):
        FirpDrafter(cfg, (2, 1))
    with pytest.raises(JaxspecError, match=r"lie in 1..3"):
        FirpDrafter(cfg, (1, 9))
    with pytest.raises(JaxspecError, match="exceeds the drafter's 1 FIRP steps"):
        SpeculativeGenerator(cfg, params, FirpDrafter(cfg, (1,)), None, tree_preset("chain-2"))


@pytest.fixture(scope="module")
def trained_firp(tiny_ckpt, tmp_path_factory):
    """Two FIRP steps, 6 updates each: run to 8 updates, 'interrupt', resume to the end."""
    import train.firp as firp

    tmp = tmp_path_factory.mktemp("firp")
    common = [*tiny_training_args(tiny_ckpt[0], tmp), "--anchors", "8", "--layers", "1,2",
              "--overwrite"]  # fmt: skip
    first, second = train_on_made_up_conversations(
        firp,
        [*common, "--steps", "4"],  # 2 x 4 updates, finished
        [*common, "--steps", "6"],  # resumes at 8 of 12 (stage 2)
    )
    return tmp / "out", first, second, tiny_ckpt[0]


def test_firp_training_resumes_and_ships_a_lossless_drafter(trained_firp):
    import json

    from jaxspec.drafters.store import load_drafter
    from jaxspec.methods import make_drafter
    from jaxspec.models import load_model

    out, first, second, ckpt = trained_firp
    assert set(first["final_loss_per_step"]) == {1, 2}
    assert set(second["final_loss_per_step"]) == {2}  # stage 1 was done: it resumed in stage 2
    acc = np.array(second["test_topk_accuracy"])
    assert acc.shape == (2, 5) and np.all(np.diff(acc, axis=1) >= 0)
    assert min(second["accepted_per_step"].values()) >= 1.0
    # --work-dir holds the answers beside the real passes, nothing goes above it
    assert list((out.parent / "work").glob("self-train-*.npz"))
    assert not list(out.parent.glob("*.npz"))
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["method"] == "firp" and meta["settings"]["layers"] == [1, 2]
    model = load_model(ckpt)
    settings, dparams, data = load_drafter(out, "firp", model.cfg)
    drafter = make_drafter("firp", model.cfg, settings)
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(model.cfg, model.params).generate(prompt, 24).token_ids
    spec = SpeculativeGenerator(model.cfg, model.params, drafter, dparams, tree_preset("chain-2"))
    assert spec.generate(prompt, 24).token_ids == ar
    # Its measured accuracies place chains on the likeliest nodes of its own trees.
    assert data["test_topk_accuracy"].tolist() == second["test_topk_accuracy"]
    tree = TreeSpec(settings.trees["searched-8"])
    sparse = drafter.for_tree(tree, settings, data, firp_chains=3)
    assert len(sparse.chain_nodes) == 3
    spec = SpeculativeGenerator(model.cfg, model.params, sparse, dparams, tree)
    assert spec.generate(prompt, 24).token_ids == ar


@pytest.mark.slow  # a non-default training path (~30 s): the fast set keeps its parts
def test_paper_training_ships_a_lossless_drafter(tmp_path):
    """--training paper on a 3-layer model: step 1 trains exactly as the chained training
    (its pseudo state sees the same real tokens), step 2 (layer 2, then layer 3's attention)
    otherwise; its maps draft as any FIRP drafter's."""
    import train.firp as firp
    from jaxspec.convert import convert
    from jaxspec.drafters.store import load_drafter
    from jaxspec.methods import make_drafter
    from jaxspec.models import load_model
    from tests.conftest import save_tiny

    convert(save_tiny(tmp_path, n_kv_heads=2, n_layers=3)[0], tmp_path / "ckpt")
    common = [*tiny_training_args(tmp_path / "ckpt", tmp_path), "--anchors", "8", "--layers",
              "1,2", "--steps", "3"]  # fmt: skip
    chained, paper = train_on_made_up_conversations(
        firp, common, [*common, "--training", "paper", "--out", str(tmp_path / "paper")]
    )
    assert paper["final_loss_per_step"][1] == pytest.approx(chained["final_loss_per_step"][1])
    assert abs(paper["final_loss_per_step"][2] - chained["final_loss_per_step"][2]) > 1e-3
    assert "the real states before its position" in (tmp_path / "paper" / "CARD.md").read_text()
    model = load_model(tmp_path / "ckpt")
    settings, dparams, _ = load_drafter(tmp_path / "paper", "firp", model.cfg)
    drafter = make_drafter("firp", model.cfg, settings)
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(model.cfg, model.params).generate(prompt, 24).token_ids
    spec = SpeculativeGenerator(model.cfg, model.params, drafter, dparams, tree_preset("chain-2"))
    assert spec.generate(prompt, 24).token_ids == ar


@dataclasses.dataclass(frozen=True)
class UnfusedFirp(FirpDrafter):
    def projected_rows(self, params, drafter_params, h, drafted, depth):
        return None  # the drafter projects its own rows, after the verify logits


@pytest.mark.parametrize("tree_name", ["chain-2", "cpu-8"])
def test_projecting_drafts_with_the_verify_rows_changes_nothing(tree_name):
    """The step projects FIRP's pseudo chains together with the verify rows (one read of
    the vocabulary matrix); its outputs and next drafts equal the separate projection's."""
    from jaxspec.decode import speculative_step
    from jaxspec.kv_cache import commit, init_cache

    cfg, params = deeper("tiny-gqa")
    maps = random_maps(cfg, 3)
    tree = tree_preset(tree_name)
    prompt = jnp.asarray([[5, 6, 7, 8, 9, 10]])
    cache = init_cache(cfg, 1, 32)
    _, block, _ = run_layers(
        params, cfg, embed(params, prompt), jnp.arange(6)[None], None, causal_mask(1, 6)
    )
    cache = commit(cache, block, jnp.asarray([6]))
    candidates = jax.random.randint(jax.random.key(2), (1, tree.n_nodes - 1), 0, cfg.vocab_size)
    outs = [
        speculative_step(
            params,
            maps,
            cache,
            jnp.asarray([11]),
            candidates,
            jax.random.key(0),
            None,
            cfg=cfg,
            sampling=Sampling(),
            tree=tree,
            drafter=cls(cfg, (1, 2, 3)),
        )  # fmt: skip
        for cls in (FirpDrafter, UnfusedFirp)
    ]
    for fused, separate in zip(outs[0][:4], outs[1][:4], strict=True):
        np.testing.assert_array_equal(fused, separate)


def test_chain_placement_options():
    drafter, tree = FirpDrafter(tiny()[0], (1, 2)), tree_preset("cpu-8")
    plain = FirpSettings(layers=(1, 2))
    assert drafter.for_tree(tree, plain, {}, firp_chains=None) is drafter  # every node
    with pytest.raises(JaxspecError, match="no measured accuracies"):
        drafter.for_tree(tree, plain, {}, firp_chains=3)
    with pytest.raises(JaxspecError, match="must be >= 0"):
        drafter.for_tree(tree, plain, {}, firp_chains=-1)
    settings, data = FirpSettings(layers=(1, 2), chains=3), {"test_topk_accuracy": ACCURACY}
    assert len(drafter.for_tree(tree, settings, data, firp_chains=None).chain_nodes) == 3
    assert drafter.for_tree(tree, settings, data, firp_chains=0) is drafter


def test_depth_d_guesses_come_from_the_d_th_pseudo_state():
    """Chain and dynamic drafts at the accepted node: depth d takes the guesses of the
    d-th pseudo state's projection (by hand: lm_logits of inputs.drafted[:, d - 1])."""
    from jaxspec.drafters.base import DraftInputs
    from jaxspec.drafters.firp import FirpDrafter
    from jaxspec.llama import lm_logits
    from jaxspec.topology import select_nodes
    from jaxspec.tree import DynamicTree

    cfg, params = tiny()
    drafter = FirpDrafter(cfg, (1, 2))
    drafted = 3.0 * jax.random.normal(jax.random.key(5), (2, 3, cfg.dim))
    inputs = DraftInputs({}, jnp.zeros(2, jnp.int32), jnp.array([4, 4]), drafted=drafted)
    logits = jnp.stack([lm_logits(params, cfg, drafted[:, d : d + 1])[:, 0] for d in range(3)], 1)
    chain = drafter.propose(params, {}, tree_preset("chain-3"), inputs, None)
    np.testing.assert_array_equal(chain, jnp.argmax(logits, -1))
    tree = DynamicTree(9, 3, 3)
    draft = drafter.propose(params, {}, tree, inputs, None)
    want = select_nodes(logits, tree)
    for got, expected in zip(jax.tree.leaves(draft), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, expected)
