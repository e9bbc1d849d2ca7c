"""Frozen-base features for drafter training, computed once and cached as .npz:
the last layer's (pre-norm) hidden states, the data tokens, and the base model's own greedy
prediction at every position (self-distillation targets). Every file is written whole or not
at all; a damaged one is an error naming it."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxspec.data.sources import ROLES, sharegpt_split, split_tag
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import embed, lm_logits, run_layers
from jaxspec.outputs import load_npz, save_npz

from .selfdata import ANSWER_BATCH, PROMPTS, TURNS, dataset_replies, generate_answers, prompt_set
from .written import written_prompts


def conversation_ids(tokenizer, conversation: dict, max_len: int) -> list[int] | None:
    """A ShareGPT record through the chat template, truncated; None if unusable."""
    turns = conversation["conversations"]
    messages = [{"role": ROLES.get(t.get("from")), "content": t.get("value", "")} for t in turns]
    if not messages or any(m["role"] is None for m in messages) or messages[0]["role"] != "user":
        return None
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_len]
    return ids if len(ids) >= 16 else None


@partial(jax.jit, static_argnames=("cfg",))
def _features(params, tokens, *, cfg):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    h, _, _ = run_layers(params, cfg, embed(params, tokens), positions, None, causal_mask(B, T))
    return h.astype(jnp.float16), jnp.argmax(lm_logits(params, cfg, h), -1).astype(jnp.int32)


def extract(model, conversations, n_seqs: int, seq_len: int, out: Path, batch: int = 4) -> dict:
    """Features of the first n_seqs usable conversations (cached in `out`)."""
    out = Path(out)
    if out.is_file():
        return load_npz(out)
    seqs = []
    for conversation in conversations:
        ids = conversation_ids(model.tokenizer, conversation, seq_len)
        if ids:
            seqs.append(ids)
        if len(seqs) == n_seqs:
            break
    tokens = np.zeros((len(seqs), seq_len), np.int32)
    lengths = np.array([len(s) for s in seqs], np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    return extract_sequences(model, {"tokens": tokens, "lengths": lengths}, out, batch)


def extract_sequences(model, data: dict, out: Path, batch: int = 4, reuse=()) -> dict:
    """data {"tokens" [N,T], "lengths" [N], ...} -> data + "hidden" [N,T,D] float16 and
    "predicted" [N,T] (cached in `out`). Rows whose tokens a `reuse` features file holds
    are copied from it, not computed again."""
    out = Path(out)
    if out.is_file():
        return load_npz(out)
    tokens = data["tokens"]
    hidden = np.zeros((*tokens.shape, model.cfg.dim), np.float16)
    predicted = np.zeros_like(tokens)
    arrays = {"hidden": hidden, "predicted": predicted}
    rows = _copy_known_rows(tokens, reuse, arrays)
    compute = partial(_features, model.params, cfg=model.cfg)
    _compute_rows(compute, tokens, rows, arrays, batch, f"features {out.stem}")
    data = {**data, "hidden": hidden, "predicted": predicted}
    save_npz(out, data)
    return data


def _copy_known_rows(tokens: np.ndarray, reuse, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Fills the rows of `arrays` (name -> [N,...]) whose tokens [N,T] a `reuse` cache file
    holds from that file; -> the indices of the rows still to compute."""
    todo = np.ones(len(tokens), bool)
    for path in reuse:
        if not todo.any():
            break
        done = load_npz(path)
        row_of = {row.tobytes(): i for i, row in enumerate(done["tokens"])}
        pairs = [(i, row_of[tokens[i].tobytes()]) for i in np.flatnonzero(todo)
                 if tokens[i].tobytes() in row_of]  # fmt: skip
        if pairs:
            new, old = (np.array(ix) for ix in zip(*pairs, strict=True))
            for name, array in arrays.items():
                array[new] = _field(done, name)[old]
            todo[new] = False
    return np.flatnonzero(todo)


def _compute_rows(compute, tokens: np.ndarray, rows: np.ndarray, arrays: dict, batch: int,
                  desc: str) -> None:  # fmt: skip
    """Fills `arrays` (name -> [N,...], in compute's output order) at `rows` from
    compute(tokens [batch,T]), `batch` rows at a time (the last batch padded: one shape)."""
    for start in tqdm(range(0, len(rows), batch), desc=desc, unit="batch"):
        idx = rows[start : start + batch]
        outputs = compute(np.pad(tokens[idx], ((0, batch - len(idx)), (0, 0))))
        for array, out in zip(arrays.values(), outputs, strict=True):
            array[idx] = np.asarray(out)[: len(idx)]


def _field(done: dict, name: str) -> np.ndarray:
    """A cache file's array `name`; "hidden" (the last layer's states) also from a
    layer_features file, whose last stored layer is the model's last."""
    if name == "hidden" and name not in done:
        return done["states"][:, :, -1]
    return done[name]


def _siblings(root: Path, prefix: str, split: str, prompt_len: int | str, new_tokens: int):
    """Caches of the same kind, split and lengths for other prompt counts (prompt_len "*":
    any prompt length)."""
    return sorted(root.glob(f"{prefix}-{split_tag(split)}-*-p{prompt_len}-n{new_tokens}.npz"))


WRITTEN_SEEDS = {"train": 0, "test": 1 << 20}  # written prompts' seeds: streams far apart


def answers_name(turns: str) -> str:
    """The cache files' name for answers to `turns` prompts (selfdata.TURNS)."""
    return "self" if turns == "first" else f"self-{turns}"


def answers_tail(split: str, n: int, prompt_len: int, new_tokens: int, skip: str | None) -> str:
    """The end of the names of answer (and state) caches: split, prompt count, what `skip`
    (selfdata.prompt_set) left out, lengths."""
    less = "-less-{}-{}-p{}".format(*prompt_set(skip)) if skip else ""
    return f"{split_tag(split)}-{n}{less}-p{prompt_len}-n{new_tokens}"


def self_answers(model, root: Path, split: str, n: int, prompt_len: int, new_tokens: int,
                 batch: int = ANSWER_BATCH, turns: str = "first",
                 skip: str | None = None) -> dict:  # fmt: skip
    """The base model's own greedy answers to n `split` prompts (train/selfdata.py; turns:
    which user turns are prompts), `batch` prompts at a time, cached in `root` (the model's
    training folder, shared by every drafter's trainer). Answers to the same prompts in
    caches of either kind and any prompt length with the same new_tokens are reused.
    skip "TURNS:N:LEN" (ShareGPT prompts only): those of the n that are among the first N
    TURNS prompts of <= LEN tokens left out, e.g. the ones a drafter trained on already."""
    name = answers_name(turns)
    path = root / f"{name}-{answers_tail(split, n, prompt_len, new_tokens, skip)}.npz"
    if path.is_file():  # ShareGPT is not read
        return load_npz(path)
    kinds = [answers_name(kind) for kind in TURNS]
    reuse = [p for kind in kinds for p in _siblings(root, kind, split, "*", new_tokens)]
    if turns == "written":  # the model's own prompts, a stream per split
        file = root / f"written-{split_tag(split)}-p{prompt_len}-b{batch}.npz"
        seed = WRITTEN_SEEDS[split]
        prompts = written_prompts(model, file, n, prompt_len, batch, seed)
        return generate_answers(model, None, n, path, prompt_len, new_tokens, batch,
                                reuse=reuse, prompts=prompts)  # fmt: skip
    conversations, tokenizer, prompts = sharegpt_split(split), model.tokenizer, None
    if skip:  # generate_answers' own prompts, less the skipped ones
        skip_turns, skip_n, skip_len = prompt_set(skip)
        known = set(map(tuple, PROMPTS[skip_turns](tokenizer, conversations, skip_n, skip_len)))
        prompts = PROMPTS[turns](tokenizer, conversations, n, prompt_len)
        prompts = [p for p in prompts if tuple(p) not in known]
        if not prompts:
            raise JaxspecError(f"--skip-prompts {skip} leaves out all {n} {split} prompts: "
                               "raise --train-seqs or --prompt-len")  # fmt: skip
    return generate_answers(model, conversations, n, path, prompt_len, new_tokens, batch,
                            reuse=reuse, turns=turns, prompts=prompts)  # fmt: skip


def sharegpt_replies(model, root: Path, split: str, n: int, prompt_len: int, new_tokens: int,
                     turns: str = "first") -> dict:  # fmt: skip
    """The conversations' own replies to n `split` prompts (selfdata.dataset_replies), packed
    as self_answers packs the model's, cached in `root`."""
    path = root / f"sharegpt-{turns}-{split_tag(split)}-{n}-p{prompt_len}-n{new_tokens}.npz"
    if path.is_file():
        return load_npz(path)
    eos = tuple(model.cfg.eos_token_ids)
    data = dataset_replies(model.tokenizer, sharegpt_split(split), n, prompt_len, new_tokens,
                           turns, eos)  # fmt: skip
    save_npz(path, data)
    return data


def answer_features(model, root: Path, split: str, n: int, prompt_len: int, new_tokens: int,
                    answer_batch: int = ANSWER_BATCH) -> dict:  # fmt: skip
    """Features of self_answers(...), cached beside them; rows that a features or
    layer_features cache of the same split and lengths holds are copied from it."""
    answers = self_answers(model, root, split, n, prompt_len, new_tokens, answer_batch)
    name = f"features-self-{split_tag(split)}-{n}-p{prompt_len}-n{new_tokens}.npz"
    reuse = [*_siblings(root, "features-self", split, prompt_len, new_tokens),
             *_siblings(root, "states-*-self", split, prompt_len, new_tokens)]  # fmt: skip
    return extract_sequences(model, answers, root / name, reuse=reuse)


def _states(params, tokens, cfg, layers) -> dict:
    """tokens [B,T] -> {layer count: the states after it [B,T,D]} for `layers`."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    _, _, states = run_layers(
        params, cfg, embed(params, tokens), positions, None, causal_mask(B, T), collect=layers
    )
    return states


def _stacked(states: dict, layers) -> jax.Array:
    return jnp.stack([states[n] for n in layers], axis=2).astype(jnp.float16)  # [B,T,L,D]


@partial(jax.jit, static_argnames=("cfg", "layers"))
def live_states(params, tokens, *, cfg, layers):
    """tokens [B,T] -> the states after each of `layers` (layer counts, the last included)
    [B,T,L,D] float16, as layer_features caches them (a training step's, --states live)."""
    return _stacked(_states(params, tokens, cfg, layers), layers)


@partial(jax.jit, static_argnames=("cfg", "layers"))
def layer_states(params, tokens, *, cfg, layers):
    """live_states(...) and the model's greedy next token [B,T]: what layer_features
    caches."""
    states = _states(params, tokens, cfg, layers)
    predicted = jnp.argmax(lm_logits(params, cfg, states[cfg.n_layers]), -1).astype(jnp.int32)
    return _stacked(states, layers), predicted


def with_states(model, data: dict, layers: tuple[int, ...], batch: int = 4) -> dict:
    """Packed answers {"tokens" [N,T], ...} + what layer_features adds: "states" [N,T,L,D]
    after `layers` (stored_layers), "layers", "predicted" [N,T]; not cached."""
    tokens = data["tokens"]
    states = np.zeros((*tokens.shape, len(layers), model.cfg.dim), np.float16)
    predicted = np.zeros_like(tokens)
    compute = partial(layer_states, model.params, cfg=model.cfg, layers=layers)
    _compute_rows(compute, tokens, np.arange(len(tokens)), {"states": states,
                  "predicted": predicted}, batch, "states")  # fmt: skip
    return {**data, "states": states, "layers": np.asarray(layers, np.int32),
            "predicted": predicted}  # fmt: skip


def stored_layers(cfg, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layers whose states layer_features keeps: `layers` and the last one, in order."""
    return tuple(sorted(set(layers) | {cfg.n_layers}))


def layer_features(model, root: Path, split: str, n: int, prompt_len: int, new_tokens: int,
                   layers: tuple[int, ...], batch: int = 4, answer_batch: int = ANSWER_BATCH,
                   turns: str = "first", skip: str | None = None) -> dict:  # fmt: skip
    """self_answers(...) + "states" [N,T,L,D] float16: the states after each of `layers`
    (layer counts, the last layer added: "layers" [L] names them) at every position, and
    "predicted" [N,T] the model's greedy next token; cached beside the answers. Rows that
    a cache of the same layers for another prompt count holds are copied from it."""
    answers = self_answers(model, root, split, n, prompt_len, new_tokens, answer_batch, turns,
                           skip)  # fmt: skip
    prefix = f"states-{'-'.join(map(str, layers))}-{answers_name(turns)}"
    out = root / f"{prefix}-{answers_tail(split, n, prompt_len, new_tokens, skip)}.npz"
    if out.is_file():
        return load_npz(out)
    reuse = _siblings(root, prefix, split, prompt_len, new_tokens)
    layers = stored_layers(model.cfg, layers)
    tokens = answers["tokens"]
    states = np.zeros((*tokens.shape, len(layers), model.cfg.dim), np.float16)
    predicted = np.zeros_like(tokens)
    arrays = {"states": states, "predicted": predicted}
    rows = _copy_known_rows(tokens, reuse, arrays)
    compute = partial(layer_states, model.params, cfg=model.cfg, layers=layers)
    _compute_rows(compute, tokens, rows, arrays, batch, f"states {out.stem}")
    data = {**answers, "states": states, "layers": np.asarray(layers, np.int32),
            "predicted": predicted}  # fmt: skip
    save_npz(out, data)
    return data
