"""Self-distillation data: cached answers and features are resumed and reused, never made
twice, and reuse gives what a fresh run gives."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.models import load_model
from jaxspec.text import encode_conversation, encode_prompt
from tests.test_medusa import conversations
from train.features import answer_features, extract_sequences, layer_features
from train.selfdata import (
    GROUNDED,
    MIN_TEXT_CHARS,
    answers_by_prompt,
    dataset_replies,
    every_turn_prompts,
    first_turn_prompts,
    generate_answers,
    grounded_prompts,
    later_turn_prompts,
    prompt_set,
)

SETTINGS = {"prompt_len": 40, "new_tokens": 6, "batch": 2}


@pytest.fixture(autouse=True)
def bucketed(monkeypatch):
    """Answers in bucketed shapes, as on a CPU, whatever the backend (one_shape: its test)."""
    monkeypatch.setattr("train.selfdata.compiles_are_slow", lambda: False)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt[0])


@pytest.fixture
def generated(monkeypatch):
    """The prompts each generate_batch call receives, in order."""
    calls = []
    original = SpeculativeGenerator.generate_batch

    def recording(self, prompts, *args, **kw):
        calls.append([list(p) for p in prompts])
        return original(self, prompts, *args, **kw)

    monkeypatch.setattr(SpeculativeGenerator, "generate_batch", recording)
    return calls


def batches_computed(monkeypatch, module, name: str) -> list[int]:
    """The row count of each batch module.name (a jitted features function) computes from
    now on."""
    calls, original = [], getattr(module, name)

    def counting(params, tokens, **kw):
        calls.append(tokens.shape[0])
        return original(params, tokens, **kw)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_answers_for_more_prompts_reuse_a_smaller_cache(model, tmp_path, generated):
    data = conversations(seed=3)
    fresh = generate_answers(model, data, 7, tmp_path / "fresh-7.npz", **SETTINGS)
    small = generate_answers(model, data, 4, tmp_path / "small-4.npz", **SETTINGS)
    generated.clear()
    grown = generate_answers(
        model, data, 7, tmp_path / "grown-7.npz", reuse=[tmp_path / "small-4.npz"], **SETTINGS
    )
    made = [p for call in generated for p in call]
    small_prompts = {tuple(t[:s]) for t, s in zip(small["tokens"], small["starts"], strict=True)}
    assert len(made) == 3 and not small_prompts & {tuple(p) for p in made}
    for key in ("tokens", "lengths", "starts"):
        np.testing.assert_array_equal(grown[key], fresh[key])
    generated.clear()  # a finished file is read, not made again
    again = generate_answers(model, data, 7, tmp_path / "fresh-7.npz", **SETTINGS)
    assert generated == [] and again["tokens"].tolist() == fresh["tokens"].tolist()


def test_a_repeated_prompt_is_answered_once(model, tmp_path, generated):
    data = conversations(seed=6)
    data.insert(3, {**data[1], "id": "repeat"})
    answers = generate_answers(model, data, 5, tmp_path / "answers.npz", **SETTINGS)
    made = [tuple(p) for call in generated for p in call]
    assert len(made) == len(set(made)) == 4
    rows = [tuple(t[:n]) for t, n in zip(answers["tokens"], answers["lengths"], strict=True)]
    assert len(rows) == 5 and len(set(rows)) == 4


def test_interrupted_answers_resume_without_regenerating(model, tmp_path, generated):
    data, out = conversations(seed=4), tmp_path / "answers.npz"
    original = SpeculativeGenerator.generate_batch

    def interrupt_after_one_batch(self, prompts, *args, **kw):
        if generated:
            raise KeyboardInterrupt
        return original(self, prompts, *args, **kw)  # the recorder

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpeculativeGenerator, "generate_batch", interrupt_after_one_batch)
        with pytest.raises(KeyboardInterrupt):
            generate_answers(model, data, 5, out, **SETTINGS)
    assert out.with_suffix(".partial.npz").is_file() and not out.is_file()
    generated.clear()
    resumed = generate_answers(model, data, 5, out, **SETTINGS)
    assert [len(call) for call in generated] == [2, 1]  # batches 2 and 3 of 2 + 2 + 1
    fresh = generate_answers(model, data, 5, tmp_path / "fresh.npz", **SETTINGS)
    np.testing.assert_array_equal(resumed["tokens"], fresh["tokens"])
    assert not out.with_suffix(".partial.npz").exists()


def compiles_counted(monkeypatch) -> list[int]:
    """One entry per program set SpeculativeGenerator compiles from now on."""
    calls, original = [], SpeculativeGenerator.lowerings

    def counting(self, *args, **kw):
        calls.append(1)
        return original(self, *args, **kw)

    monkeypatch.setattr(SpeculativeGenerator, "lowerings", counting)
    return calls


def test_answers_in_one_shape_compile_once_and_are_the_same(model, tmp_path, generated,
                                                            monkeypatch):  # fmt: skip
    """one_shape (where compiles are slow): every batch padded to `batch` prompts of
    prompt_len tokens compiles one program set where the sorted prompts pass through several
    (prompt bucket, batch size) shapes, and the answers are the bucketed run's."""
    rng = np.random.default_rng(1)
    data = [
        {"id": str(i), "conversations": [
            {"from": "human", "value": " ".join(f"w{j}" for j in rng.integers(5, 101, k))},
            {"from": "gpt", "value": "w5"},
        ]}
        for i, k in enumerate([23, 2, 16, 4, 11, 7])
    ]  # fmt: skip
    settings = {"prompt_len": 64, "new_tokens": 6, "batch": 4}
    compiles = compiles_counted(monkeypatch)
    bucketed = generate_answers(model, data, 6, tmp_path / "b.npz", one_shape=False, **settings)
    assert len(compiles) >= 2 and [len(call) for call in generated] == [4, 2]
    lengths = [len(p) for call in generated for p in call]
    assert lengths == sorted(lengths)  # batched shortest first: less padding, fewer shapes
    compiles.clear(), generated.clear()
    one = generate_answers(model, data, 6, tmp_path / "o.npz", one_shape=True, **settings)
    assert len(compiles) == 1 and [len(call) for call in generated] == [4, 4]
    for key in ("tokens", "lengths", "starts"):
        np.testing.assert_array_equal(one[key], bucketed[key])


def test_features_reuse_rows_of_another_file(model, tmp_path, monkeypatch):
    import train.features as features

    answers = generate_answers(model, conversations(seed=5), 6, tmp_path / "a.npz", **SETTINGS)
    first_four = {k: v[:4] for k, v in answers.items()}
    extract_sequences(model, first_four, tmp_path / "features-4.npz", batch=2)
    fresh = extract_sequences(model, answers, tmp_path / "features-6.npz", batch=2)

    rows_computed = batches_computed(monkeypatch, features, "_features")
    reused = extract_sequences(
        model, answers, tmp_path / "grown.npz", batch=2, reuse=[tmp_path / "features-4.npz"]
    )
    assert rows_computed == [2]  # only rows 5 and 6
    np.testing.assert_array_equal(reused["predicted"], fresh["predicted"])
    np.testing.assert_allclose(
        reused["hidden"].astype(np.float32), fresh["hidden"].astype(np.float32), atol=1e-2
    )


def test_layer_states_reuse_rows_of_a_smaller_count(model, tmp_path, monkeypatch):
    """The EAGLE trainer's states for more prompts copy the rows a cache for fewer holds."""
    import train.features as features

    data, p, n = conversations(seed=7), SETTINGS["prompt_len"], SETTINGS["new_tokens"]
    grown, fresh = tmp_path / "grown", tmp_path / "fresh"
    for root, counts in ((grown, (4, 6)), (fresh, (6,))):
        for k in counts:
            generate_answers(model, data, k, root / f"self-train-{k}-p{p}-n{n}.npz", **SETTINGS)
    layer_features(model, grown, "train", 4, p, n, (1,), batch=2)
    expected = layer_features(model, fresh, "train", 6, p, n, (1,), batch=2)

    rows_computed = batches_computed(monkeypatch, features, "layer_states")
    reused = layer_features(model, grown, "train", 6, p, n, (1,), batch=2)
    assert rows_computed == [2]  # the two prompts the 4-prompt cache lacks
    np.testing.assert_array_equal(reused["layers"], expected["layers"])
    np.testing.assert_array_equal(reused["predicted"], expected["predicted"])
    np.testing.assert_allclose(
        reused["states"].astype(np.float32), expected["states"].astype(np.float32), atol=1e-2
    )


def test_features_copy_the_last_layer_of_layer_states(model, tmp_path, monkeypatch):
    """Medusa/Chimera features for prompts the EAGLE trainer's states cover are not computed
    again: the states' last layer is the features' hidden state."""
    import train.features as features

    data, p, n = conversations(seed=8), SETTINGS["prompt_len"], SETTINGS["new_tokens"]
    for root in (tmp_path / "shared", tmp_path / "fresh"):
        generate_answers(model, data, 5, root / f"self-train-5-p{p}-n{n}.npz", **SETTINGS)
    layer_features(model, tmp_path / "shared", "train", 5, p, n, (1,), batch=2)
    expected = answer_features(model, tmp_path / "fresh", "train", 5, p, n)
    rows_computed = batches_computed(monkeypatch, features, "_features")
    copied = answer_features(model, tmp_path / "shared", "train", 5, p, n)
    assert rows_computed == []  # every row copied
    np.testing.assert_array_equal(copied["predicted"], expected["predicted"])
    np.testing.assert_allclose(
        copied["hidden"].astype(np.float32), expected["hidden"].astype(np.float32), atol=1e-2
    )


def test_every_turn_prompts_hold_the_turns_before_them(model, tmp_path, generated, monkeypatch):
    """turns "every": each user turn with the turns before it (a conversation's first turn
    gives first_turn_prompts' ids), stopping at the first one over prompt_len; answers to
    prompts a first-turn cache, or a cache made with another prompt bound, holds are reused,
    not generated again."""
    import train.features as features

    tok = model.tokenizer
    chat = [{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w7 w8"},
            {"from": "human", "value": " w9 "}, {"from": "gpt", "value": "w10"},
            {"from": "human", "value": " ".join(["w11"] * 40)}, {"from": "gpt", "value": "w12"},
            {"from": "human", "value": "w13"}]  # fmt: skip
    talks = [{"id": "a", "conversations": chat},
             {"id": "b", "conversations": [{"from": "gpt", "value": "w20"}]},
             {"id": "c", "conversations": [{"from": "human", "value": "w21"}]}]  # fmt: skip
    got = every_turn_prompts(tok, talks, 10, 40)
    messages = [{"role": r, "content": c} for r, c in
                (("user", "w5 w6"), ("assistant", "w7 w8"), ("user", "w9"))]  # fmt: skip
    first = first_turn_prompts(tok, talks, 10, 40)
    assert got == [first[0], encode_conversation(tok, messages), first[1]]
    n = len(first[0])  # a prompt of exactly max_len tokens is kept
    assert first_turn_prompts(tok, talks[:1], 1, n) == first[:1]
    assert first_turn_prompts(tok, talks[:1], 1, n - 1) == []
    assert every_turn_prompts(tok, talks, 2, 40) == got[:2]
    assert len(every_turn_prompts(tok, talks, 10, 1000)) == 5  # the long turn and the next

    monkeypatch.setattr(features, "sharegpt_split", lambda split: talks)
    kw = {"prompt_len": 40, "new_tokens": 6}
    features.self_answers(model, tmp_path, "train", 2, **kw)  # first turns: a and c
    generated.clear()
    data = features.self_answers(model, tmp_path, "train", 3, **kw, turns="every")
    assert generated == [[got[1]]]  # only the new prompt was answered
    assert (tmp_path / "self-every-train-3-p40-n6.npz").is_file()
    assert sorted(data["starts"].tolist()) == sorted(len(p) for p in got)

    generated.clear()  # a longer prompt bound reuses the shorter bound's answers
    longer = features.self_answers(model, tmp_path, "train", 5, prompt_len=1000, new_tokens=6,
                                   turns="every")  # fmt: skip
    new_prompts = [p for p in every_turn_prompts(tok, talks, 5, 1000) if p not in got]
    assert len(new_prompts) == 2 and sorted(sum(generated, [])) == sorted(new_prompts)
    reused = answers_by_prompt(longer)
    for prompt, answer in answers_by_prompt(data).items():
        assert reused[prompt] == answer

    # turns "later": every turn but a conversation's first, answers reused from the above
    everything, firsts = (
        every_turn_prompts(tok, talks, 10, 1000),
        first_turn_prompts(tok, talks, 10, 1000),
    )
    later = later_turn_prompts(tok, talks, 10, 1000)
    assert later == [p for p in everything if p not in firsts] and len(later) == 3
    generated.clear()
    data = features.self_answers(model, tmp_path, "train", 3, prompt_len=1000, new_tokens=6,
                                 turns="later")  # fmt: skip
    assert generated == [] and (tmp_path / "self-later-train-3-p1000-n6.npz").is_file()
    assert answers_by_prompt(data) == {tuple(p): reused[tuple(p)] for p in later}


def test_skipped_prompts_are_left_out_of_the_answers(model, tmp_path, generated, monkeypatch):
    """skip "TURNS:N:LEN": the prompts among the first N TURNS prompts of <= LEN tokens (a
    drafter's training prompts) are neither answered nor in the file, which a name of its
    own keeps apart and a rerun loads without reading ShareGPT."""
    import train.features as features

    tok = model.tokenizer
    chat = [{"from": "human", "value": "w5"}, {"from": "gpt", "value": "w7"},
            {"from": "human", "value": "w9"}]  # fmt: skip
    talks = [{"id": "a", "conversations": chat},
             {"id": "b", "conversations": [{"from": "human", "value": "w21 w22 w23"}]},
             {"id": "c", "conversations": [{"from": "human", "value": "w24"}]}]  # fmt: skip
    every = every_turn_prompts(tok, talks, 10, 40)  # a's two turns, b, c
    shortest = min(len(p) for p in first_turn_prompts(tok, talks, 10, 40))
    known = first_turn_prompts(tok, talks, 2, shortest)  # the first two this short: a and c
    assert len(every) == 4 and known == [every[0], every[3]]
    monkeypatch.setattr(features, "sharegpt_split", lambda split: talks)
    skip = f"first:2:{shortest}"
    data = features.self_answers(model, tmp_path, "train", 4, prompt_len=40, new_tokens=6,
                                 turns="every", skip=skip)  # fmt: skip
    kept = [p for p in every if p not in known]
    assert len(kept) == 2 and sorted(sum(generated, [])) == sorted(kept)
    assert sorted(answers_by_prompt(data)) == sorted(map(tuple, kept))
    name = f"self-every-train-4-less-first-2-p{shortest}-p40-n6.npz"
    assert (tmp_path / name).is_file() and not (tmp_path / "self-every-train-4-p40-n6.npz").exists()

    with pytest.raises(JaxspecError, match="first:10:40 leaves out all 2 train prompts"):
        features.self_answers(model, tmp_path, "train", 2, prompt_len=40, new_tokens=6,
                              skip="first:10:40")  # fmt: skip

    monkeypatch.setattr(features, "sharegpt_split", lambda split: pytest.fail("read ShareGPT"))
    again = features.self_answers(model, tmp_path, "train", 4, prompt_len=40, new_tokens=6,
                                  turns="every", skip=skip)  # fmt: skip
    assert answers_by_prompt(again) == answers_by_prompt(data)
    with pytest.raises(ValueError, match="takes TURNS:N:LEN"):
        prompt_set("first:2")


def test_dataset_replies_follow_their_prompts(model):
    """dataset_replies: each user turn (the first, or every one) with the conversation's own
    reply after it, cut after its first end token and at new_tokens; a turn with no reply
    is left out; n replies at most."""
    tok, eos = model.tokenizer, tuple(model.cfg.eos_token_ids)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    chat = [{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w7 </s> w8"},
            {"from": "human", "value": "w9"}, {"from": "gpt", "value": " ".join(["w10"] * 30)},
            {"from": "human", "value": "w13"}]  # fmt: skip
    talks = [{"id": "a", "conversations": chat},
             {"id": "b", "conversations": [{"from": "human", "value": "w21"},
                                           {"from": "gpt", "value": "w22"}]}]  # fmt: skip
    every = dataset_replies(tok, talks, 10, 100, 6, "every", eos)
    first = dataset_replies(tok, talks, 10, 100, 6, "first", eos)
    prompts = every_turn_prompts(tok, talks, 10, 100)  # a's three turns, then b's
    assert every["tokens"].shape == (3, 106) and first["tokens"].shape == (2, 106)
    replies = []
    for n, prompt in enumerate(prompts[i] for i in (0, 1, 3)):
        start, end = every["starts"][n], every["lengths"][n]
        assert every["tokens"][n, :start].tolist() == prompt
        replies.append(every["tokens"][n, start:end].tolist())
    assert replies[0] == ids("w7 </s>")
    assert replies[1] == ids("w10") * 6
    assert replies[2][: len(ids("w22"))] == ids("w22")
    assert first["tokens"].tolist() == every["tokens"][[0, 2]].tolist()
    later = dataset_replies(tok, talks, 10, 100, 6, "later", eos)  # w13 has no reply
    assert later["tokens"].tolist() == every["tokens"][[1]].tolist()
    assert dataset_replies(tok, talks, 2, 100, 6, "every", eos)["tokens"].tolist() == (
        every["tokens"][:2].tolist()
    )


def test_grounded_prompts_hand_back_the_first_reply(model, tmp_path, generated, monkeypatch):
    """turns "grounded": prompt i is GROUNDED[i % 4] around a conversation's reply to its
    first user turn, that turn the question; replies under MIN_TEXT_CHARS, unanswered first
    turns, conversations opening with another role and prompts over max_len are left out
    (and take no template's turn); answered as the other kinds are, cached under their name."""
    import train.features as features

    tok = model.tokenizer
    text = lambda word, n: " ".join([word] * n)  # noqa: E731
    long, short = text("w30", MIN_TEXT_CHARS // 3), text("w31", MIN_TEXT_CHARS // 4 - 1)
    assert len(long) >= MIN_TEXT_CHARS > len(short)
    chat = lambda q, a: [{"from": "human", "value": q}, {"from": "gpt", "value": a}]  # noqa: E731
    talks = [
        {"id": "a", "conversations": chat("w5 w6", long)},
        {"id": "b", "conversations": chat("w7", short)},  # too short to work from
        {"id": "c", "conversations": [{"from": "gpt", "value": long}]},  # no user turn first
        {"id": "d", "conversations": [{"from": "human", "value": "w8"}]},  # no reply
        {"id": "e", "conversations": chat("w9", text("w32", 200))},  # over max_len
        {"id": "f", "conversations": chat("w10", long + " w33")},
        {"id": "g", "conversations": chat("w11", long + " w34")},
    ]
    expected = [encode_prompt(tok, GROUNDED[i].format(text=reply, question=question))
                for i, (question, reply) in enumerate(
                    [("w5 w6", long), ("w10", long + " w33"), ("w11", long + " w34")])]  # fmt: skip
    assert all(len(p) <= 150 for p in expected)
    assert grounded_prompts(tok, talks, 10, 150) == expected
    assert grounded_prompts(tok, talks, 2, 150) == expected[:2]
    assert len(grounded_prompts(tok, talks, 10, 1000)) == 4  # e fits: f and g move on a template
    edge = text("w36", MIN_TEXT_CHARS // 4) + "7"  # MIN_TEXT_CHARS characters, then one less
    for reply, kept in ((edge, 1), (edge[:-1], 0)):
        talk = {"id": "h", "conversations": chat("w12", reply)}
        assert len(grounded_prompts(tok, [talk], 1, 1000)) == kept

    monkeypatch.setattr(features, "sharegpt_split", lambda split: talks)
    data = features.self_answers(model, tmp_path, "train", 3, prompt_len=150, new_tokens=6,
                                 turns="grounded")  # fmt: skip
    assert (tmp_path / "self-grounded-train-3-p150-n6.npz").is_file()
    assert sorted(map(len, generated[0])) == sorted(map(len, expected))
    assert sorted(answers_by_prompt(data)) == sorted(map(tuple, expected))
