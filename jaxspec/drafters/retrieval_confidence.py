"""How often lookup's continuations are right, by the length of their match: the confidence
that retrieval candidates carry into a dynamic tree (drafters.retrieval).

Measured on a model's own greedy answers (the trainers' self-distilled data): at every
answer position, the best continuation of the current suffix (LookupDrafter.continuations,
as decoding finds it) is compared with the tokens the model went on to write.

    python -m jaxspec.drafters.retrieval_confidence ANSWERS.npz [--max-ngram 3] [--depth 6]

ANSWERS.npz: tokens [n,L], starts [n] (each answer's first position), lengths [n], as the
trainers cache them (e.g. ~/.cache/jaxspec/train/<model>/self-train-1600-p128-n192.npz).
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.lookup import LookupDrafter


@partial(jax.jit, static_argnames=("lookup", "depth"))
def _counts(tokens, start, length, *, lookup: LookupDrafter, depth: int):
    """One sequence tokens [L] (answer from `start`, `length` valid) -> (tries, hits), each
    [max_ngram, depth]: over positions p in the answer, by the best continuation's match m,
    how often its token j was compared (its tokens before j right) and was right."""
    L = tokens.shape[0]
    position = jnp.arange(L)
    found, matched = lookup.continuations(jnp.broadcast_to(tokens, (L, L)), position, 1, depth)
    found, matched = found[:, 0], matched[:, 0]  # [L,depth], [L]
    ahead = position[:, None] + 1 + jnp.arange(depth)  # the tokens the model wrote next
    truth = jnp.where(ahead < length, tokens[jnp.minimum(ahead, L - 1)], -2)
    scored = (position >= start - 1) & (position < length - 1) & (matched > 0)
    right = (found == truth) & (found >= 0)
    before = jnp.cumprod(right, axis=1)  # tokens 0..j all right
    tried = jnp.concatenate([jnp.ones((L, 1), bool), before[:, :-1] > 0], 1)
    tried &= (found >= 0) & (truth >= 0) & scored[:, None]
    by_match = jax.nn.one_hot(matched - 1, lookup.max_ngram, dtype=jnp.int32)  # [L,G]
    tries = by_match.T @ tried.astype(jnp.int32)
    hits = by_match.T @ (tried & right).astype(jnp.int32)
    return tries, hits


def measure(data: dict, lookup: LookupDrafter, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """data: tokens [n,L], starts [n], lengths [n] -> (rates, tries), each
    [max_ngram, depth]: rates[m-1, j] the fraction of answer positions whose best
    continuation, matching the last m tokens, has its token j right given tokens 0..j-1
    right (nan where never tried)."""
    tries = np.zeros((lookup.max_ngram, depth), np.int64)
    hits = np.zeros_like(tries)
    for tokens, start, length in zip(data["tokens"], data["starts"], data["lengths"], strict=True):
        t, h = _counts(jnp.asarray(tokens), int(start), int(length), lookup=lookup, depth=depth)
        tries += np.asarray(t)
        hits += np.asarray(h)
    with np.errstate(invalid="ignore", divide="ignore"):
        return hits / tries, tries


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("answers")
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument("--depth", type=int, default=6)
    args = p.parse_args(argv)
    data = dict(np.load(args.answers))
    rates, tries = measure(data, LookupDrafter(max_ngram=args.max_ngram), args.depth)
    for m, (row, n) in enumerate(zip(rates, tries, strict=True), start=1):
        cells = ", ".join(f"{r:.3f} ({c})" for r, c in zip(row, n, strict=True))
        print(f"match {m}: {cells}")


if __name__ == "__main__":
    main()
