"""SDSAT mode (b): the adapter leaves ordinary positions alone, drafting computes what
training trains, greedy two-step decoding equals AR, training resumes and ships."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.checkpoint import load_checkpoint
from jaxspec.decode import SpeculativeGenerator, redraft
from jaxspec.drafters.sdsat import SdsatDrafter, SdsatSettings
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask, commit, init_cache
from jaxspec.llama import embed, forward, lm_logits, run_layers
from jaxspec.tree import TreeSpec, tree_preset
from tests.conftest import tiny_training_args, train_on_made_up_conversations
from tests.test_speculative import tiny
from train.sdsat import span_layout, span_logits


def random_sdsat(cfg, base_params, rank=3, n_ids=1, seed=0, one_forward=False):
    """An adapter whose every weight (LoRA b included) is its initial value plus noise."""
    drafter = SdsatDrafter(cfg, rank, n_ids, one_forward)
    leaves, treedef = jax.tree.flatten(drafter.init(base_params, jax.random.key(seed)))
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return drafter, jax.tree.unflatten(treedef, noisy)


def test_span_layout_literal():
    positions, j, context, rows = span_layout(jnp.asarray([[1, 3]]), 2, 5)
    np.testing.assert_array_equal(positions, [[2, 3, 4, 5]])
    np.testing.assert_array_equal(j, [0, 1, 0, 1])
    np.testing.assert_array_equal(
        context[0], [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    )
    np.testing.assert_array_equal(rows, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mqa"])
def test_the_adapter_leaves_ordinary_positions_bit_identical(name):
    """Ordinary tokens followed by adaptive ones: the ordinary positions' logits equal the
    untouched model's bit for bit, while the adaptive positions' do change."""
    cfg, params = tiny(name)
    drafter, dparams = random_sdsat(cfg, params)
    B, n, k = 2, 7, 4
    tokens = jax.random.randint(jax.random.key(4), (B, n + k), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(n + k), (B, n + k))
    mask = causal_mask(B, n + k)
    base, _, _ = forward(params, cfg, tokens, positions, None, mask)
    h = embed(params, tokens).at[:, n:].set(drafter.adaptive_embeddings(dparams, k))
    adaptive = jnp.broadcast_to(jnp.arange(n + k) >= n, (B, n + k))
    adapted = drafter.adapted_logits(params, dparams, h, positions, None, mask, adaptive)
    np.testing.assert_array_equal(np.asarray(adapted[:, :n]), np.asarray(base[:, :n]))
    assert not np.allclose(adapted[:, n:], base[:, n:], atol=1e-3)


def test_drafting_computes_what_training_trains():
    """Drafting after `current` = token i against the cache gives, row for row, the logits
    the trainer computes for a span starting at i (its first row: the base model's own)."""
    cfg, params = tiny()
    drafter, dparams = random_sdsat(cfg, params, n_ids=2)
    L, S = 4, 12
    tokens = jax.random.randint(jax.random.key(2), (1, S), 0, cfg.vocab_size)
    for i in (3, 6):
        trained, _, _ = span_logits(drafter, params, dparams, tokens, jnp.asarray([[i]]), L)
        cache = init_cache(cfg, 1, 32)
        mask = causal_mask(1, i)
        _, block, _ = run_layers(params, cfg, embed(params, tokens[:, :i]),
                                 jnp.arange(i)[None], None, mask)  # fmt: skip
        cache = commit(cache, block, jnp.asarray([i]))
        drafted = drafter.draft_logits(params, dparams, cache, tokens[:, i], L)  # [1,1+L,V]
        np.testing.assert_allclose(drafted[:, 1:], trained, atol=2e-4, rtol=2e-4)
        base, _, _ = forward(params, cfg, tokens[:, : i + 1], jnp.arange(i + 1)[None], None,
                             causal_mask(1, i + 1))  # fmt: skip
        np.testing.assert_allclose(drafted[:, 0], base[:, i], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mqa"])
@pytest.mark.parametrize("tree_name", ["chain-1", "chain-5", "comb-3-3"])
def test_greedy_two_step_decoding_equals_ar(name, tree_name):
    cfg, params = tiny(name)
    drafter, dparams = random_sdsat(cfg, params, n_ids=2)
    prompts = [[5, 6, 7, 8, 9], [3, 1, 4]]
    ar = SpeculativeGenerator(cfg, params).generate_batch(prompts, 30)
    gen = SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset(tree_name))
    got = gen.generate_batch(prompts, 30)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    # The first tree depth is the base model's own next token: at least 2 tokens a loop.
    assert all(r.steps <= 1 + -(-29 // 2) for r in got)


def test_drafts_come_from_the_committed_cache():
    """The redraft program sees the cache as committed: a drafter whose depth-1 guess is
    the model's own token gets it accepted at every step, and greedy stays exact."""
    cfg, params = tiny()
    drafter, dparams = random_sdsat(cfg, params)
    tree = tree_preset("chain-3")
    prompt = [5, 6, 7, 8]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 20).token_ids
    cache = init_cache(cfg, 1, 64)
    tokens = jnp.asarray([prompt + ar[:5]], jnp.int32)
    n = tokens.shape[1] - 1
    _, block, _ = run_layers(params, cfg, embed(params, tokens[:, :n]), jnp.arange(n)[None],
                             None, causal_mask(1, n))  # fmt: skip
    cache = commit(cache, block, jnp.asarray([n]))
    candidates = redraft(params, dparams, cache, tokens[:, n], tree=tree, drafter=drafter)
    assert int(candidates[0, 0]) == ar[5]  # depth 1: the base model's own next token
    got = SpeculativeGenerator(cfg, params, drafter, dparams, tree).generate(prompt, 20)
    assert got.token_ids == ar and got.steps <= 1 + -(-19 // 2)  # >= 2 tokens a loop


@pytest.mark.slow  # CI time (~31 s)
def test_one_forward_chains_draft_what_the_draft_step_drafts():
    """The adaptive chain hung off token a inside one forward gives the draft step's
    guesses for `current` = token a against a cache of the tokens before it, and the real
    tokens' logits stay the plain forward's."""
    cfg, params = tiny()
    k = 3
    drafter, dparams = random_sdsat(cfg, params, n_ids=2, one_forward=True)
    S = 10
    tokens = jax.random.randint(jax.random.key(5), (1, S), 0, cfg.vocab_size)
    positions = jnp.arange(S)[None]
    anchors = jnp.asarray([[2, 5, 9]])
    h, block, _, chains = drafter.run_model(
        params, dparams, cfg, embed(params, tokens), positions, None, causal_mask(1, S),
        anchors, (), k,
    )  # fmt: skip
    plain, _, _ = forward(params, cfg, tokens, positions, None, causal_mask(1, S))
    np.testing.assert_allclose(lm_logits(params, cfg, h), plain, atol=2e-4, rtol=2e-4)
    assert block.keys[0].shape[2] == S  # only the real tokens' keys/values come back
    for slot, a in enumerate([2, 5, 9]):
        cache = init_cache(cfg, 1, 32)
        _, prefix, _ = run_layers(params, cfg, embed(params, tokens[:, :a]),
                                  jnp.arange(a)[None], None, causal_mask(1, a))  # fmt: skip
        cache = commit(cache, prefix, jnp.asarray([a]))
        drafted = drafter.draft_logits(params, dparams, cache, tokens[:, a], k)  # [1,1+k,V]
        got = lm_logits(params, cfg, chains[:, slot])  # [1,k,V]
        np.testing.assert_allclose(got, drafted[:, 1:], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mqa"])
@pytest.mark.parametrize("tree_name", ["chain-1", "chain-3", "comb-3-3"])
def test_greedy_one_forward_decoding_equals_ar(name, tree_name):
    cfg, params = tiny(name)
    drafter, dparams = random_sdsat(cfg, params, n_ids=2, one_forward=True)
    assert not drafter.drafts_from_cache
    prompts = [[5, 6, 7, 8, 9], [3, 1, 4]]
    ar = SpeculativeGenerator(cfg, params).generate_batch(prompts, 30)
    gen = SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset(tree_name))
    got = gen.generate_batch(prompts, 30)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]


def test_a_tree_without_depth_is_refused():
    cfg, params = tiny()
    drafter, dparams = random_sdsat(cfg, params)
    with pytest.raises(JaxspecError, match="depth >= 1"):
        SpeculativeGenerator(cfg, params, drafter, dparams, TreeSpec(()))


@pytest.fixture(scope="module")
def trained_sdsat(tiny_ckpt, tmp_path_factory):
    """Train 4 steps, 'interrupt', resume to 7: (drafter dir, reports, checkpoint)."""
    import train.sdsat as sdsat

    tmp = tmp_path_factory.mktemp("sdsat")
    common = [*tiny_training_args(tiny_ckpt[0], tmp), "--spans", "4", "--window", "3",
              "--rank", "2", "--ids", "2", "--cpu-tree", "chain-3", "--overwrite"]  # fmt: skip
    first, second = train_on_made_up_conversations(
        sdsat, [*common, "--steps", "4"], [*common, "--steps", "7"]
    )
    return tmp / "out", first, second, tiny_ckpt[0]


def test_sdsat_training_resumes_and_ships_a_lossless_drafter(trained_sdsat):
    from jaxspec.drafters.store import load_drafter
    from jaxspec.methods import build_generator
    from jaxspec.models import load_model

    out, first, second, ckpt = trained_sdsat
    assert first["steps"] == 4 and second["steps"] == 7
    assert first["final_loss"] != second["final_loss"]  # it trained on
    assert "chain-3" in second["accepted_per_step"]  # its CPU default tree was measured
    assert min(second["accepted_per_step"].values()) >= 1.0
    assert len(second["test"]["top1_per_depth"]) == 3 and second["test"]["spans"] > 0
    model = load_model(ckpt)
    settings, dparams, _ = load_drafter(out, "sdsat", model.cfg)
    assert settings.n_ids == 2 and dparams["embed"].shape == (2, model.cfg.dim)
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(model.cfg, model.params).generate(prompt, 24).token_ids
    gen = build_generator(model, "sdsat", out)
    assert gen.tree == tree_preset("chain-3")
    assert gen.generate(prompt, 24).token_ids == ar
    topk = np.array(second["test"]["topk_per_depth"])  # [3,5]: cumulative top-1..5
    assert topk.shape == (3, 5) and np.all(np.diff(topk, axis=1) >= 0)
    np.testing.assert_allclose(topk[:, 0], second["test"]["top1_per_depth"])
    for name, paths in settings.trees.items():  # depth 1 is the model's own: rank 0 only
        assert TreeSpec(paths).n_nodes <= int(name.split("-")[1])
        assert [p for p in paths if len(p) == 1] == [[0]]
        gen = build_generator(model, "sdsat", out, tree=name)
        assert gen.generate(prompt, 24).token_ids == ar
    one = build_generator(model, "sdsat", out, sdsat_loop="one-forward")
    assert one.tree == tree_preset("chain-1") and one.drafter.one_forward  # not chain-3
    assert one.generate(prompt, 24).token_ids == ar
    with pytest.raises(JaxspecError, match="searched for sdsat's two-step loop"):
        build_generator(model, "sdsat", out, tree="searched-4", sdsat_loop="one-forward")


def test_init_starts_from_a_trained_sdsat_adapter(trained_sdsat, tmp_path):
    """--init DIR: with lr 0 two steps keep that adapter's weights exactly (fresh LoRA b
    would be zeros); an adapter of another rank is refused."""
    import train.sdsat as sdsat
    from jaxspec.drafters.store import load_drafter

    out, _, _, ckpt = trained_sdsat
    common = [*tiny_training_args(ckpt, tmp_path, lr=0), "--spans", "4", "--window", "3",
              "--ids", "2", "--steps", "2", "--init", str(out), "--overwrite"]  # fmt: skip
    train_on_made_up_conversations(sdsat, [*common, "--rank", "2"])
    cfg = load_checkpoint(ckpt)[0]
    start = load_drafter(out, "sdsat", cfg).params
    after = load_drafter(tmp_path / "out", "sdsat", cfg).params
    assert float(jnp.abs(start["lora"][0]["q_proj"]["b"]).max()) > 0
    jax.tree.map(np.testing.assert_array_equal, after, start)
    card = (tmp_path / "out" / "CARD.md").read_text()
    assert f"Started from the weights of the drafter then at `{out}`" in card
    with pytest.raises(JaxspecError, match="do not fit the drafter these flags build"):
        train_on_made_up_conversations(sdsat, [*common, "--rank", "3"])


def test_rowcost_times_forwards_with_the_adapter(trained_sdsat, capsys):
    import json

    from infer.rowcost import main as rowcost_main

    out, _, _, ckpt = trained_sdsat
    argv = ["--model", str(ckpt), "--rows", "1", "4", "--repeats", "1", "--sdsat", str(out)]
    rowcost_main(argv)
    got = json.loads(capsys.readouterr().out)
    assert list(got["ms"]) == ["float32", "float32+sdsat"]
    assert all(ms > 0 for row in got["ms"].values() for ms in row.values())


def test_sdsat_trees_spend_no_node_on_depth_one_alternatives():
    from train.sdsat import sdsat_trees

    topk = [[0.5, 0.6, 0.7, 0.75, 0.8], [0.3, 0.4, 0.45, 0.5, 0.55]]  # depths 2 and 3
    trees = sdsat_trees(topk, sizes=(4, 6))
    assert trees["searched-4"] == [[0], [0, 0], [0, 0, 0]]  # 0.5 * 0.3 beats 0.1
    assert trees["searched-6"] == [[0], [0, 0], [0, 1], [0, 2], [0, 0, 0]]


def test_the_adaptive_vocabulary_round_trips_and_is_refused_for_another_model(tmp_path):
    """Adaptive-token embeddings and adapter saved and loaded back unchanged; a drafter
    for one model is refused for another with a clear error."""
    from jaxspec.drafters.store import load_drafter, save_drafter

    cfg, params = tiny()
    drafter, dparams = random_sdsat(cfg, params, n_ids=3)
    save_drafter(tmp_path, "sdsat", SdsatSettings(rank=3, n_ids=3), dparams, cfg, "card")
    settings, loaded, _ = load_drafter(tmp_path, "sdsat", cfg)
    assert settings == SdsatSettings(rank=3, n_ids=3)
    for a, b in zip(jax.tree.leaves(dparams), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other, _ = tiny("tiny-mqa", vocab=57)
    with pytest.raises(JaxspecError, match="trained for"):
        load_drafter(tmp_path, "sdsat", other)


def test_inplace_spans_stay_inside_the_answer_and_count_offsets():
    from train.sdsat_full import inplace_spans

    rng = np.random.default_rng(0)
    starts, lengths = np.array([5, 9]), np.array([30, 20])
    masked, offset = inplace_spans(starts, lengths, 32, 4, 0.3, rng)
    for b in range(2):
        where = np.flatnonzero(masked[b])
        assert where.size and where.min() >= starts[b] and where.max() < lengths[b] - 1
        run_starts = where[offset[b, where] == 0]
        for p in where:  # offsets count up from each span's first replaced position
            assert offset[b, p] == p - run_starts[run_starts <= p].max()
    assert offset.max() < 4


def test_full_fine_tuning_extends_the_vocabulary_and_decodes_losslessly(tiny_ckpt, tmp_path):
    """Mode (a): the checkpoint gains the adaptive ids (its rows are the drafter's), and
    two-step decoding with the fine-tuned model equals that model's own AR."""
    import train.sdsat as sdsat
    from jaxspec.methods import build_generator
    from jaxspec.models import load_model

    args = ["--model", str(tiny_ckpt[0]), "--work-dir", str(tmp_path / "work"),
            "--out", str(tmp_path / "full"), "--mode", "full", "--train-seqs", "6",
            "--test-seqs", "3", "--prompt-len", "40", "--new-tokens", "16", "--batch", "2",
            "--window", "3", "--ids", "2", "--steps", "3", "--lr", "0.01",
            "--mask-rate", "0.3", "--cpu-tree", "chain-3"]  # fmt: skip
    (report,) = train_on_made_up_conversations(sdsat, args)
    assert report["steps"] == 3 and report["final_adaptive_loss"] > 0
    curve = report["loss_curve"]  # 3 steps: one window
    assert curve["from_step"] == 0 and len(curve["standard"]) == len(curve["adaptive"]) == 1
    test = report["test"]
    assert 0 < test["standard_loss"] < 20
    assert test["standard_loss"] != test["standard_loss_original"]
    base, tuned = load_model(tiny_ckpt[0]), load_model(tmp_path / "full")
    assert tuned.cfg.vocab_size == base.cfg.vocab_size + 2
    gen = build_generator(tuned, "sdsat", tmp_path / "full" / "sdsat")
    np.testing.assert_allclose(
        gen.drafter_params["embed"], tuned.params["embed_tokens"][base.cfg.vocab_size :]
    )
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(tuned.cfg, tuned.params).generate(prompt, 20).token_ids
    assert gen.generate(prompt, 20).token_ids == ar


@pytest.mark.parametrize("loss", ["improved", "basic"])
def test_full_step_losses_are_the_papers(loss):
    """Eq. 9 (improved): 1/2 (clean cross-entropy over the answer + cross-entropy at the
    adaptive inputs of the mixed sequence); Eq. 8 (basic, Appendix A): cross-entropy over
    every answer target of the mixed sequence, its standard part at the ordinary inputs.
    The mixed sequence's targets are the clean tokens (Y_M), never an adaptive id: adaptive
    token j learns the token j+1 past the span's start, as drafting reads it. Checked
    against cross-entropies computed here from the model's logits."""
    import optax

    from train.sdsat_full import answer_targets, full_step

    cfg, params = tiny(vocab=61)  # ids 59, 60 are the adaptive ones
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 59, (2, 12)).astype(np.int32)
    starts, lengths = np.array([3, 5]), np.array([12, 10])
    masked = np.zeros((2, 12), bool)
    masked[0, 5:8], masked[1, 6:7] = True, True
    offset = np.zeros((2, 12), np.int32)
    offset[0, 5:8], offset[1, 6] = [0, 1, 2], 0
    answer = np.zeros((2, 11), np.float32)  # targets at positions start .. length-1
    answer[0, 2:11], answer[1, 4:9] = 1, 1
    np.testing.assert_array_equal(answer_targets(starts, lengths, 12), answer)
    mixed = np.where(masked, np.minimum(59 + offset, 60), tokens)

    def ce(seq):  # [2,11] cross-entropy of each position's next clean token
        logits, _, _ = forward(params, cfg, jnp.asarray(seq), jnp.broadcast_to(jnp.arange(12),
                               (2, 12)), None, causal_mask(2, 12))  # fmt: skip
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -np.take_along_axis(np.asarray(logp), tokens[:, 1:, None], 2)[..., 0]

    def mean(x, w):
        return (x * w).sum() / w.sum()

    at_adaptive = answer * masked[:, :-1]
    adaptive = mean(ce(mixed), at_adaptive)
    if loss == "improved":
        standard = mean(ce(tokens), answer)
        expected = 0.5 * (standard + adaptive)
    else:
        standard = mean(ce(mixed), answer - at_adaptive)
        expected = mean(ce(mixed), answer)
        assert not np.isclose(standard, mean(ce(tokens), answer))  # the mixed sequence's
    optimizer = optax.sgd(0.0)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    _, (value, got_standard, got_adaptive) = full_step(
        state, tokens, answer, masked, offset, cfg=cfg, optimizer=optimizer, n_ids=2, w=1.0,
        loss=loss,
    )  # fmt: skip
    np.testing.assert_allclose([value, got_standard, got_adaptive],
                               [expected, standard, adaptive], rtol=1e-5)  # fmt: skip


def test_the_papers_schedule_warms_up_a_fifth_and_trains_even_one_step():
    from train.optim import paper_schedule

    ten = paper_schedule(1.0, 10)
    assert float(ten(0)) == 0.0 and float(ten(2)) == 1.0 and 0.2 < float(ten(9)) < 1.0
    assert float(paper_schedule(1.0, 2)(0)) == 0.0  # one warm-up step, then the decay
    assert float(paper_schedule(1.0, 1)(0)) == 1.0  # no warm-up: its one step trains


@pytest.mark.parametrize("anneal", ["steps", "minutes"])
def test_the_adapters_optimizer_is_the_papers_adamw_on_its_schedule(anneal):
    """AdamW with beta2 0.95 and no weight decay on the paper's schedule; under --anneal
    minutes the same updates when each step's rate is set from that schedule."""
    import optax

    from train.optim import apply_grads, paper_schedule
    from train.sdsat import Sdsat

    trainer = object.__new__(Sdsat)
    trainer.args = SimpleNamespace(lr=0.1, steps=10, anneal=anneal)
    ours, paper = trainer.make_optimizer(), optax.adamw(paper_schedule(0.1, 10), b2=0.95,
                                                        weight_decay=0.0)  # fmt: skip
    states = [{"params": {"w": jnp.zeros(2)}, "step": 0} for _ in range(2)]
    for state, optimizer in zip(states, (ours, paper), strict=True):
        state["opt_state"] = optimizer.init(state["params"])
    for step in range(4):
        if anneal == "minutes":  # the rate set before the step, the clock not ahead of it
            states[0] = trainer.clock_rate(states[0], step, began=None)
        grads = {"w": jnp.array([1.0, -2.0]) * (step + 1)}
        states = [apply_grads(s, grads, o) for s, o in zip(states, (ours, paper), strict=True)]
    assert float(jnp.abs(states[1]["params"]["w"]).min()) > 0.01  # it moved
    np.testing.assert_allclose(states[0]["params"]["w"], states[1]["params"]["w"], rtol=1e-6)
