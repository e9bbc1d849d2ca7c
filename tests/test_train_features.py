"""The frozen base model's features for training (train/features.py): the states and greedy
tokens are the model's own forward pass, at the right rows, layers and positions."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train.features as features
from jaxspec.config import preset
from jaxspec.llama import forward, init_params
from jaxspec.outputs import save_npz
from train.features import (
    conversation_ids,
    extract,
    extract_sequences,
    self_answers,
    with_states,
)

CFG = preset("tiny-gqa")  # 3 layers


class WordTokenizer:
    """A chat template that joins the turns' texts; each word is a token id."""

    def apply_chat_template(self, messages, tokenize=False):
        return " ".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [int(word) for word in text.split()]


def tiny_model(seed: int = 0) -> SimpleNamespace:
    params = init_params(CFG, jax.random.PRNGKey(seed), scale=0.2)
    return SimpleNamespace(cfg=CFG, params=params, tokenizer=WordTokenizer())


def forward_pass(model, tokens) -> list[tuple[dict[int, np.ndarray], np.ndarray]]:
    """Per row of tokens [N,T]: its states after every layer [T,D] and its greedy next
    tokens [T], from one causal forward pass of the model."""
    (N, T), layers = tokens.shape, tuple(range(1, CFG.n_layers + 1))
    causal = np.broadcast_to(np.tril(np.ones((T, T), bool)), (N, T, T))
    pass_ = jax.jit(lambda p, x, m: forward(p, CFG, x, jnp.broadcast_to(jnp.arange(T), (N, T)),
                                            None, m, collect=layers))  # fmt: skip
    logits, _, states = pass_(model.params, tokens, causal)
    greedy = np.asarray(logits).argmax(-1)
    return [({n: np.asarray(states[n][i]) for n in layers}, greedy[i]) for i in range(N)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def rows(model):
    """Three 7-token rows and their forward passes."""
    tokens = np.random.default_rng(0).integers(1, CFG.vocab_size, (3, 7)).astype(np.int32)
    return tokens, forward_pass(model, tokens)


def assert_features(got: dict, expected: list) -> None:
    for i, (states, greedy) in enumerate(expected):
        np.testing.assert_array_equal(got["predicted"][i], greedy)
        np.testing.assert_allclose(got["hidden"][i].astype(np.float32),
                                   states[CFG.n_layers], rtol=1e-2, atol=1e-2)  # fmt: skip


def test_features_are_the_last_pre_norm_states_and_greedy_tokens(model, rows, tmp_path):
    tokens, expected = rows
    assert len({tuple(g) for _, g in expected}) > 1  # the greedy tokens tell rows apart
    data = {"tokens": tokens, "lengths": np.full(3, 7, np.int32)}
    got = extract_sequences(model, data, tmp_path / "f.npz", batch=2)  # last batch padded
    assert got["hidden"].dtype == np.float16
    assert_features(got, expected)


def test_reused_rows_are_matched_by_their_tokens(model, rows, tmp_path):
    tokens, expected = rows
    lengths = np.full(3, 7, np.int32)
    old = tmp_path / "old.npz"
    extract_sequences(model, {"tokens": tokens[[2, 0]], "lengths": lengths[:2]}, old, batch=2)
    got = extract_sequences(model, {"tokens": tokens, "lengths": lengths}, tmp_path / "new.npz",
                            batch=2, reuse=[old])  # fmt: skip
    assert_features(got, expected)


def test_a_features_file_is_read_not_computed_again(rows, tmp_path):
    tokens, expected = rows
    data = {"tokens": tokens, "lengths": np.full(3, 7, np.int32)}
    extract_sequences(tiny_model(), data, tmp_path / "f.npz", batch=2)
    again = extract_sequences(tiny_model(seed=1), data, tmp_path / "f.npz", batch=2)
    assert_features(again, expected)  # the first model's features


def test_with_states_keeps_each_layer_and_the_last_layers_greedy_token(model, rows):
    tokens, expected = rows
    layers = features.stored_layers(CFG, (1,))
    assert layers == (1, 3)
    got = with_states(model, {"tokens": tokens}, layers, batch=2)
    np.testing.assert_array_equal(got["layers"], [1, 3])
    for i, (states, greedy) in enumerate(expected):
        np.testing.assert_array_equal(got["predicted"][i], greedy)
        for j, n in enumerate(layers):
            np.testing.assert_allclose(got["states"][i, :, j].astype(np.float32), states[n],
                                       rtol=1e-2, atol=1e-2)  # fmt: skip


def chat(*turns: tuple[str, int]) -> dict:
    """A ShareGPT record: (from, token count) per turn, tokens counting up from 1."""
    out, next_id = [], 1
    for who, n in turns:
        out.append({"from": who, "value": " ".join(map(str, range(next_id, next_id + n)))})
        next_id += n
    return {"conversations": out}


def test_conversation_ids_keep_user_first_chats_of_16_tokens_or_more():
    tok = WordTokenizer()
    assert conversation_ids(tok, chat(("human", 10), ("gpt", 6)), 20) == list(range(1, 17))
    assert conversation_ids(tok, chat(("human", 10), ("gpt", 5)), 20) is None  # 15 tokens
    assert conversation_ids(tok, chat(("human", 10), ("gpt", 30)), 18) == list(range(1, 19))
    assert conversation_ids(tok, chat(("gpt", 10), ("human", 30)), 20) is None  # not user first
    assert conversation_ids(tok, chat(("human", 10), ("system", 30)), 20) is None


def test_extract_packs_the_first_n_usable_conversations(model, tmp_path):
    chats = [chat(("human", 10), ("gpt", 2)), chat(("human", 10), ("gpt", 8)),
             chat(("human", 20), ("gpt", 8)), chat(("human", 9), ("gpt", 9))]  # fmt: skip
    got = extract(model, chats, 2, 24, tmp_path / "f.npz", batch=2)
    np.testing.assert_array_equal(got["lengths"], [18, 24])
    np.testing.assert_array_equal(got["tokens"][0], [*range(1, 19), 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got["tokens"][1], range(1, 25))


def test_cached_answers_are_read_without_sharegpt(tmp_path, monkeypatch):
    def no_sharegpt(split):
        raise AssertionError("ShareGPT read")

    monkeypatch.setattr(features, "sharegpt_split", no_sharegpt)
    cached = {"tokens": np.arange(6).reshape(2, 3), "lengths": np.array([3, 2])}
    save_npz(tmp_path / "self-train-2-p40-n6.npz", cached)
    got = self_answers(None, tmp_path, "train", 2, prompt_len=40, new_tokens=6)
    np.testing.assert_array_equal(got["tokens"], cached["tokens"])
