"""Prompts the model writes itself (train/written.py): the user turns it closed, kept once
each, resumed from their cache, and trained on by `jaxspec-train eagle --turns written`."""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.models import load_model
from jaxspec.text import encode_prompt
from train.written import user_opening, written_prompts

LEN = 16  # --prompt-len: a 15-token writing budget after the tiny template's opening "user"


@pytest.fixture(scope="module")
def chatty_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with 11 end tokens (</s> w5 .. w14): a random model that closes
    most of the user turns it writes within a short budget."""
    folder = tmp_path_factory.mktemp("chatty") / "jaxspec"
    shutil.copytree(tiny_ckpt[0], folder)
    config = json.loads((folder / "jaxspec.json").read_text())
    (folder / "jaxspec.json").write_text(
        json.dumps({**config, "eos_token_ids": [2, *range(5, 15)]})
    )
    return folder


@pytest.fixture(scope="module")
def model(chatty_ckpt):
    return load_model(chatty_ckpt)


@pytest.fixture
def written(monkeypatch):
    """(seed, the token ids of each row) of every batch the model writes, in order."""
    calls = []
    original = SpeculativeGenerator.generate_batch

    def recording(self, prompts, max_new_tokens, seed=0, *args):
        results = original(self, prompts, max_new_tokens, seed, *args)
        calls.append((seed, [r.token_ids for r in results]))
        return results

    monkeypatch.setattr(SpeculativeGenerator, "generate_batch", recording)
    return calls


def test_written_prompts_are_the_user_turns_the_model_closed(model, tmp_path, written):
    """Rows that end with an end token become chat-templated prompts of their text, each
    once and at most --prompt-len tokens; rows cut off by the budget are dropped."""
    prompts = written_prompts(model, tmp_path / "w.npz", 6, LEN, batch=8, seed=4)
    tok, eos = model.tokenizer, set(model.cfg.eos_token_ids)
    rows = [ids for _, batch in written for ids in batch]
    closed = [ids for ids in rows if ids and ids[-1] in eos]
    assert 0 < len(closed) < len(rows)  # the budget cut some rows off
    expected = []
    for ids in closed:
        text = tok.decode(ids[:-1], skip_special_tokens=True).strip()
        prompt = encode_prompt(tok, text) if text else None
        if prompt and len(prompt) <= LEN and prompt not in expected:
            expected.append(prompt)
    assert prompts == expected[:6] and len(prompts) == 6
    assert [seed for seed, _ in written] == list(range(4, 4 + len(written)))
    opening = user_opening(tok)
    assert all(p[: len(opening)] == opening for p in prompts)


def test_more_written_prompts_go_on_from_the_cache(model, tmp_path, written):
    """Asking for more prompts writes only the batches after those already written (an
    interrupted run likewise), and gives the prompts a fresh run gives."""
    few = written_prompts(model, tmp_path / "grown.npz", 2, LEN, batch=8)
    first_batches = len(written)
    grown = written_prompts(model, tmp_path / "grown.npz", 9, LEN, batch=8)
    seeds = [seed for seed, _ in written]
    assert seeds == list(range(len(seeds)))  # no batch written twice
    assert len(seeds) > first_batches
    written.clear()
    fresh = written_prompts(model, tmp_path / "fresh.npz", 9, LEN, batch=8)
    assert grown == fresh and grown[:2] == few
    assert written_prompts(model, tmp_path / "fresh.npz", 4, LEN, batch=8) == fresh[:4]
    assert len(written) == len(seeds)  # the last call read its cache only


def test_written_prompts_need_a_chat_template_and_room(model, tiny_ckpt, tmp_path):
    plain = copy.copy(model)
    plain.tokenizer = copy.deepcopy(model.tokenizer)
    plain.tokenizer.chat_template = None
    with pytest.raises(JaxspecError, match="no chat template") as e:
        written_prompts(plain, tmp_path / "w.npz", 2, LEN)
    assert "\n" not in str(e.value)
    with pytest.raises(JaxspecError, match="--prompt-len 1 leaves no room"):
        written_prompts(model, tmp_path / "w.npz", 2, 1)
    mute = load_model(tiny_ckpt[0])  # one end token: it rarely closes a turn
    with pytest.raises(JaxspecError, match="closed only .* usable user turns in 20 batches"):
        written_prompts(mute, tmp_path / "mute.npz", 50, LEN, batch=2)


@pytest.mark.slow  # a non-default training path (~30 s): the fast set keeps its parts
def test_eagle_trains_on_prompts_the_model_wrote(chatty_ckpt, model, tmp_path, capsys):
    """`jaxspec-train eagle --turns written`: the answers are the model's own to the prompts
    it wrote (train split's stream, cached), the card says so; ShareGPT's replies need
    ShareGPT's own prompts (not written or grounded ones)."""
    import train.eagle as eagle
    from tests.conftest import one_line_error, tiny_training_args, train_on_made_up_conversations
    from train.cli import main
    from train.features import WRITTEN_SEEDS

    args = [*tiny_training_args(chatty_ckpt, tmp_path, prompt_len=LEN, answer_batch=8),
            "--rows", "6", "--ttt", "2", "--depth", "2", "--guess-vocab", "30", "--steps", "2",
            "--turns", "written", "--states", "live"]  # fmt: skip
    (report,) = train_on_made_up_conversations(eagle, args)
    assert report["steps"] == 2
    work = tmp_path / "work"
    (answers,) = work.rglob("self-written-train-8-p16-n24.npz")
    (cache,) = work.rglob("written-train-p16-b8.npz")
    prompts = written_prompts(model, cache, 8, LEN, 8, WRITTEN_SEEDS["train"])
    data = np.load(answers)
    got = [row[:start].tolist() for row, start in zip(data["tokens"], data["starts"], strict=True)]
    assert sorted(got) == sorted(prompts)
    assert "user turns the model wrote itself" in (tmp_path / "out/CARD.md").read_text()
    wrong = [*args[:-2], "--answers", "sharegpt", "--overwrite"]
    err = one_line_error(main, ["eagle", *wrong], capsys)
    assert "--answers sharegpt trains on ShareGPT's replies to its own prompts" in err
    grounded = [*args[:-4], "--turns", "grounded", "--answers", "sharegpt", "--overwrite"]
    assert "--turns grounded does not use" in one_line_error(main, ["eagle", *grounded], capsys)


def test_rows_kept_once_within_max_len_and_giving_up(model, tmp_path, monkeypatch):
    """Batches of known rows (batch i: a text of exactly --prompt-len tokens templated, one
    a token longer, a new text twice unless i % 7 == 0, an unclosed row): each closed text
    is kept once, at most --prompt-len tokens; under one kept prompt a batch after 20
    batches is an error."""
    tok, end = model.tokenizer, model.cfg.eos_token_ids[0]
    words = lambda k: " ".join(["w30"] * k)  # noqa: E731
    k = next(k for k in range(1, LEN) if len(encode_prompt(tok, words(k))) == LEN)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731

    def batch(self, prompts, max_new_tokens, seed=0, *args):
        new = [] if seed % 7 == 0 else [ids(f"w{20 + seed}") + [end]] * 2
        rows = [ids(words(k)) + [end], ids(words(k + 1)) + [end], *new, ids("w60")]
        return [SimpleNamespace(token_ids=r) for r in rows]

    monkeypatch.setattr(SpeculativeGenerator, "generate_batch", batch)
    got = written_prompts(model, tmp_path / "w.npz", 4, LEN)
    assert got == [encode_prompt(tok, t) for t in (words(k), "w21", "w22", "w23")]
    with pytest.raises(JaxspecError, match="closed only 18 usable user turns in 20 batches"):
        written_prompts(model, tmp_path / "few.npz", 25, LEN)
