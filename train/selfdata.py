"""Self-distillation data: the base model's own greedy answers to ShareGPT prompts.

Drafters guess what the model will write, and a small model writes very differently from
the ChatGPT answers in ShareGPT, so drafters train best on the model's own text (Medusa-2's
self-distillation). Each record is [chat-templated first user turn ; greedy answer]; `starts`
marks where the answer begins. Batched generation; progress is saved after every batch and
an interrupted run resumes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxspec.data.sources import first_user_turn
from jaxspec.decode import SpeculativeGenerator
from jaxspec.text import encode_prompt


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


def _pack(prompts, answers, seq_len) -> dict:
    tokens = np.zeros((len(answers), seq_len), np.int32)
    lengths = np.zeros(len(answers), np.int32)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=False)):
        seq = (p + a)[:seq_len]
        tokens[i, : len(seq)], lengths[i] = seq, len(seq)
    starts = np.array([len(p) for p in prompts[: len(answers)]], np.int32)
    return {"tokens": tokens, "lengths": lengths, "starts": starts}


def generate_answers(
    model,
    conversations: Iterable[dict],
    n: int,
    out: Path,
    prompt_len: int = 128,
    new_tokens: int = 192,
    batch: int = 32,
) -> dict:
    """{"tokens" [N,prompt_len+new_tokens], "lengths" [N], "starts" [N]}, cached in `out`."""
    out = Path(out)
    if out.is_file():
        return dict(np.load(out))
    partial = out.with_suffix(".partial.npz")
    prompts = first_turn_prompts(model.tokenizer, conversations, n, prompt_len)
    prompts.sort(key=len)  # similar lengths batch together: less padding, few shapes
    answers: list[list[int]] = []
    if partial.is_file():
        done = np.load(partial)
        rows = zip(done["tokens"], done["starts"], done["lengths"], strict=True)
        answers = [tokens[start:end].tolist() for tokens, start, end in rows]
    generator = SpeculativeGenerator(model.cfg, model.params)
    seq_len = prompt_len + new_tokens
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), initial=len(answers), desc=f"answers {out.stem}", unit="seq")
    for start in range(len(answers), len(prompts), batch):
        results = generator.generate_batch(prompts[start : start + batch], new_tokens)
        answers += [r.token_ids for r in results]
        np.savez(partial, **_pack(prompts, answers, seq_len))
        bar.update(len(results))
    bar.close()
    data = _pack(prompts, answers, seq_len)
    np.savez(out, **data)
    partial.unlink(missing_ok=True)
    return data
