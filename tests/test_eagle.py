"""The EAGLE-class drafter: its cache of entries equals a whole-sequence pass, static and
dynamic (EAGLE-2) trees decode AR's tokens, the dynamic tree holds the N best nodes of
everything the drafter scored, and training-time test computes what drafting does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.drafters.eagle import (
    EagleDrafter,
    EagleSettings,
    fused_layers,
    shifted,
    training_outputs,
)
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import compute_params, embed, plain_products, run_layers
from tests.test_api import write_drafters

PROMPTS = ["w5 w9 w7 w11", "w8 w30 w8"]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return jaxspec.load_model(tiny_ckpt[0], dtype="float32")


@pytest.fixture(scope="module")
def drafter_dir(tiny_ckpt, tmp_path_factory):
    return write_drafters(tiny_ckpt[0], tmp_path_factory.mktemp("drafters")) / "eagle"


def trained_like(drafter, params, seed=0):
    """Random drafter weights (an untrained drafter's are mostly identities)."""
    fresh = drafter.init(params)
    leaves, tree = jax.tree.flatten(fresh)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )


@pytest.mark.parametrize("tree", ["chain-3", "comb-2-10", "cpu-8", "dynamic-8", "dynamic-12-3-3"])
def test_eagle_decodes_ars_tokens(model, drafter_dir, tree):
    ar = jaxspec.Generator(model).generate(PROMPTS, max_new_tokens=16)
    gen = jaxspec.Generator(model, "eagle", drafter=drafter_dir, tree=tree)
    got = gen.generate(PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]


def test_eagle_refuses_trees_beyond_its_depth(model, drafter_dir):
    with pytest.raises(JaxspecError, match=r"dynamic\) is 4 deep; this drafter drafts at most 3"):
        jaxspec.Generator(model, "eagle", drafter=drafter_dir, tree="dynamic-8-4-2")
    # 2 + 2 x 2 x 2 = 10 candidates for 12 nodes (14 within reach of the tree's own count)
    with pytest.raises(JaxspecError, match="scores 10 candidates, fewer than the tree's 12"):
        jaxspec.Generator(model, "eagle", drafter=drafter_dir, tree="dynamic-13-3-2")


def sequence_pass(drafter, params, dp, tokens):
    """The model and the drafter's first step over whole sequences [B,n] -> the layer's
    outputs [B,n,D] (training_outputs' step 1)."""
    cfg = drafter.cfg
    B, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (B, n))
    _, _, states = run_layers(params, cfg, embed(params, tokens), positions, None,
                              causal_mask(B, n), collect=drafter.collect)  # fmt: skip
    features = shifted(drafter.fuse(dp, states))
    return training_outputs(drafter, params, dp, tokens, features, 1)[0], states


@pytest.mark.parametrize("blocks", [1, 2])
def test_cached_entries_equal_a_whole_sequence_pass(model, blocks):
    """advance() over a prompt in two chunks, then an accepted path: the root entry's
    output is the whole-sequence pass's at that position."""
    from jaxspec.drafters.base import DraftInputs, Entered

    cfg, params = model.cfg, model.params
    drafter = EagleDrafter(cfg, (1, 1, 2), 3, blocks)
    dp = trained_like(drafter, params)
    tokens = jnp.asarray([[5, 9, 7, 11, 5, 8, 30, 8, 9, 10]])
    y, states = sequence_pass(drafter, params, dp, tokens)
    state = drafter.init_state(cfg, 1, 32, jnp.float32)
    for start, stop in ((0, 4), (4, 7), (7, 9)):  # entries start+1 .. stop
        hidden = {n: h[:, start:stop] for n, h in states.items()}
        entered = Entered(tokens[:, start:stop], jnp.array([start]), jnp.array([stop - start]),
                          hidden)  # fmt: skip
        inputs = DraftInputs({}, tokens[:, stop], jnp.array([stop]),
                             entered=entered, state=state)  # fmt: skip
        state = drafter.advance(params, dp, inputs)
        np.testing.assert_allclose(state.newest[0], y[0, stop], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("blocks", [1, 2])
def test_training_time_test_is_drafting_along_the_true_path(model, blocks):
    """Step k of training at position i = the static chain's depth-(k-1) node whose path
    is the true tokens: drafting a chain with the true tokens forced gives the same output."""
    cfg, params = model.cfg, model.params
    drafter = EagleDrafter(cfg, (1, 1, 2), 3, blocks)
    dp = trained_like(drafter, params, seed=1)
    tokens = jnp.asarray([[5, 9, 7, 11, 5, 8, 30, 8, 9, 10]])
    _, states = sequence_pass(drafter, params, dp, tokens)
    outs = training_outputs(drafter, params, dp, tokens, shifted(drafter.fuse(dp, states)), 3)
    p = 5  # the root x_5; its entry and those before it are committed
    st = drafter.init_state(cfg, 1, 32, jnp.float32)
    from jaxspec.drafters.base import DraftInputs, Entered

    entered = Entered(tokens[:, :p], jnp.array([0]), jnp.array([p]),
                      {n: h[:, :p] for n, h in states.items()})  # fmt: skip
    st = drafter.advance(params, dp, DraftInputs({}, tokens[:, p], jnp.array([p]),
                                                 entered=entered, state=st))  # fmt: skip
    feature, ks, vs = st.newest[:, None], None, None
    ks = vs = jnp.zeros((1, drafter.kv_heads, 0, cfg.head_dim))
    for depth in (1, 2):  # nodes x_{p+1}, x_{p+2} forced to the true tokens
        above = jnp.ones((1, 1, ks.shape[2]), bool)
        y, k, v = drafter.expand(params, dp, st, jnp.array([p]), tokens[:, p + depth, None],
                                 feature, jnp.array([[depth]]), above, ks, vs)  # fmt: skip
        np.testing.assert_allclose(y[0, 0], outs[depth][0, p + depth], rtol=2e-4, atol=2e-4)
        feature, ks, vs = y, jnp.concatenate([ks, k], 2), jnp.concatenate([vs, v], 2)


@pytest.mark.parametrize("blocks", [1, 2])
def test_training_window_is_the_whole_sequence_pass_there(model, blocks):
    """The layer run on a window of each sequence (first [B], width W) gives the
    whole-sequence outputs at every window position whose path lies inside it (step k:
    from first+k-1 on): the prompt before the window enters as committed entries only."""
    cfg, params = model.cfg, model.params
    drafter = EagleDrafter(cfg, (1, 1, 2), 3, blocks)
    dp = trained_like(drafter, params, seed=3)
    tokens = jnp.asarray([[5, 9, 7, 11, 5, 8, 30, 8, 9, 10, 12, 6],
                          [8, 30, 8, 9, 5, 9, 7, 11, 14, 6, 5, 7]])  # fmt: skip
    features = shifted(drafter.fuse(dp, sequence_pass(drafter, params, dp, tokens)[1]))
    whole = training_outputs(drafter, params, dp, tokens, features, 3)
    first, W = np.array([5, 2]), 6
    window = training_outputs(drafter, params, dp, tokens, features, 3, jnp.asarray(first), W)
    for k, (w, y) in enumerate(zip(window, whole, strict=True)):
        assert w.shape == (2, W, cfg.dim)
        for b in range(2):
            np.testing.assert_allclose(w[b, k:], y[b, first[b] + k : first[b] + W],
                                       rtol=2e-4, atol=2e-4)  # fmt: skip


def drafter_after_prompt(model, seed: int):
    """A random-like EAGLE drafter (layers 1, 1, 2; depth 3) whose state has entered the
    first 5 tokens of [5, 9, 7, 11, 5, 8] -> (drafter, its params, tokens, 5, state)."""
    from jaxspec.drafters.base import DraftInputs, Entered

    cfg, params = model.cfg, model.params
    drafter = EagleDrafter(cfg, (1, 1, 2), 3)
    dp = trained_like(drafter, params, seed=seed)
    tokens = jnp.asarray([[5, 9, 7, 11, 5, 8]])
    _, states = sequence_pass(drafter, params, dp, tokens)
    p = 5
    st = drafter.advance(params, dp, DraftInputs(
        {}, tokens[:, p], jnp.array([p]), state=drafter.init_state(cfg, 1, 32, 0),
        entered=Entered(tokens[:, :p], jnp.array([0]), jnp.array([p]),
                        {n: h[:, :p] for n, h in states.items()})))  # fmt: skip
    return drafter, dp, tokens, p, st


def test_dynamic_tree_is_the_n_best_of_all_scored(model):
    """EAGLE-2's pool cut short: with 9 drafted nodes of the 21 the search scores, each
    node's parent comes before it one depth up, and the paths are the pool's 9 best by
    path probability (the drafter re-run on each path by hand)."""
    from jaxspec.drafters.base import DraftInputs
    from jaxspec.tree import DynamicTree
    from tests.test_dynamic_tree import assert_the_n_best_of, beam_pool, chosen_paths

    cfg, params = model.cfg, model.params
    drafter, dp, tokens, p, st = drafter_after_prompt(model, seed=2)
    inputs = DraftInputs({}, tokens[:, p], jnp.array([p]), state=st)
    draft = drafter.draft_dynamic(params, dp, inputs, DynamicTree(10, 3, 3))
    parent, depth = np.asarray(draft.parent[0]), np.asarray(draft.depth[0])
    paths = {0: ()} | dict(enumerate(chosen_paths(draft, 0), start=1))
    for n in range(1, 10):
        assert parent[n - 1] < n and depth[n - 1] == len(paths[parent[n - 1]]) + 1

    def log_probs(path):  # the drafter's log probabilities after a path of tokens
        feature = st.newest[:, None]
        ks = vs = jnp.zeros((1, cfg.n_kv_heads, 0, cfg.head_dim))
        for d, t in enumerate(path, start=1):
            above = jnp.ones((1, 1, d - 1), bool)  # every earlier entry is an ancestor
            y, k, v = drafter.expand(params, dp, st, jnp.array([p]), jnp.array([[t]]), feature,
                                     jnp.array([[d]]), above, ks, vs)  # fmt: skip
            feature, ks, vs = y, jnp.concatenate([ks, k], 2), jnp.concatenate([vs, v], 2)
        return np.asarray(jax.nn.log_softmax(drafter.logits(params, dp, feature[0, 0])))

    assert_the_n_best_of(beam_pool(log_probs, 3, 3), list(paths.values())[1:], 9, 1e-4)


def test_eagle_settings_round_trip():
    s = EagleSettings(layers=(2, 15, 27))
    assert EagleSettings.from_json(s.to_json(), "x") == s
    old = EagleSettings.from_json({"layers": [2, 15, 27], "depth": 6}, "x")  # before --blocks
    assert old.blocks == 1


def test_two_block_drafter_decodes_ars_tokens(model, tmp_path):
    """A drafter of two blocks (random weights, saved and loaded): static and dynamic trees
    decode AR's tokens; grown from a one-block drafter it drafts what that one drafts."""
    from jaxspec.drafters.store import save_drafter

    two = EagleDrafter(model.cfg, (1, 1, 2), 3, blocks=2)
    dp = trained_like(two, model.params, seed=4)
    save_drafter(tmp_path / "two", "eagle", EagleSettings(layers=(1, 1, 2), depth=3, blocks=2),
                 dp, model.cfg, "untrained")  # fmt: skip
    one_p = {k: v for k, v in dp.items() if k != "upper"}
    save_drafter(tmp_path / "one", "eagle", EagleSettings(layers=(1, 1, 2), depth=3), one_p,
                 model.cfg, "untrained")  # fmt: skip
    grown = {**one_p, "upper": two.init(model.params)["upper"]}  # silent second block
    save_drafter(tmp_path / "grown", "eagle", EagleSettings(layers=(1, 1, 2), depth=3, blocks=2),
                 grown, model.cfg, "untrained")  # fmt: skip
    ar = jaxspec.Generator(model).generate(PROMPTS, max_new_tokens=16)
    for tree in ("chain-3", "cpu-8", "dynamic-8"):
        got = jaxspec.Generator(model, "eagle", drafter=tmp_path / "two", tree=tree).generate(
            PROMPTS, max_new_tokens=16
        )
        assert [r.token_ids for r in got] == [r.token_ids for r in ar], tree
    runs = [jaxspec.Generator(model, "eagle", drafter=tmp_path / name, tree="dynamic-8")
            .generate(PROMPTS, max_new_tokens=16) for name in ("one", "grown")]  # fmt: skip
    assert [r.accepted for r in runs[0]] == [r.accepted for r in runs[1]]


@pytest.fixture(scope="module")
def trained_eagle(tiny_ckpt, tmp_path_factory):
    """Train 4 steps (the answers made 3 prompts at a time), 'interrupt', resume with the
    states computed live (as on a GPU) and stop at once by --max-minutes (step 5, a drafter
    written), resume again to 6 in plain products: (drafter dir, reports, checkpoint,
    work)."""
    import train.eagle as eagle
    from tests.conftest import tiny_training_args, train_on_made_up_conversations

    tmp = tmp_path_factory.mktemp("eagle")
    common = [*tiny_training_args(tiny_ckpt[0], tmp, save_every=2), "--rows", "6", "--ttt", "3",
              "--depth", "3", "--guess-vocab", "40", "--overwrite"]  # fmt: skip
    first, stopped, second = train_on_made_up_conversations(
        eagle,
        [*common, "--steps", "4", "--answer-batch", "3", "--eval-every", "2"],
        [*common, "--steps", "6", "--states", "live", "--max-minutes", "0.0001"],
        [*common, "--steps", "6", "--states", "live", "--live-products", "plain"],
    )
    assert stopped["steps"] == 5 and "test_topk_accuracy" in stopped  # a drafter all the same
    return tmp / "out", first, second, tiny_ckpt[0], tmp / "work"


def test_eagle_training_resumes_and_ships_a_lossless_drafter(trained_eagle):
    from jaxspec.drafters.store import load_drafter

    out, first, second, ckpt, work = trained_eagle
    assert first["steps"] == 4 and second["steps"] == 6
    runs = [p for p in work.rglob("*") if p.parent.name == "checkpoints" and p.is_dir()]
    assert len(runs) == 1  # the live run resumed the cached one's checkpoints
    assert not list(work.rglob("states-*-self-train-*.npz"))[1:]  # live: no second cache
    assert first["final_loss_per_step"] != second["final_loss_per_step"]  # it trained on
    assert min(second["accepted_per_step"].values()) >= 1.0
    for split in ("test", "seen"):
        acc = np.array(second[f"{split}_topk_accuracy"])
        assert acc.shape == (3, 5) and np.all(np.diff(acc, axis=1) >= 0)
    # 4 steps at lr 0.01 on 8 answers: the first 4 are remembered, the test ones not
    assert first["seen_topk_accuracy"][0][0] > first["test_topk_accuracy"][0][0] + 0.05
    assert first["draws_per_answer"] == 1.0 and second["draws_per_answer"] == 1.5  # 8 answers
    assert [e["step"] for e in first["history"]] == [0, 2, 4]  # --eval-every 2, and the end
    assert first["history"][-1]["seen"] == [row[0] for row in first["seen_topk_accuracy"]]
    assert second["history"] == first["history"]  # kept in the run's record
    model = jaxspec.load_model(ckpt, dtype="float32")
    settings, _, data = load_drafter(out, "eagle", model.cfg)
    size = len(data["draft_vocab"])
    assert second["draft_vocab_size"] == size <= 40 + len(model.cfg.eos_token_ids)
    card = (out / "CARD.md").read_text()
    named = "the training answers' 40 most" if size >= 40 else f"all {size} tokens of the"
    assert f"Draft vocabulary: {named}" in card  # what was built, not only what was asked
    assert "# EAGLE-class drafter" in card and "| 4 | 0." in card  # the history table
    ar = jaxspec.Generator(model).generate(PROMPTS, max_new_tokens=16)
    for tree in ("chain-2", "searched-8", "dynamic-8"):
        got = jaxspec.Generator(model, "eagle", drafter=out, tree=tree).generate(
            PROMPTS, max_new_tokens=16
        )
        assert [r.token_ids for r in got] == [r.token_ids for r in ar], tree


@pytest.mark.slow  # a non-default training path (~30 s): the fast set keeps its parts
def test_eagle_grows_a_block_from_a_trained_drafter(trained_eagle, tmp_path):
    """--init a one-block drafter with --blocks 2: it starts where that drafter ended (its
    step-0 accuracy), trains (here on each answer's first 5 rows: --rows-within's narrower
    window; on the prompts but the first 2 it trained on: --skip-prompts), and ships a
    two-block drafter that decodes AR's tokens."""
    import json

    import train.eagle as eagle
    from tests.conftest import tiny_training_args, train_on_made_up_conversations

    out, _, second, ckpt, _ = trained_eagle
    args = [*tiny_training_args(ckpt, tmp_path), "--rows", "6", "--ttt", "3", "--depth", "3",
            "--init", str(out), "--keep-vocab", "--blocks", "2", "--steps", "2",
            "--eval-every", "2", "--rows-within", "5", "--skip-prompts", "first:2:40"]  # fmt: skip
    (grown,) = train_on_made_up_conversations(eagle, args)
    answers = np.load(tmp_path / "work/self-train-8-less-first-2-p40-p40-n24.npz")
    assert len(answers["tokens"]) == 6  # 8 prompts less the 2
    start = grown["history"][0]["test"]  # the float16 weights of the drafter it started from
    np.testing.assert_allclose(start, [acc[0] for acc in second["test_topk_accuracy"]], atol=0.03)
    assert json.loads((tmp_path / "out/drafter.json").read_text())["settings"]["blocks"] == 2
    card = (tmp_path / "out/CARD.md").read_text()
    assert "2 decoder layers in turn" in card and "the first 2 'first' prompts of <= 40" in card
    model = jaxspec.load_model(ckpt, dtype="float32")
    ar = jaxspec.Generator(model).generate(PROMPTS, max_new_tokens=16)
    got = jaxspec.Generator(model, "eagle", drafter=tmp_path / "out", tree="dynamic-8").generate(
        PROMPTS, max_new_tokens=16
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]


def test_live_states_answer_the_prompts_skip_prompts_leaves(tiny_ckpt, tmp_path, monkeypatch):
    """--states live (a GPU loan's path) asks self_answers for the training answers less
    --skip-prompts' prompts, as the cached path asks layer_features (the slow block test)."""
    import train.eagle as eagle
    from tests.conftest import tiny_training_args

    class Asked(Exception):
        pass

    def answers(*args):
        raise Asked(args)

    monkeypatch.setattr(eagle, "self_answers", answers)
    with pytest.raises(Asked) as asked:
        eagle.train([*tiny_training_args(tiny_ckpt[0], tmp_path), "--states", "live",
                     "--turns", "every", "--skip-prompts", "first:6:40"])  # fmt: skip
    assert asked.value.args[0][2:4] == ("train", 8)
    assert asked.value.args[0][-2:] == ("every", "first:6:40")


def test_live_states_are_the_cached_ones(tiny_ckpt, tmp_path, monkeypatch):
    """--states live feeds a training step what --states cached reads from disk: the
    fused and last layers' states of the batch's sequences (--live-products plain: within
    bfloat16's rounding of them)."""
    from tests.test_medusa import conversations
    from train import features
    from train.eagle import cached_fused_and_last, fused_and_last

    monkeypatch.setattr(features, "sharegpt_split", lambda split: conversations(seed=1))
    model = jaxspec.load_model(tiny_ckpt[0], dtype="float32")
    layers = fused_layers(model.cfg)
    stored = features.stored_layers(model.cfg, layers)
    data = features.layer_features(model, tmp_path, "train", 6, 40, 24, layers, answer_batch=4)
    seqs = np.array([4, 1])
    tokens = jnp.asarray(data["tokens"][seqs])
    states = features.live_states(model.params, tokens, cfg=model.cfg, layers=stored)
    live = fused_and_last(states, stored, layers)
    cached = cached_fused_and_last(data, seqs, layers)
    plain = plain_products(compute_params(model.params, "bfloat16"))  # --live-products plain
    rounded = features.live_states(plain, tokens, cfg=model.cfg, layers=stored)
    rounded = fused_and_last(rounded, stored, layers)
    for a, b, c in zip(live, cached, rounded, strict=True):
        assert a.shape == b.shape == c.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3)
        error = np.abs(np.asarray(c) - np.asarray(b)).max() / np.abs(np.asarray(b)).max()
        assert 0 < error < 0.05  # bfloat16 rounding, no more


@pytest.mark.slow  # a non-default data path (~30 s)
def test_eagle_trains_on_sharegpt_replies_and_keeps_its_vocabulary(tiny_ckpt, tmp_path):
    """--answers sharegpt trains on the conversations' own replies, states live and no
    answers generated; training further with --init --keep-vocab keeps that drafter's draft
    vocabulary; cached states are refused for such answers."""
    import train.eagle as eagle
    from jaxspec.drafters.store import load_drafter
    from tests.conftest import tiny_training_args, train_on_made_up_conversations

    flags = ["--rows", "6", "--ttt", "2", "--depth", "2", "--guess-vocab", "30", "--steps", "2",
             "--answers", "sharegpt"]  # fmt: skip
    first = [*tiny_training_args(tiny_ckpt[0], tmp_path / "a"), *flags]
    further = [*tiny_training_args(tiny_ckpt[0], tmp_path / "b"), *flags, "--answers", "self",
               "--init", str(tmp_path / "a" / "out"), "--keep-vocab"]  # fmt: skip
    a, b = train_on_made_up_conversations(eagle, first, further)
    work = tmp_path / "a" / "work"
    assert list(work.rglob("sharegpt-first-train-8-p40-n24.npz"))
    assert not list(work.rglob("self-train-*.npz")) and not list(work.rglob("states-*-train-*"))
    assert a["steps"] == 2 and b["steps"] == 2
    assert "the conversations' own (ChatGPT's) replies" in (tmp_path / "a/out/CARD.md").read_text()
    assert "that of the drafter it started from" in (tmp_path / "b/out/CARD.md").read_text()
    model = jaxspec.load_model(tiny_ckpt[0], dtype="float32")
    vocabs = [load_drafter(tmp_path / run / "out", "eagle", model.cfg).data["draft_vocab"]
              for run in "ab"]  # fmt: skip
    np.testing.assert_array_equal(*vocabs)
    for wrong in (["--states", "cached"], ["--keep-vocab"]):  # no --init to keep it from
        with pytest.raises(SystemExit):
            eagle.parse_args([*tiny_training_args(tiny_ckpt[0], tmp_path / "c"), *flags, *wrong])


@pytest.mark.slow  # ~30 s
def test_eagle_scores_the_answers_to_a_benchmarks_questions(tiny_ckpt, tmp_path):
    """--eval-questions FILE: top-1 on the model's answers to the first turns of the first 5
    questions of each category (first turns only; cached under a name of their prompts),
    overall and by category."""
    import json

    import train.eagle as eagle
    from jaxspec.text import encode_prompt
    from tests.conftest import tiny_training_args, train_on_made_up_conversations

    questions = tmp_path / "questions.jsonl"
    rows = [(f"a{i}", "a", [f"w{5 + i} w9 w7", "w8 w8"]) for i in range(6)]
    rows += [(f"b{i}", "b", [f"w{30 + i} w11"]) for i in range(2)]
    questions.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": t}) + "\n"
                                 for q, c, t in rows))  # fmt: skip
    args = [*tiny_training_args(tiny_ckpt[0], tmp_path), "--rows", "6", "--ttt", "2",
            "--depth", "2", "--guess-vocab", "30", "--steps", "2", "--eval-every", "2",
            "--eval-questions", str(questions)]  # fmt: skip
    (report,) = train_on_made_up_conversations(eagle, args)
    assert report["questions_answers"] == 7 and report["questions"] == str(questions)
    accuracy = np.asarray(report["questions_topk_accuracy"])
    assert accuracy.shape == (2, 5) and (np.diff(accuracy, axis=1) >= 0).all()
    assert set(report["history"][-1]) == {"step", "test", "seen", "questions"}
    by_category = report["questions_top1_by_category"]
    assert set(by_category) == {"a", "b"}  # a weighted mean of the two, step by step:
    low, high = np.minimum(*by_category.values()), np.maximum(*by_category.values())
    assert ((low - 1e-4 <= accuracy[:, 0]) & (accuracy[:, 0] <= high + 1e-4)).all()
    hits = np.zeros((3, 2, 5))
    hits[:, 0, 0] = [1, 3, 4]
    got = eagle.by_category(hits, np.array([2, 4, 8]), np.array(["y", "x", "x"]))
    assert list(got) == ["x", "y"] and got["x"][0] == 7 / 12 and got["y"][0] == 1 / 2
    (cache,) = (tmp_path / "work").rglob("questions-*-7-n24.npz")
    data = np.load(cache)
    model = jaxspec.load_model(tiny_ckpt[0])
    firsts = [encode_prompt(model.tokenizer, t[0]) for _, c, t in rows[:5] + rows[6:]]
    got = [row[:s].tolist() for row, s in zip(data["tokens"], data["starts"], strict=True)]
    assert sorted(got) == sorted(firsts)
    card = (tmp_path / "out/CARD.md").read_text()
    assert "questions of " + str(questions) in card and "by category: a 0." in card


def test_feature_noise_is_in_proportion_to_each_element():
    from train.eagle import noisy

    scale = jnp.exp(jax.random.normal(jax.random.key(1), (2, 8, 3, 64)) * 3)  # outliers
    fused3 = jax.random.normal(jax.random.key(0), (2, 8, 3, 64)) * scale
    assert noisy(fused3, 0.0, jnp.uint32(5)) is fused3
    a, b = (noisy(fused3, 0.1, jnp.uint32(seed)) for seed in (5, 6))
    relative = (a - fused3) / fused3  # [2,8,3,64]
    assert abs(float(relative.std()) - 0.1) < 0.01 and abs(float(relative.mean())) < 0.01
    assert np.array_equal(a, noisy(fused3, 0.1, jnp.uint32(5)))  # the step's seed decides
    assert not np.allclose(a, b)


def test_rows_within_an_answers_start():
    """--rows-within N draws scored rows from each answer's first N tokens; 0 draws from all
    of it, as before the flag (same draws for the same rng)."""
    from train.chimera import row_range, sample_rows

    features = {"starts": np.array([10, 3]), "lengths": np.array([60, 40])}
    seqs = np.array([0, 1, 1])
    rows = sample_rows(features, seqs, 200, 4, np.random.default_rng(0), within=8)
    for n, r in zip(seqs, rows, strict=True):
        low, _ = row_range(features, n, 4)
        assert r.min() == low and r.max() == low + 7
    old = np.random.default_rng(0).integers(*row_range(features, 1, 4), 50)[None]
    np.testing.assert_array_equal(sample_rows(features, np.array([1]), 50, 4,
                                              np.random.default_rng(0)), old)  # fmt: skip


def test_loss_top_keeps_the_models_most_probable_tokens():
    """--loss-top K: the target keeps the model's K most probable tokens at their
    probabilities (not renormalised) and zeroes the rest; 0 keeps the whole distribution."""
    from train.eagle import top_only

    p = jax.nn.softmax(jax.random.normal(jax.random.key(0), (2, 3, 50)), -1)
    assert top_only(p, 0) is p
    for k in (1, 4):
        kept = np.asarray(top_only(p, k))
        assert ((kept > 0).sum(-1) == k).all()
        order = np.argsort(-np.asarray(p), -1)[..., :k]
        np.testing.assert_array_equal(np.take_along_axis(kept, order, -1),
                                      np.take_along_axis(np.asarray(p), order, -1))  # fmt: skip


def test_loss_top_beyond_the_draft_vocabulary_is_refused(tiny_ckpt, tmp_path):
    """--loss-top above the draft vocabulary's size: a one-line error before any answers
    are made."""
    import train.eagle as eagle
    from tests.conftest import tiny_training_args, train_on_made_up_conversations

    args = [*tiny_training_args(tiny_ckpt[0], tmp_path), "--guess-vocab", "64",
            "--loss-top", "65"]  # fmt: skip
    with pytest.raises(JaxspecError, match="--loss-top 65 is more tokens than the draft "
                                           "vocabulary's 64"):  # fmt: skip
        train_on_made_up_conversations(eagle, args)
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").rglob("*.npz"))


def test_fused_features_take_low_middle_high_in_order(model):
    """fuse concatenates the states of layers (low, middle, high) in that order: the
    initial weights pass the high layer's state alone (EAGLE-1's feature)."""
    cfg, params = model.cfg, model.params
    drafter = EagleDrafter(cfg, (1, 2, 2))  # the tiny model's 2 layers: low 1, mid and high 2
    states = {n: jax.random.normal(jax.random.key(n), (2, 3, cfg.dim)) for n in (1, 2)}
    fused = drafter.fuse(drafter.init(params), states)
    np.testing.assert_allclose(fused, states[2], rtol=1e-6, atol=1e-6)
    # each layer's block of the fuse weights reads that layer's state
    dp = drafter.init(params)
    D = cfg.dim
    for i, n in enumerate(drafter.layers):
        w = jnp.zeros((3 * D, D)).at[i * D : (i + 1) * D].set(jnp.eye(D))
        got = drafter.fuse({**dp, "fuse": {"w": w, "b": jnp.zeros(D)}}, states)
        np.testing.assert_allclose(got, states[n], rtol=1e-6, atol=1e-6)


def test_draft_vocabulary_guesses_are_the_models_ids(model):
    """With a draft vocabulary, the guesses are the model's token ids of the best rows
    among the vocabulary's (by hand: the full projection restricted to those ids), and
    their log probabilities normalised over the draft vocabulary."""
    from jaxspec.layers import rms_norm
    from jaxspec.llama import vocab_projection

    cfg, params = model.cfg, model.params
    drafter = EagleDrafter(cfg, (1, 1, 2), 3)
    ids = np.random.default_rng(0).choice(cfg.vocab_size, 20, replace=False)
    dp = drafter.prepare(params, trained_like(drafter, params), {"draft_vocab": ids})
    y = jax.random.normal(jax.random.key(4), (2, 3, cfg.dim))
    lp, tokens = drafter.guess_log_probs(params, dp, y, 4)
    full = vocab_projection(params, cfg, rms_norm(y, dp["norm"], cfg.norm_eps))[..., ids]
    want_lp, want = jax.lax.top_k(jax.nn.log_softmax(full, -1), 4)
    np.testing.assert_array_equal(tokens, ids[np.asarray(want)])
    np.testing.assert_allclose(lp, want_lp, rtol=1e-4, atol=1e-4)


def test_dynamic_tree_is_eagle2s_search_by_hand(model):
    """The search re-run by hand with the drafter along each path (each depth's k best
    nodes by path probability expand their top-k guesses, each entry at its own depth's
    position, attending to its own ancestors only): the tree's paths are of that search
    and are its N best (20 of its 21: each frontier node's own top-k guesses)."""
    from jaxspec.drafters.base import DraftInputs
    from jaxspec.tree import DynamicTree
    from tests.test_dynamic_tree import assert_the_n_best_of, beam_pool, chosen_paths

    cfg, params = model.cfg, model.params
    drafter, dp, tokens, p, st = drafter_after_prompt(model, seed=5)
    tree = DynamicTree(21, 3, 3)  # 20 of the 21 nodes scored: deep ones too
    draft = drafter.draft_dynamic(params, dp, DraftInputs({}, tokens[:, p], jnp.array([p]),
                                                          state=st), tree)  # fmt: skip

    @jax.jit
    def entry(t, feature, d, ks, vs):  # a path's entry at depth d, all before it its ancestors
        above = jnp.ones((1, 1, ks.shape[2]), bool)
        return drafter.expand(params, dp, st, jnp.array([p]), t, feature, d, above, ks, vs)

    def log_probs(path):  # the drafter's log probabilities after a path, entries 1..len
        feature = st.newest[:, None]
        ks = vs = jnp.zeros((1, drafter.kv_heads, 0, cfg.head_dim))
        for d, t in enumerate(path, start=1):
            y, k, v = entry(jnp.array([[t]]), feature, jnp.array([[d]]), ks, vs)
            feature, ks, vs = y, jnp.concatenate([ks, k], 2), jnp.concatenate([vs, v], 2)
        return np.asarray(jax.nn.log_softmax(drafter.logits(params, dp, feature[0, 0])))

    pool = beam_pool(log_probs, 3, 3)
    assert_the_n_best_of(pool, chosen_paths(draft, 0), 20, 1e-4)
