"""The decoding loop's plumbing (jaxspec/decode.py), pinned by a mutation review: prefill
shapes at a chunk's edge, under min_prompt_len and a short cache, one program set per
shape, per-row streaming, the timings' split, the first verify step's randomness apart
from the prefill's; what a drafter is told of a chunked prompt, an EOS inside a step, the
cache's room for the steps ahead, a chunk's blocked reads of the cache and the backend's
default chunk."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec.decode as decode
from jaxspec.decode import SpeculativeGenerator, prefill_shape
from jaxspec.drafters.base import NoDrafter
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import init_cache
from jaxspec.llama import init_params
from jaxspec.sampling import Sampling
from jaxspec.tree import tree_preset
from tests.drafters import OracleDrafter
from tests.test_speculative import exact_joint_distribution, pooled_chisquare_pvalue, tiny


def test_prefill_shape_at_a_chunks_edge_under_min_prompt_len_and_a_short_cache():
    """A prompt as long as a chunk is prefilled in one shot (one token more: in chunks);
    min_prompt_len sizes a short prompt's program up to the chunk, not past it; the prompt
    bucket (bucket(100) = 128) is cut to a shorter cache."""
    assert prefill_shape(16, 0, 16, 128) == (False, 16, 128)
    assert prefill_shape(17, 0, 16, 128) == (True, 16, 128)
    assert prefill_shape(10, 100, 16, 128) == (False, 16, 128)
    assert prefill_shape(100, 0, 1024, 110) == (False, 110, 110)


def test_min_prompt_len_sizes_the_cache_as_for_that_prompt():
    """Sized for 100-token prompts, a 3-token one compiles the 100-token shape: its cache
    holds 100 + 40 new + 2 slots (bucket 192), not 3 + 40 + 2 (128)."""
    cfg, _ = tiny()
    gen = SpeculativeGenerator(cfg, None)
    gen.min_prompt_len = 100
    assert gen.shapes(3, 40) == gen.shapes(100, 40) == (False, 128, 192)


def test_no_prompts_is_a_clear_error():
    cfg, params = tiny()
    with pytest.raises(JaxspecError, match="no prompts: pass at least one"):
        SpeculativeGenerator(cfg, params).generate_batch([], 5)


def test_each_prefill_kind_and_cache_length_runs_its_own_programs():
    """One generator with 16-token chunks: a 16-token prompt (one shot), then a 20-token one
    (chunked, with the same prefill width and cache length) and a longer answer (a 192-slot
    cache) each compile their own programs (the programs of another would fail or decode
    garbage)."""
    cfg, params = tiny()
    rng = np.random.default_rng(1)
    short, long = rng.integers(3, 97, 16).tolist(), rng.integers(3, 97, 20).tolist()
    gen = SpeculativeGenerator(cfg, params, prefill_chunk=16)
    assert gen.shapes(16, 8) == (False, 16, 128) and gen.shapes(20, 8) == (True, 16, 128)
    first = gen.generate(short, 8).token_ids
    chunked = gen.generate(long, 8)
    assert len(chunked.token_ids) == 8 and len(gen._executables) == 2
    assert gen.generate(short, 120).token_ids[:8] == first and len(gen._executables) == 3


def test_each_row_streams_its_result_and_keeps_its_prompt():
    """A batch through an oracle chain-4 (row 0 accepts whole 5-token steps, so its last
    step is cut by max_new_tokens): each row's streamed pieces, in order, are its result's
    tokens, never an empty piece; the results keep the prompts as passed, whatever the
    caller does to its lists later."""
    cfg, params = tiny()
    prompts = [[5, 6, 7, 8, 9], [3, 1, 4]]
    ar = SpeculativeGenerator(cfg, params).generate(prompts[0], 16).token_ids
    reference = jnp.asarray(prompts[0] + ar + [0] * 16, jnp.int32)
    tree = tree_preset("chain-4")
    gen = SpeculativeGenerator(cfg, params, OracleDrafter(cfg.vocab_size), reference, tree)
    streamed = {0: [], 1: []}
    pieces = []
    results = gen.generate_batch(
        prompts, 12, on_tokens=lambda row, ids: (streamed[row].extend(ids), pieces.append(ids))
    )
    assert results[0].token_ids == ar[:12] and results[0].accepted == [4, 4, 4]  # 16 emitted
    assert [streamed[0], streamed[1]] == [r.token_ids for r in results] and all(pieces)
    prompts[0].append(99)
    assert [r.prompt_ids for r in results] == [[5, 6, 7, 8, 9], [3, 1, 4]]


def test_prompt_programs_run_on_the_prefill_params_and_count_as_prefill_time(monkeypatch):
    """plain-prefill with 2-token chunks, on a clock that moves only while programs run (1 s
    per prompt program, 1 ms per step): a warm generator runs its chunk and its prefill on
    the prefill's (plain) weights and its steps on the exact ones; prefill_s is the prompt
    programs' 2 s, decode_s the steps' (5 read, and one more dispatched before the last
    read)."""
    cfg, params = tiny()
    gen = SpeculativeGenerator(cfg, params, prefill_chunk=2, products="plain-prefill")
    assert gen.prefill_params is not gen.params
    gen.generate([5, 6, 7], 6)
    clock, seen = [0.0], []
    monkeypatch.setattr(decode.time, "perf_counter", lambda: clock[0])
    (programs,) = gen._executables.values()

    def ticking(name, seconds):
        program = programs[name]

        def run(*args):
            clock[0] += seconds
            seen.append((name, args[0] is gen.prefill_params))
            return program(*args)

        programs[name] = run

    ticking("extend", 1.0), ticking("prefill", 1.0), ticking("step", 1e-3)
    result = gen.generate([5, 6, 7], 6)
    assert seen == [("extend", True), ("prefill", True)] + [("step", False)] * 6
    assert result.compile_s == 0 and result.prefill_s == 2.0
    assert result.decode_s == pytest.approx(6e-3)


def test_the_first_verify_step_draws_apart_from_the_prefill():
    """Sampling with chain-1 drafts of token 0, 500 rows of one prompt: the first two
    tokens (the prefill's, then the first verify step's) jointly follow the model. The
    step used to draw with the key the prefill drew the first token with, so the uniform
    that tested the draft was the one whose Gumbel noise had made a first 0: after a 0, a
    second 0 was accepted about 5% of the time instead of 67%."""
    cfg, params = tiny("tiny-mqa", vocab=6)
    sampling, prompt, N = Sampling(1.0), [1, 4, 2, 5], 500
    zeros = jnp.zeros(16, jnp.int32)  # the oracle's reference: it drafts token 0
    gen = SpeculativeGenerator(
        cfg, params, OracleDrafter(cfg.vocab_size), zeros, tree_preset("chain-1"), sampling
    )
    out = np.array([r.token_ids for r in gen.generate_batch([prompt] * N, 2, seed=5)])
    expected = exact_joint_distribution(cfg, params, prompt, sampling) * N  # [V,V]
    observed = np.zeros_like(expected)
    np.add.at(observed, (out[:, 0], out[:, 1]), 1)
    assert pooled_chisquare_pvalue(observed, expected) > 1e-3


@dataclasses.dataclass(frozen=True)
class Told(NoDrafter):
    """Its state: what each row's cache holds as the drafter is told (the first
    Entered.count tokens at their positions, then `current` at `position`; -1 where
    nothing), and how many times a position was told a token other than one it had."""

    def init_state(self, cfg, batch, max_len, dtype, drafter_params=None):
        return jnp.full((batch, max_len), -1, jnp.int32), jnp.zeros((batch,), jnp.int32)

    def advance(self, params, drafter_params, inputs):
        (told, changed), new = inputs.state, inputs.entered
        B, S = told.shape
        M = new.tokens.shape[1]
        at = jnp.where(jnp.arange(M) < new.count[:, None], new.start[:, None] + jnp.arange(M), S)
        at = jnp.concatenate([at, inputs.position[:, None]], 1)  # [B,M+1], S: not told
        tokens = jnp.concatenate([new.tokens, inputs.current[:, None]], 1)
        old = jnp.take_along_axis(told, jnp.minimum(at, S - 1), 1)
        changed += ((at < S) & (old != -1) & (old != tokens)).sum(1)
        told = told.at[jnp.arange(B)[:, None], at].set(tokens, mode="drop")
        return told, changed


def test_a_drafter_is_told_each_rows_prompt_once_at_its_positions():
    """4-token chunks, rows of 9 and 2 tokens (the short one has no tokens in either chunk
    before its last): the drafter is told each prompt, then its first token, nothing past
    it, and never a token at a position that held another."""
    cfg, params = tiny()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4]]
    gen = SpeculativeGenerator(cfg, params, Told(), prefill_chunk=4)
    results = gen.generate_batch(prompts, 1)
    told, changed = (np.asarray(x) for x in gen.drafter_state)
    for row, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        want = prompt + result.token_ids
        assert told[row].tolist() == want + [-1] * (told.shape[1] - len(want))
    assert changed.tolist() == [0, 0]


def test_an_eos_inside_a_step_ends_the_answer_on_it():
    """An oracle chain-4 (whole 5-token steps) and an EOS that the first verify step emits
    as its third token: the answer ends on it, the step's later tokens neither kept nor
    streamed."""
    cfg, params = tiny()
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 16).token_ids
    assert ar[3] not in ar[:3]
    reference = jnp.asarray(prompt + ar + [0] * 16, jnp.int32)
    eos = dataclasses.replace(cfg, eos_token_ids=(ar[3],))
    gen = SpeculativeGenerator(eos, params, OracleDrafter(cfg.vocab_size), reference,
                               tree_preset("chain-4"))  # fmt: skip
    streamed = []
    result = gen.generate(prompt, 16, on_tokens=streamed.extend)
    assert result.token_ids == streamed == ar[:4] and result.accepted == [4]


def test_the_cache_holds_two_of_the_deepest_steps_past_the_answer():
    """chain-4 writes up to 2 x 5 slots past the last token kept: 3 + 30 new fill a
    33-position limit, in a 43-slot cache; one new token more is refused; AR leaves 2."""
    cfg, _ = tiny()
    chain = SpeculativeGenerator(cfg, None, tree=tree_preset("chain-4"), max_len=33)
    assert chain.cache_len(3, 30) == 43
    with pytest.raises(JaxspecError, match=r"\+ 31 new tokens need 34 positions.*of 33 positions"):
        chain.cache_len(3, 31)
    ar = SpeculativeGenerator(cfg, None, max_len=25)
    assert ar.cache_len(3, 22) == 27
    fixes = r"lower max_new_tokens \(--max-new-tokens\), or raise a max_len \(--max-len\) set"
    with pytest.raises(JaxspecError, match=rf"need 26 .*{fixes} below the model's context$"):
        ar.cache_len(3, 23)


def test_a_chunk_reads_the_cache_in_blocks():
    """XLA's plan for a 16-token chunk (extend_prompt) against 256 and 4096 cache slots:
    the same scratch memory, the cache read block by block (scores over the whole cache
    would grow 16x)."""
    cfg, _ = tiny()
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

    def scratch(S: int) -> int:
        cache = jax.eval_shape(lambda: init_cache(cfg, 1, S))
        program = decode.extend_prompt.lower(params, None, cache, ints(1, 16), ints(1), ints(1),
                                             None, cfg=cfg, drafter=NoDrafter())  # fmt: skip
        return program.compile().memory_analysis().temp_size_in_bytes

    assert scratch(4096) < 2 * scratch(256)


def test_the_default_chunk_is_the_backends(monkeypatch):
    """prefill_chunk unset: PREFILL_CHUNK of the backend, 2048 on one it does not name; a
    chunk passed wins."""
    cfg, _ = tiny()
    for backend, want in [*decode.PREFILL_CHUNK.items(), ("neuron", 2048)]:
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert SpeculativeGenerator(cfg, None, products="exact").prefill_chunk == want
    assert SpeculativeGenerator(cfg, None, prefill_chunk=64).prefill_chunk == 64
