"""Self-distillation data: the base model's own greedy answers to ShareGPT prompts.

Drafters guess what the model will write, and a small model writes very differently from
the ChatGPT answers in ShareGPT, so drafters train best on the model's own text (Medusa-2's
self-distillation). Each record is [chat-templated prompt ; greedy answer]; `starts` marks
where the answer begins. A prompt is a conversation's first user turn, or (turns "every")
each of its user turns with the conversation before it, ChatGPT's answers as written (turns
"later": every turn but the first, the prompts a first-turn drafter has not seen): the
ShareGPT package's train split holds ~7.5k first turns of <= 128 tokens; counting every
turn, ~15k prompts of <= 512 tokens and ~23k of <= 1024 (from a sample of 3000
conversations). Turns "grounded": prompts that hand the model a text to work from, as
summarisation and retrieval-augmented questions do (a conversation's first reply, with a
request to summarise it or to answer the first turn from it: `grounded_prompts`). Turns
"written": prompts the model writes itself (train/written.py), passed to generate_answers
as token ids. Batched generation (in one program shape where compiles
are slow: an accelerator); progress is saved after every batch and an interrupted run
resumes; answers already cached for other prompt counts are reused.
`dataset_replies` packs the conversations' own replies the same way (no generation).
Every file is written whole or not at all; a damaged one is an error naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxspec.compile_cache import compiles_are_slow
from jaxspec.data.sources import ROLES, first_user_turn, load_questions, select_questions
from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.outputs import load_npz, save_npz
from jaxspec.text import encode_conversation, encode_prompt, encode_reply

ANSWER_BATCH = 32  # prompts answered at once


def first_turn_prompts(tokenizer, conversations: Iterable[dict], n: int, max_len: int):
    """Token ids of the first n usable first user turns of at most max_len tokens."""
    prompts = []
    for conversation in conversations:
        text = first_user_turn(conversation)
        if not text:
            continue
        ids = encode_prompt(tokenizer, text)
        if len(ids) <= max_len:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def _user_turns(conversation: dict) -> Iterator[tuple[list[dict[str, str]], str | None]]:
    """-> (messages up to a user turn [{"role", "content"}], the assistant's reply to it or
    None) for each of the conversation's non-empty user turns in order, up to a turn of
    unknown role (none if it opens with another role)."""
    messages: list[dict[str, str]] = []
    turns = conversation.get("conversations") or []
    for i, turn in enumerate(turns):
        role, text = ROLES.get(turn.get("from")), turn.get("value", "").strip()
        if role is None or (not messages and role != "user"):
            return
        messages.append({"role": role, "content": text})
        if role == "user" and text:
            after = turns[i + 1] if i + 1 < len(turns) else {}
            answered = ROLES.get(after.get("from")) == "assistant"
            yield list(messages), (after.get("value", "").strip() if answered else "") or None


def _turns(tokenizer, conversations: Iterable[dict], max_len: int, turns: str):
    """-> (prompt ids, messages, the reply or None) of each `turns` user turn ("first",
    "every" or "later": every one but a conversation's first) with the conversation before
    it, of at most max_len tokens, in order."""
    for conversation in conversations:
        for i, (messages, reply) in enumerate(_user_turns(conversation)):
            ids = encode_conversation(tokenizer, messages)
            if len(ids) > max_len or (turns == "first" and i):
                break  # the turns after it are longer still (or not first)
            if i or turns != "later":
                yield ids, messages, reply


def every_turn_prompts(tokenizer, conversations: Iterable[dict], n: int, max_len: int):
    """Token ids of the first n usable user turns, each with the conversation before it, of
    at most max_len tokens (a conversation's first turn: first_turn_prompts' ids)."""
    return [ids for ids, _, _ in islice(_turns(tokenizer, conversations, max_len, "every"), n)]


def later_turn_prompts(tokenizer, conversations: Iterable[dict], n: int, max_len: int):
    """every_turn_prompts without the conversations' first turns: prompts that a drafter
    trained on first turns has not seen."""
    return [ids for ids, _, _ in islice(_turns(tokenizer, conversations, max_len, "later"), n)]


# Requests that hand the model a text (a conversation's first reply) to work from: answers
# that copy from the prompt, as in summarisation and retrieval-augmented questions.
GROUNDED = (
    "Summarize the following text.\n\n{text}",
    "{text}\n\nBased on the text above: {question}",
    "Read this passage and list its main points.\n\n{text}",
    "Answer the question using the reference below.\n\nReference:\n{text}\n\nQuestion: {question}",
)
MIN_TEXT_CHARS = 200  # shorter replies are too little to summarise or look things up in


def grounded_prompts(tokenizer, conversations: Iterable[dict], n: int, max_len: int):
    """Token ids of the first n usable grounded prompts of at most max_len tokens: prompt i
    puts a conversation's reply to its first user turn (>= MIN_TEXT_CHARS characters) into
    GROUNDED[i % len(GROUNDED)], the turn as the question."""
    prompts = []
    for conversation in conversations:
        messages, reply = next(_user_turns(conversation), ([], None))
        if not reply or len(reply) < MIN_TEXT_CHARS:
            continue
        request = GROUNDED[len(prompts) % len(GROUNDED)]
        ids = encode_prompt(tokenizer, request.format(text=reply, question=messages[-1]["content"]))
        if len(ids) <= max_len:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


PROMPTS = {
    "first": first_turn_prompts,
    "every": every_turn_prompts,
    "later": later_turn_prompts,
    "grounded": grounded_prompts,
}
TURNS = (*PROMPTS, "written")  # written: prompts the model writes itself (train/written.py)


def prompt_set(text: str) -> tuple[str, int, int]:
    """TURNS:N:LEN text -> (turns, n, prompt_len): the first N ShareGPT prompts of a PROMPTS kind
    of <= LEN tokens, the set an answers cache holds (e.g. first:6400:128); bad text is a
    ValueError naming the form."""
    parts = text.split(":")
    counts = parts[1:] if len(parts) == 3 else []
    if parts[0] not in PROMPTS or not counts or not all(x.isdecimal() and int(x) for x in counts):
        raise ValueError(f"takes TURNS:N:LEN, TURNS one of {', '.join(PROMPTS)} and N, LEN "
                         f"integers >= 1, e.g. first:6400:128; got {text!r}")  # fmt: skip
    return parts[0], int(counts[0]), int(counts[1])


def dataset_replies(tokenizer, conversations: Iterable[dict], n: int, prompt_len: int,
                    new_tokens: int, turns: str, eos: tuple[int, ...]) -> dict:  # fmt: skip
    """The conversations' own replies, packed as generate_answers packs the model's:
    [prompt ; reply up to its first `eos` token, at most new_tokens] for the first n user
    turns of `turns` prompts (a key of PROMPTS) that have a reply (n counts replies, so the
    prompts are not quite those generate_answers takes for the same n)."""
    pairs = list(islice(_reply_pairs(tokenizer, conversations, prompt_len, turns), n))
    if not pairs:
        raise JaxspecError(
            f"no {turns}-turn prompt of <= {prompt_len} tokens with a reply the chat template "
            "renders after it: raise --prompt-len, or train on the model's own answers"
        )
    ends = [next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for _, r in pairs]
    cut = [(p, r[: min(end, new_tokens)]) for (p, r), end in zip(pairs, ends, strict=True)]
    return _pack(cut, prompt_len + new_tokens)


def _reply_pairs(tokenizer, conversations: Iterable[dict], prompt_len: int, turns: str):
    """-> (prompt ids, whole reply ids) of each `turns` prompt of <= prompt_len tokens with
    a reply, in order."""
    for prompt, messages, reply in _turns(tokenizer, conversations, prompt_len, turns):
        ids = encode_reply(tokenizer, messages, prompt, reply) if reply else None
        if ids:
            yield prompt, ids


def _pack(pairs: list[tuple[list[int], list[int]]], seq_len: int) -> dict:
    """[(prompt ids, answer ids)] -> {"tokens" [N,seq_len], "lengths" [N], "starts" [N]}."""
    tokens = np.zeros((len(pairs), seq_len), np.int32)
    lengths = np.zeros(len(pairs), np.int32)
    for i, (p, a) in enumerate(pairs):
        seq = (p + a)[:seq_len]
        tokens[i, : len(seq)], lengths[i] = seq, len(seq)
    starts = np.array([len(p) for p, _ in pairs], np.int32)
    return {"tokens": tokens, "lengths": lengths, "starts": starts}


def answers_by_prompt(data: dict) -> dict[tuple[int, ...], list[int]]:
    """{prompt ids: answer ids} of packed answers (a cache file's arrays)."""
    rows = zip(data["tokens"], data["starts"], data["lengths"], strict=True)
    return {tuple(row[:start].tolist()): row[start:end].tolist() for row, start, end in rows}


def generate_answers(
    model,
    conversations: Iterable[dict],
    n: int,
    out: Path,
    prompt_len: int = 128,
    new_tokens: int = 192,
    batch: int = ANSWER_BATCH,
    reuse: Iterable[Path] = (),
    turns: str = "first",
    one_shape: bool | None = None,
    prompts: list[list[int]] | None = None,
) -> dict:
    """{"tokens" [N,prompt_len+new_tokens], "lengths" [N], "starts" [N]}, cached in `out`;
    turns: a key of PROMPTS (prompts: token ids to answer instead, conversations unread).
    Answers found in `reuse` (caches made with the same
    new_tokens) or in an interrupted run's partial file are taken from there, not
    generated again. one_shape (None: where compiles are slow): every batch padded to
    `batch` prompts of prompt_len tokens, so its programs compile once (twice where
    prompt_len passes the prefill chunk: long prompts are chunked), not once per (prompt
    bucket, cache length, batch size) the sorted prompts pass through."""
    out = Path(out)
    if out.is_file():
        return load_npz(out)
    partial = out.with_suffix(".partial.npz")
    if prompts is None:
        prompts = PROMPTS[turns](model.tokenizer, conversations, n, prompt_len)
    prompts = [list(p) for p in prompts]
    prompts.sort(key=len)  # similar lengths batch together: less padding, few shapes
    unique = list(dict.fromkeys(map(tuple, prompts)))  # ShareGPT repeats prompts
    known: dict[tuple[int, ...], list[int]] = {}
    for path in [*reuse, partial]:
        if Path(path).is_file():
            known.update(answers_by_prompt(load_npz(path)))
    answers = {p: known[p] for p in unique if p in known}
    missing = [p for p in unique if p not in answers]
    generator = SpeculativeGenerator(model.cfg, model.params)
    one_shape = compiles_are_slow() if one_shape is None else one_shape
    if one_shape:
        generator.min_prompt_len = prompt_len
    seq_len = prompt_len + new_tokens
    bar = tqdm(total=len(unique), initial=len(answers), desc=f"answers {out.stem}", unit="seq")
    for start in range(0, len(missing), batch):
        chunk = missing[start : start + batch]
        rows = chunk + chunk[-1:] * (batch - len(chunk)) if one_shape else chunk
        results = generator.generate_batch([list(p) for p in rows], new_tokens)[: len(chunk)]
        answers.update((p, r.token_ids) for p, r in zip(chunk, results, strict=True))
        save_npz(partial, _pack([(list(p), a) for p, a in answers.items()], seq_len))
        bar.update(len(results))
    bar.close()
    data = _pack([(p, answers[tuple(p)]) for p in prompts], seq_len)
    save_npz(out, data)
    partial.unlink(missing_ok=True)
    return data


QUESTION_PROMPT_LEN = 1024  # longer first turns are left out of question_answers


def question_answers(model, root: Path, source: str, per_category: int, new_tokens: int,
                     batch: int = ANSWER_BATCH) -> dict:  # fmt: skip
    """The model's greedy answers to the first turns (<= QUESTION_PROMPT_LEN tokens) of the
    first per_category questions of each category of `source` (what jaxspec-bench
    --questions takes), packed as generate_answers packs them and cached in `root` under a
    name that changes with the prompts: for scoring a drafter on a benchmark's kind of text.
    "categories" [N] holds each row's question category (not cached)."""
    questions = select_questions(load_questions(source), None, per_category)
    category = {}
    for q in questions:
        category.setdefault(tuple(encode_prompt(model.tokenizer, q.turns[0])), q.category)
    prompts = [list(p) for p in category if len(p) <= QUESTION_PROMPT_LEN]
    if not prompts:
        raise JaxspecError(f"no question of {source} has a first turn of <= "
                           f"{QUESTION_PROMPT_LEN} tokens to score on")  # fmt: skip
    digest = hashlib.sha1(repr(prompts).encode()).hexdigest()[:10]
    out = root / f"questions-{digest}-{len(prompts)}-n{new_tokens}.npz"
    data = generate_answers(model, None, len(prompts), out, QUESTION_PROMPT_LEN, new_tokens,
                            batch, prompts=prompts)  # fmt: skip
    rows = zip(data["tokens"], data["starts"], strict=True)
    return {**data, "categories": np.array([category[tuple(r[:s].tolist())] for r, s in rows])}
