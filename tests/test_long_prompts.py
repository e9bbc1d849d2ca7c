"""Long prompts are prefilled in fixed chunks: the same tokens as a one-shot prefill for
every method, a fixed set of programs whatever the prompt's length."""

from __future__ import annotations

import dataclasses

import jax
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
from jaxspec.llama import init_params
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
    with pytest.raises(JaxspecError, match="exceeds the cache of 256 positions"):
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
