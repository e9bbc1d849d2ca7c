"""Prompts the model writes itself (Magpie): a chat model given only the opening of a user
turn writes a user's message, as its instruction tuning taught it. No dataset is needed,
and the prompts range over what the model was tuned on (questions, e-mails to rewrite,
texts to summarise, code), not one dataset's kind.

Each batch decodes `batch` rows from the opening, sampled (WRITING); a row is kept when the
model closed the turn (an end token) within WRITE_TOKENS tokens, its text is not empty, the
chat template renders it in at most max_len tokens, and no earlier kept prompt is the same. The
prompts kept so far and the batches written are saved after every batch: a larger n or an
interrupted run goes on from there, and batch i always uses seed + i, so the first n
prompts do not depend on how many are asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.outputs import load_npz, save_npz
from jaxspec.sampling import Sampling
from jaxspec.text import encode_prompt

WRITING = Sampling(temperature=1.0, top_p=0.95)  # Magpie samples at temperature 1
WRITE_TOKENS = 256  # the longest user turn written: a batch decodes until its last row closes
MARK = "\x00written\x00"  # a message content no template contains


def user_opening(tokenizer) -> list[int]:
    """Token ids of the chat template's rendering up to where a first user message's text
    begins (system prompt and user header included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise JaxspecError(
            "prompts the model writes need a chat model: this checkpoint's tokenizer has no "
            "chat template; pick other --turns"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    return list(tokenizer.encode(text[: text.index(MARK)], add_special_tokens=False))


def written_prompts(model, out: Path, n: int, max_len: int, batch: int = 32,
                    seed: int = 0) -> list[list[int]]:  # fmt: skip
    """The first n prompts (chat-templated token ids, <= max_len) the model writes, cached in
    `out` (see the module's docstring)."""
    out = Path(out)
    opening = user_opening(model.tokenizer)
    kept, batches = _load(out) if out.is_file() else ([], 0)
    seen = set(map(tuple, kept))
    eos = set(model.cfg.eos_token_ids)
    budget = min(max_len - len(opening), WRITE_TOKENS)  # longer: no room in max_len once templated
    if budget < 1:
        raise JaxspecError(f"--prompt-len {max_len} leaves no room after the chat template's "
                           f"{len(opening)}-token opening: raise it")  # fmt: skip
    generator = SpeculativeGenerator(model.cfg, model.params, sampling=WRITING)
    bar = tqdm(total=n, initial=min(len(kept), n), desc=f"prompts {out.stem}", unit="prompt")
    while len(kept) < n:
        results = generator.generate_batch([opening] * batch, budget, seed=seed + batches)
        batches += 1
        for result in results:
            ids = result.token_ids
            if not ids or ids[-1] not in eos:
                continue  # unfinished within the budget
            text = model.tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
            prompt = encode_prompt(model.tokenizer, text) if text else []
            if prompt and len(prompt) <= max_len and tuple(prompt) not in seen:
                seen.add(tuple(prompt))
                kept.append(prompt)
                bar.update(1 if len(kept) <= n else 0)
        save_npz(out, _packed(kept, batches))
        if batches >= 20 and len(kept) < batches:  # under 1 prompt in `batch` rows is kept
            raise JaxspecError(
                f"the model closed only {len(kept)} usable user turns in {batches} batches "
                f"(each at most {budget} tokens and {max_len} with the template): raise "
                "--prompt-len if it is below ~300, or pick other --turns"
            )
    bar.close()
    return kept[:n]


def _packed(prompts: list[list[int]], batches: int) -> dict:
    tokens = np.zeros((len(prompts), max(map(len, prompts), default=1)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    return {"tokens": tokens, "lengths": lengths, "batches": np.int64(batches)}


def _load(path: Path) -> tuple[list[list[int]], int]:
    data = load_npz(path)
    rows = zip(data["tokens"], data["lengths"], strict=True)
    return [row[:length].tolist() for row, length in rows], int(data["batches"])
