"""Chimera: masks and trigrams, the cached encoder against a full recompute, drafting
against training, losslessness."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decode import DraftInputs, Entered, SpeculativeGenerator
from jaxspec.drafters.chimera import (
    ChimeraDrafter,
    lag_mask,
    training_logits,
    trigram_tokens,
)
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import embed, run_layers
from jaxspec.tree import TreeSpec, tree_preset
from tests.conftest import tiny_training_args, train_on_made_up_conversations
from tests.test_speculative import tiny


def random_chimera(cfg, base_params, n_heads=3, seed=0, **options):
    """A drafter whose every weight is its initial value plus noise."""
    drafter = ChimeraDrafter(cfg, n_heads, **options)
    leaves, treedef = jax.tree.flatten(drafter.init(base_params))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return drafter, jax.tree.unflatten(treedef, noisy)


def test_lag_mask_literal():
    np.testing.assert_array_equal(
        lag_mask(3, 1),
        [[0, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]],
    )
    np.testing.assert_array_equal(
        lag_mask(3, 2),
        [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1]],
    )


def test_trigram_tokens_repeat_the_first_token_before_the_start():
    tokens = jnp.asarray([[7, 8, 9, 10]])
    got = trigram_tokens(tokens, jnp.asarray([[0, 1, 2, 3]]))
    np.testing.assert_array_equal(got[0], [[7, 7, 7], [7, 7, 8], [7, 8, 9], [8, 9, 10]])
    got = trigram_tokens(tokens, jnp.asarray([[1, 3]]), n=2)
    np.testing.assert_array_equal(got[0], [[7, 8], [9, 10]])


def model_states(cfg, params, tokens):
    """tokens [B,n] -> the model's last-layer states [B,n,D]."""
    B, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (B, n))
    h, _, _ = run_layers(params, cfg, embed(params, tokens), positions, None, causal_mask(B, n))
    return h


def advance(drafter, params, dparams, state, tokens, start, count, hidden, current):
    """One `advance` with `count` of tokens [1,M] entering at `start`; current follows."""
    entered = Entered(
        jnp.asarray(tokens, jnp.int32), jnp.asarray([start]), jnp.asarray([count]),
        {drafter.cfg.n_layers: hidden},
    )  # fmt: skip
    inputs = DraftInputs(
        {}, jnp.asarray([current]), jnp.asarray([start + count]), None, entered, state
    )
    return drafter.advance(params, dparams, inputs)


def test_the_cached_encoder_equals_a_full_recompute():
    """Chunks entering step by step (padded, as verify steps pass them) leave the same
    encoder cache as the whole sequence at once."""
    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params)
    seq = jax.random.randint(jax.random.key(3), (1, 12), 0, cfg.vocab_size)
    h = model_states(cfg, params, seq)
    fresh = lambda: drafter.init_state(cfg, 1, 16, jnp.float32)  # noqa: E731
    whole = advance(drafter, params, dparams, fresh(), seq[:, :11], 0, 11, h[:, :11], seq[0, 11])

    garbage_tokens, garbage_h = jnp.full((1, 8), 3), jnp.ones((1, 8, cfg.dim))
    pad = lambda x, g, m: jnp.concatenate([x, g[:, : m - x.shape[1]]], axis=1)  # noqa: E731
    state = advance(
        drafter, params, dparams, fresh(), pad(seq[:, :4], garbage_tokens, 6), 0, 4,
        pad(h[:, :4], garbage_h, 6), seq[0, 4],
    )  # fmt: skip
    start = 4
    for count in (1, 3, 2, 1):  # root + accepted drafts, padded to depth + 1 = 4
        end = start + count
        state = advance(
            drafter, params, dparams, state, pad(seq[:, start:end], garbage_tokens, 4), start,
            count, pad(h[:, start:end], garbage_h, 4), seq[0, end],
        )  # fmt: skip
        start = end
    assert start == 11
    np.testing.assert_array_equal(state.tokens[:, :12], whole.tokens[:, :12])
    for name in ("real_keys", "real_values"):
        a, b = getattr(state, name)[:, :, :11], getattr(whole, name)[:, :, :11]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for name in ("trigram_keys", "trigram_values"):
        a, b = getattr(state, name)[:, :, :12], getattr(whole, name)[:, :, :12]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ngram, residual", [(3, True), (2, False), (5, True)])
def test_drafting_computes_what_training_trains(ngram, residual):
    """Every tree node with children: its head's logits equal training_logits on the
    sequence extended by the node's own path (lag depth + 1), and its children are their
    top tokens by rank, off the top-1 chain too, for every encoder variant."""
    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, 3, ngram=ngram, residual=residual)
    p = 7
    seq = jax.random.randint(jax.random.key(4), (1, p + 1), 0, cfg.vocab_size)
    h = model_states(cfg, params, seq[:, :p])
    state = advance(
        drafter, params, dparams, drafter.init_state(cfg, 1, 16, jnp.float32), seq[:, :p], 0, p,
        h, seq[0, p],
    )  # fmt: skip
    tree = TreeSpec([(0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (2, 0), (1, 1, 0)])
    L = cfg.n_layers
    inputs = DraftInputs({L: h[:, p - 1]}, seq[:, p], jnp.asarray([p]), state=state)
    candidates, logits = drafter.draft_tree(params, dparams, inputs, tree)
    tokens = np.concatenate([np.asarray(seq[0, p:]), np.asarray(candidates[0])])  # per node
    internal = [i for i in range(tree.n_nodes) if i in tree.parent]
    assert logits.shape[1] == len(internal) == 5
    for slot, node in enumerate(internal):
        path = [node]
        while path[-1] != 0:
            path.append(int(tree.parent[path[-1]]))
        depth = len(path) - 1
        extended = jnp.concatenate([seq, jnp.asarray(tokens[path[-2::-1]])[None]], axis=1)
        hidden = jnp.concatenate([h, jnp.full((1, depth + 1, cfg.dim), 7.0)], axis=1)  # unseen
        trained = training_logits(
            drafter, params, dparams, extended, hidden, jnp.asarray([[p + depth]])
        )  # [1,1,K,V]
        np.testing.assert_allclose(trained[0, 0, depth], logits[0, slot], rtol=1e-4, atol=1e-4)
        ranked = np.argsort(-np.asarray(logits[0, slot]))
        for child in np.flatnonzero(tree.parent == node):
            assert tokens[child] == ranked[tree.rank[child]]


@pytest.mark.parametrize(
    "tree_name, name",
    [  # both kv layouts and both tree kinds in the fast set, the rest slow
        ("cpu-16", "tiny-gqa"),
        ("chain-2", "tiny-mqa"),
        *(
            pytest.param(tree, name, marks=pytest.mark.slow)
            for tree, name in [("chain-2", "tiny-gqa"), ("cpu-8", "tiny-gqa"),
                               ("cpu-8", "tiny-mqa"), ("cpu-16", "tiny-mqa")]
        ),
    ],
)  # fmt: skip
def test_greedy_chimera_is_lossless(tree_name, name):
    cfg, params = tiny(name)
    drafter, dparams = random_chimera(cfg, params, n_heads=4)
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 40).token_ids
    gen = SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset(tree_name))
    assert gen.generate(prompt, 40).token_ids == ar
    batch = gen.generate_batch([prompt, [3, 4]], 20)
    assert batch[0].token_ids == ar[:20]
    assert batch[1].token_ids == SpeculativeGenerator(cfg, params).generate([3, 4], 20).token_ids


def test_too_deep_a_tree_is_a_clear_error():
    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, n_heads=2)
    with pytest.raises(JaxspecError, match="exceeds the drafter's 2 Chimera heads"):
        SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset("chain-4"))
    with pytest.raises(JaxspecError, match="1 <= ngram <= 8"):
        ChimeraDrafter(cfg, 2, ngram=0)


@pytest.fixture(scope="module")
def trained_chimera(tiny_ckpt, tmp_path_factory):
    """Train 6 steps, 'interrupt', resume to 10: (drafter dir, reports, checkpoint)."""
    import train.chimera as chimera

    tmp = tmp_path_factory.mktemp("chimera")
    common = [*tiny_training_args(tiny_ckpt[0], tmp, save_every=3),
              "--rows", "8", "--heads", "3", "--distill", "0.1", "--overwrite"]  # fmt: skip
    first, second = train_on_made_up_conversations(
        chimera, [*common, "--steps", "6"], [*common, "--steps", "10"]
    )
    return tmp / "out", first, second, tiny_ckpt[0]


def test_chimera_training_resumes_and_ships_a_lossless_drafter(trained_chimera):
    import json

    from jaxspec.drafters.store import load_drafter
    from jaxspec.methods import make_drafter
    from jaxspec.models import load_model

    out, first, second, ckpt = trained_chimera
    assert first["steps"] == 6 and second["steps"] == 10
    assert first["final_loss_per_head"] != second["final_loss_per_head"]  # it trained on
    assert min(second["accepted_per_step"].values()) >= 1.0
    acc = np.array(second["test_topk_accuracy"])
    assert acc.shape == (3, 5) and np.all(np.diff(acc, axis=1) >= 0)
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["method"] == "chimera" and meta["settings"]["n_heads"] == 3
    model = load_model(ckpt)
    settings, dparams, data = load_drafter(out, "chimera", model.cfg)
    prefill = data["cache_prefill"]  # frequent answer trigrams
    assert prefill.shape[0] > 0 and prefill.shape[1] == 3
    drafter = make_drafter("chimera", model.cfg, settings)
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(model.cfg, model.params).generate(prompt, 24).token_ids
    for tree in ("chain-2", settings.trees["searched-8"]):
        spec = tree_preset(tree) if isinstance(tree, str) else TreeSpec(tree)
        gen = SpeculativeGenerator(model.cfg, model.params, drafter, dparams, spec)
        assert gen.generate(prompt, 24).token_ids == ar


@pytest.mark.slow  # ~35 s
def test_the_trigram_cache_changes_nothing_but_the_work():
    """With a trigram cache the drafts are the same (same steps, same tokens), also with a
    1-slot cache that keeps evicting; every committed trigram is looked up once (the
    pipelined loop runs one step past the last one read, which commits one more token)."""
    import dataclasses

    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, n_heads=3)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    tree = tree_preset("cpu-8")
    plain = SpeculativeGenerator(cfg, params, drafter, dparams, tree).generate(prompt, 30)
    for size in (64, 1):
        cached = dataclasses.replace(drafter, cache_size=size)
        gen = SpeculativeGenerator(cfg, params, cached, dparams, tree)
        out = gen.generate(prompt, 30)
        assert (out.token_ids, out.steps) == (plain.token_ids, plain.steps)
        _, lookups = np.asarray(gen.drafter_state.lookups)
        assert lookups == len(prompt) + len(out.token_ids) + 1


def test_a_chunked_prefill_looks_up_each_trigram_once():
    """A batch prefilled in 4-token chunks (the 2-token row idle until its last chunk)
    looks up as many trigrams as one-shot prefill does (hits may differ: a trigram repeated
    in a later chunk finds the earlier chunk's entry)."""
    import dataclasses

    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, n_heads=2)
    drafter = dataclasses.replace(drafter, cache_size=64)
    prompts, runs = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [6, 7]], []
    for chunk in (64, 4):
        gen = SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset("chain-2"),
                                   prefill_chunk=chunk)  # fmt: skip
        outs = gen.generate_batch(prompts, 8)
        runs.append(([o.token_ids for o in outs], int(gen.drafter_state.lookups[1])))
    assert runs[1] == runs[0]


def test_the_trigram_cache_hits_a_repeated_trigram_with_the_encoder_value():
    import dataclasses

    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, n_heads=2)
    drafter = dataclasses.replace(drafter, cache_size=64)
    seq = jnp.asarray([[5, 6, 7, 5, 6, 7]])
    h = model_states(cfg, params, seq)
    state = drafter.init_state(cfg, 1, 16, jnp.float32)
    state = advance(drafter, params, dparams, state, seq[:, :3], 0, 3, h[:, :3], 5)
    np.testing.assert_array_equal(state.lookups, [0, 4])  # (5,5,5) (5,5,6) (5,6,7) (6,7,5)
    state = advance(drafter, params, dparams, state, seq[:, 3:5], 3, 2, h[:, 3:5], 7)
    np.testing.assert_array_equal(state.lookups, [1, 6])  # (7,5,6) misses, (5,6,7) hits
    # The cached keys/values equal the uncached drafter's.
    plain = dataclasses.replace(drafter, cache_size=0)
    ref = plain.init_state(cfg, 1, 16, jnp.float32)
    ref = advance(plain, params, dparams, ref, seq[:, :5], 0, 5, h[:, :5], 7)
    np.testing.assert_allclose(state.trigram_keys[:, :, :6], ref.trigram_keys[:, :, :6], atol=1e-5)


def test_a_draft_vocabulary_limits_the_drafts_not_the_output():
    """Heads projecting onto a subset of the vocabulary draft only its tokens and stay
    lossless; with the whole vocabulary (in any order) they draft what the full heads do."""
    from jaxspec.decode import speculative_step
    from jaxspec.kv_cache import commit, init_cache
    from jaxspec.sampling import Sampling

    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, n_heads=3)
    tree = tree_preset("cpu-8")
    subset = list(range(0, cfg.vocab_size, 3))
    limited = drafter.prepare(params, dparams, {"draft_vocab": subset})
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    assert (
        SpeculativeGenerator(cfg, params, drafter, limited, tree).generate(prompt, 30).token_ids
        == ar
    )

    def next_drafts(dp):
        state = drafter.init_state(cfg, 1, 32, jnp.float32)
        h = model_states(cfg, params, jnp.asarray([prompt]))
        state = advance(drafter, params, dp, state, jnp.asarray([prompt]), 0, 5, h, 11)
        cache = init_cache(cfg, 1, 32)
        _, block, _ = run_layers(
            params, cfg, embed(params, jnp.asarray([prompt])), jnp.arange(5)[None], None,
            causal_mask(1, 5),
        )  # fmt: skip
        cache = commit(cache, block, jnp.asarray([5]))
        candidates = jnp.zeros((1, tree.n_nodes - 1), jnp.int32)
        out = speculative_step(
            params, dp, cache, jnp.asarray([11]), candidates, jax.random.key(0), state,
            cfg=cfg, sampling=Sampling(), tree=tree, drafter=drafter,
        )  # fmt: skip
        return np.asarray(out[3])

    assert np.isin(next_drafts(limited), subset).all()
    shuffled = np.random.default_rng(0).permutation(cfg.vocab_size).tolist()
    everything = drafter.prepare(params, dparams, {"draft_vocab": shuffled})
    np.testing.assert_array_equal(next_drafts(everything), next_drafts(dparams))


@pytest.mark.parametrize("residual", [True, False])
def test_full_heads_start_as_the_factorised_heads(residual):
    """Linear(2D->V) initialised [W_lm ; W_lm] computes what Linear(2D->D) = [I ; I]
    followed by the lm_head computes (the paper's head and our default)."""
    import dataclasses

    cfg, params = tiny()
    small = ChimeraDrafter(cfg, 2, residual=residual)
    full = dataclasses.replace(small, full_heads=True)
    h_real, h_enc = jax.random.normal(jax.random.key(1), (2, 3, cfg.dim))
    for head in (1, 2):
        np.testing.assert_allclose(
            full.head_logits(params, full.init(params), h_real, h_enc, head),
            small.head_logits(params, small.init(params), h_real, h_enc, head),
            rtol=1e-4, atol=1e-4,
        )  # fmt: skip


@pytest.mark.slow  # ~35 s
def test_the_frozen_transformer_bottom_is_the_models_first_layer():
    """Table 7's "Transformer (Frozen)": the bottom states are the model's own states after
    its first layer; the trainable variant starts there and has weights of its own."""
    from jaxspec.drafters.chimera import bottom_states

    cfg, params = tiny()
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    _, _, collected = run_layers(
        params, cfg, embed(params, tokens), positions, None, causal_mask(2, 9), stop=1,
        collect=(1,),
    )  # fmt: skip
    for bottom in ("transformer-frozen", "transformer"):
        drafter = ChimeraDrafter(cfg, 2, bottom=bottom)
        dparams = drafter.init(params)
        assert ("bottom" in dparams) == (bottom == "transformer") and "trigram" not in dparams
        states = bottom_states(drafter, params, dparams, tokens, positions)
        np.testing.assert_allclose(states, collected[1], rtol=1e-5, atol=1e-5)
    hidden = model_states(cfg, params, tokens)
    rows = jnp.asarray([[3, 5], [4, 8]])
    loss = lambda d: training_logits(drafter, params, d, tokens, hidden, rows).std()  # noqa: E731
    grads = jax.grad(loss)(dparams)["bottom"]  # the trainable bottom layer learns
    assert float(jnp.abs(grads["q_proj"]).max()) > 0


def test_a_transformer_bottom_cannot_draft_and_says_so():
    cfg, params = tiny()
    drafter = ChimeraDrafter(cfg, 2, bottom="transformer")
    with pytest.raises(JaxspecError, match="training-only ablation"):
        SpeculativeGenerator(cfg, params, drafter, drafter.init(params), tree_preset("chain-2"))
    with pytest.raises(JaxspecError, match="unknown Chimera bottom encoder 'lstm'"):
        ChimeraDrafter(cfg, 2, bottom="lstm")


def test_frequent_ngrams_of_the_answers_most_frequent_first():
    from train.chimera import frequent_ngrams

    tokens = np.array([[9, 1, 2, 3, 1, 2, 3, 1, 2, 0, 0]])
    features = {"tokens": tokens, "starts": np.array([1]), "lengths": np.array([9])}
    # bigrams ending in the answer: (9,1) (1,2) (2,3) (3,1) (1,2) (2,3) (3,1) (1,2)
    assert frequent_ngrams(features, 2, 3) == [[1, 2], [2, 3], [3, 1]]
    assert frequent_ngrams(features, 3, 1) == [[1, 2, 3]]


def test_a_prefilled_trigram_cache_hits_from_the_first_token_and_stays_lossless():
    import dataclasses

    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, n_heads=2)
    drafter = dataclasses.replace(drafter, cache_size=64)
    prepared = drafter.prepare(params, dparams, {"cache_prefill": [[5, 6, 7], [6, 7, 5]]})
    seq = jnp.asarray([[5, 6, 7]])
    h = model_states(cfg, params, seq)
    state = drafter.init_state(cfg, 1, 16, jnp.float32, prepared)
    state = advance(drafter, params, prepared, state, seq, 0, 3, h, 5)
    np.testing.assert_array_equal(state.lookups, [2, 4])  # (5,6,7) and (6,7,5) pre-filled
    plain = dataclasses.replace(drafter, cache_size=0)
    ref = plain.init_state(cfg, 1, 16, jnp.float32)
    ref = advance(plain, params, dparams, ref, seq, 0, 3, h, 5)
    np.testing.assert_allclose(state.trigram_keys[:, :, :4], ref.trigram_keys[:, :, :4], atol=1e-5)

    prompt = [5, 6, 7, 5, 6, 7, 8]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    hits = []
    for dp in (prepared, prepared, dparams):  # pre-filled twice, then an empty table
        gen = SpeculativeGenerator(cfg, params, drafter, dp, tree_preset("chain-2"))
        assert gen.generate(prompt, 30).token_ids == ar
        hits.append(int(gen.drafter_state.lookups[0]))
    assert hits[0] == hits[1] > hits[2]  # every generation starts from the pre-filled table


def test_a_finished_run_keeps_its_last_step(trained_chimera):
    """10 steps with --save-every 3: the last state is saved too, so a rerun of the finished
    command evaluates without training again."""
    out, _, second, _ = trained_chimera
    (run,) = (out.parent / "work" / "checkpoints").iterdir()
    assert 10 in {int(p.name) for p in run.iterdir() if p.name.isdigit()}


def test_a_transformer_bottom_trains_but_its_drafter_is_refused(tiny_ckpt, tmp_path):
    import json

    import train.chimera as chimera
    from jaxspec.methods import build_generator
    from jaxspec.models import load_model

    args = [*tiny_training_args(tiny_ckpt[0], tmp_path), "--rows", "8", "--heads", "2",
            "--steps", "2", "--bottom", "transformer"]  # fmt: skip
    (report,) = train_on_made_up_conversations(chimera, args)
    assert np.array(report["test_topk_accuracy"]).shape == (2, 5)
    settings = json.loads((tmp_path / "out" / "drafter.json").read_text())["settings"]
    assert settings["bottom"] == "transformer" and "cache_prefill" not in settings
    assert "accepted_per_step" not in report
    with pytest.raises(JaxspecError, match="training-only ablation"):
        build_generator(load_model(tiny_ckpt[0]), "chimera", tmp_path / "out")


def test_a_card_names_the_draft_vocabulary_built_not_only_the_one_asked_for():
    from train.chimera import most_frequent

    assert most_frequent(16384, 16384, "--draft-vocab") == (
        "the training answers' 16384 most frequent tokens"
    )
    assert most_frequent(17, 999999999, "--guess-vocab") == (
        "all 17 tokens of the training answers (fewer than --guess-vocab 999999999)"
    )


def test_head_d_guesses_with_the_d_th_heads_weights():
    """head_logits(..., d) (1-based) is head d's Linear on [norm(h) ; norm(ĥ)], projected:
    by hand with params["heads"][d - 1]; each head its own."""
    from jaxspec.llama import final_norm, vocab_projection

    cfg, params = tiny()
    drafter, dparams = random_chimera(cfg, params, n_heads=3)
    h, enc = jax.random.normal(jax.random.key(6), (2, 2, cfg.dim))
    x = jnp.concatenate([final_norm(params, cfg, h), final_norm(params, cfg, enc)], -1)
    for d in (1, 2, 3):
        head = dparams["heads"][d - 1]
        want = vocab_projection(params, cfg, x @ head["w"] + head["b"])
        got = drafter.head_logits(params, dparams, h, enc, d)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
