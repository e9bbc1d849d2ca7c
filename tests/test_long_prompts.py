"""Long prompts are prefilled in fixed chunks: the same tokens as a one-shot prefill for
every method, a fixed set of programs whatever the prompt's length."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator, prompt_chunks
from jaxspec.drafters.chimera import ChimeraSettings
from jaxspec.drafters.eagle import EagleSettings
from jaxspec.drafters.firp import FirpSettings
from jaxspec.drafters.medusa import MedusaSettings
from jaxspec.drafters.sdsat import SdsatSettings
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import attention_mask, causal_mask
from jaxspec.layers import PrefixReads, attention
from jaxspec.llama import init_params, within_window
from jaxspec.methods import make_drafter
from jaxspec.tree import tree_preset

CFG = dataclasses.replace(preset("tiny-gqa"), eos_token_ids=(), max_position=256)
SETTINGS = {
    "medusa": MedusaSettings(n_heads=2),
    "firp": FirpSettings(layers=(1, 2)),
    "chimera": ChimeraSettings(n_heads=2, cache_size=64),
    "sdsat": SdsatSettings(rank=2),
    "eagle": EagleSettings(layers=(1, 1, 2)),
}
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 97, n).tolist() for n in (70, 23, 48, 33)]


def generator(method: str, chunk: int | None) -> SpeculativeGenerator:
    params = init_params(CFG, jax.random.key(0), scale=0.3)
    if method == "ar":
        return SpeculativeGenerator(CFG, params, prefill_chunk=chunk)
    drafter = make_drafter(method, CFG, SETTINGS[method])
    weights = drafter.prepare(params, drafter.init(params, jax.random.key(1)), {})
    tree = tree_preset("comb-2-3")
    return SpeculativeGenerator(CFG, params, drafter, weights, tree, prefill_chunk=chunk)


@pytest.mark.parametrize("method", ["ar", *SETTINGS])
def test_chunked_prefill_gives_one_shot_tokens(method):
    """A batch whose rows end in different chunks (16-token chunks: rows of 70, 23, 48 and
    33 tokens) against the one-shot prefill."""
    one_shot = generator(method, None).generate_batch(PROMPTS, 24)
    chunked = generator(method, 16)
    assert chunked.shapes(70, 24)[:2] == (True, 16)
    got = chunked.generate_batch(PROMPTS, 24)
    assert [r.token_ids for r in got] == [r.token_ids for r in one_shot]
    assert [r.steps for r in got] == [r.steps for r in one_shot]  # the drafter's state too
    assert "extend" in next(iter(chunked._executables.values()))


def test_the_last_chunk_fits_in_the_cache():
    """130 tokens in 100-token chunks with 2 new tokens: the cache's 192 slots would clip
    the last chunk (written whole at 100..199) onto the first's; it gets room instead."""
    params = init_params(CFG, jax.random.key(0), scale=0.3)
    prompt = RNG.integers(3, 97, 130).tolist()
    chunked = SpeculativeGenerator(CFG, params, prefill_chunk=100)
    assert chunked.shapes(130, 2) == (True, 100, 200)
    one_shot = SpeculativeGenerator(CFG, params).generate(prompt, 8).token_ids
    assert chunked.generate(prompt, 8).token_ids == one_shot


def test_chunks_cover_each_prompt_once():
    chunks, (last, counts) = prompt_chunks([list(range(1, 41)), [7, 8, 9]], 32)
    # row 0: 32 tokens in one chunk, 8 in its last; row 1: all 3 in its last chunk
    assert [c.tolist() for _, c, _ in chunks] == [[32, 0]]
    assert [f.tolist() for _, _, f in chunks] == [[33, 7]]
    assert counts.tolist() == [8, 3] and last.shape == (2, 32)  # full width: one program
    assert last[0, :8].tolist() == list(range(33, 41)) and last[1, :3].tolist() == [7, 8, 9]


def test_program_count_does_not_grow_with_prompt_length():
    """Shapes a 1..32k-token prompt sweep compiles (64 new tokens, 2048-token chunks): the
    prompt buckets up to the chunk, then the chunk, times the cache-length ladder."""
    cfg = dataclasses.replace(CFG, max_position=40_000)
    gen = SpeculativeGenerator(cfg, None, prefill_chunk=2048)
    shapes = {gen.shapes(n, 64) for n in range(1, 32_769)}
    prefill_widths = {width for _, width, _ in shapes}
    assert max(prefill_widths) == 2048 and len(prefill_widths) <= 20
    assert len(shapes) <= 40, len(shapes)  # 4 programs each (+ extend when chunked)


def test_too_long_prompts_stay_one_line_errors():
    gen = generator("ar", 16)
    with pytest.raises(JaxspecError, match="exceeds the limit of 256 positions"):
        gen.generate(list(range(3, 97)) * 3, 10)


@pytest.mark.slow
def test_default_model_prefills_8k_tokens_in_chunks():
    """SmolLM2 (8192 positions): an 8000-token prompt prefills chunk by chunk within this
    machine's memory; on a 600-token prompt, 512-token chunks give the one-shot tokens."""
    from jaxspec.models import load_model

    model = load_model()
    text = model.tokenizer.encode(
        "The history of the printing press begins in the fifteenth century. " * 700
    )[:8000]
    gen = SpeculativeGenerator(model.cfg, model.params, prefill_chunk=512)
    long = gen.generate(text, 8)
    assert len(long.token_ids) == 8 and gen.shapes(len(text), 8)[:2] == (True, 512)
    one_shot = SpeculativeGenerator(model.cfg, model.params, prefill_chunk=2048)
    assert gen.generate(text[:600], 16).token_ids == one_shot.generate(text[:600], 16).token_ids


def _attention_inputs(S: int, T: int, lengths, seed=0):
    """Random q [B,T,N,H], cache keys/values [B,K,S,H], new keys/values [B,K,T,H] (B 2,
    N 4, K 2, H 8); the new tokens at positions lengths + t, causal among themselves."""
    rng = np.random.default_rng(seed)
    B, N, K, H = 2, 4, 2, 8

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    lengths = jnp.asarray(lengths, jnp.int32)
    positions = lengths[:, None] + jnp.arange(T)
    args = (normal(B, T, N, H), normal(B, K, S, H), normal(B, K, S, H), normal(B, K, T, H),
            normal(B, K, T, H))  # fmt: skip
    return args, lengths, positions, causal_mask(B, T)


@pytest.mark.parametrize(
    "window, lengths",
    [
        (0, [7, 53]),
        (20, [7, 53]),
        (3, [7, 53]),  # shorter than the chunk (5): the chunk's own oldest keys leave it
        (12, [42, 50]),  # query 42 sees key 31 (> 42 - 12): the last slot of block 1
    ],
)
def test_prefix_attention_equals_the_masked_softmax(window, lengths):
    """Blocks of 16 over a 60-slot cache (the last block overlaps the one before it), rows
    of committed slots as given, with and without a sliding window (also one shorter than
    the chunk, and one whose first visible key ends a block): the masked one-softmax
    attention's output to float32 rounding."""
    args, lengths, positions, causal = _attention_inputs(60, 5, lengths)
    mask = attention_mask(lengths, causal, 60)
    if window:
        key_positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(60), (2, 60)), positions], 1)
        mask &= within_window(positions, key_positions, window)
    want = attention(*args, mask)
    got = attention(*args, PrefixReads(lengths, causal, positions, window, 16))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("window", [0, 15])
def test_prefix_attention_reads_only_the_prompt_so_far(window):
    """NaN in the cache's slots from 32 on (past both rows' 30 committed ones) and, with a
    window of 15, in slots 0-15 (queries at 30-33 see slots > 15 only: the skipped block
    ends right behind the oldest query's window): blocks of 16 wholly past the longest
    row, or behind every query's window, are never read. The masked softmax over the whole
    buffer reads them (NaN)."""
    (q, k, v, k_new, v_new), lengths, positions, causal = _attention_inputs(64, 4, [30, 30])
    k, v = k.at[:, :, 32:].set(jnp.nan), v.at[:, :, 32:].set(jnp.nan)
    if window:
        k, v = k.at[:, :, :16].set(jnp.nan), v.at[:, :, :16].set(jnp.nan)
    got = attention(q, k, v, k_new, v_new, PrefixReads(lengths, causal, positions, window, 16))
    assert np.isfinite(got).all()
    assert not np.isfinite(
        attention(q, k, v, k_new, v_new, attention_mask(lengths, causal, 64))
    ).all()


def test_prefix_attention_over_a_cache_shorter_than_a_block():
    """Blocks of 16 over a 12-slot cache: one block of the whole cache, read once."""
    args, lengths, positions, causal = _attention_inputs(12, 5, [7, 12])
    want = attention(*args, attention_mask(lengths, causal, 12))
    got = attention(*args, PrefixReads(lengths, causal, positions, 0, 16))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_prefix_attention_memory_does_not_grow_with_the_cache():
    """XLA's plan for a 32-token chunk against 512 and 8192 cache slots: about the same
    scratch memory (the masked softmax's [B,N,T,S] scores grow 16x)."""

    def scratch(S: int, blocked: bool) -> int:
        args, lengths, positions, causal = _attention_inputs(S, 32, [40, 100])
        reads = PrefixReads(lengths, causal, positions, 0, 32)

        def run(q, k, v, k_new, v_new, lengths):
            mask = attention_mask(lengths, causal, S)
            return attention(q, k, v, k_new, v_new, reads if blocked else mask)

        compiled = jax.jit(run).lower(*args, lengths).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert scratch(8192, True) < 1.5 * scratch(512, True)  # equal with jax 0.10
    assert scratch(8192, False) > 8 * scratch(512, False)
