"""Where a row's greedy tokens first leave its AR reference's, and how near a tie AR's
choice was there. A difference at a near-tie points at rounding (products whose
accumulation order depends on how many rows are computed together, as a GPU's kernels
may); one at a wide margin points at a bug."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.generate import MIN_PROMPT_BUCKET, bucket
from jaxspec.kv_cache import causal_mask
from jaxspec.layers import EXACT_ROUNDING
from jaxspec.llama import forward


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where token lists a and b differ (one ending first counts as a
    difference there); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # the shorter one ends it
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@partial(jax.jit, static_argnames=("cfg",), compiler_options=EXACT_ROUNDING)
def _logits_after(params, cfg, tokens, length):
    """tokens [1,W] (the first `length` real) -> the logits [V] that follow them."""
    W = tokens.shape[1]
    logits, _, _ = forward(params, cfg, tokens, jnp.arange(W)[None], None, causal_mask(1, W))
    return logits[0, length - 1]


def top2_margin(model, ids: list[int], width: int = 0) -> float:
    """The model's top-1 minus top-2 logit for the token after ids (0: a tie), computed
    over max(width, the bucket of len(ids)) positions (one width: one compile)."""
    tokens = np.zeros((1, max(width, bucket(len(ids), MIN_PROMPT_BUCKET))), np.int32)
    tokens[0, : len(ids)] = ids
    logits = _logits_after(model.params, model.cfg, tokens, len(ids))
    top = jax.lax.top_k(logits, 2)[0]
    return float(top[0] - top[1])


def divergences(rows, reference_rows, model, limit: int = 3, width: int = 0) -> list[dict]:
    """rows, reference_rows: (prompt ids, new ids) per generation -> for the first `limit`
    generations whose new ids differ: the generation's index, the first differing position,
    both tokens there (None past a list's end) and the reference model's top-2 margin at it
    (top2_margin's width)."""
    found = []
    for i, ((_, ids), (prompt, ref)) in enumerate(zip(rows, reference_rows, strict=True)):
        at = first_difference(ids, ref)
        if at is None:
            continue
        found.append(
            {
                "generation": i,
                "position": at,
                "ar_token": ref[at] if at < len(ref) else None,
                "row_token": ids[at] if at < len(ids) else None,
                "ar_margin": top2_margin(model, prompt + ref[:at], width),
            }
        )
        if len(found) == limit:
            break
    return found
