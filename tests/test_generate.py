"""AR generation: identical to HF greedy, sampling distribution, limits and compile reuse."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec import sampling
from jaxspec.checkpoint import load_checkpoint
from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.generate import GenerationResult, bucket, cache_len, checked_max_len
from jaxspec.sampling import Sampling, position_keys, select_tokens, warped_logprobs


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    ckpt, model = tiny_ckpt
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    return cfg, params, model


@pytest.mark.parametrize("prompt_len", [1, 7, 16, 23])
def test_greedy_equals_hf_generate(tiny, prompt_len):
    cfg, params, model = tiny
    prompt = list(np.random.default_rng(prompt_len).integers(3, 101, prompt_len))
    ours = SpeculativeGenerator(cfg, params).generate(prompt, max_new_tokens=40)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )[0, prompt_len:].tolist()
    assert ours.token_ids == ref
    assert ours.steps == ours.new_tokens and ours.mean_accepted == 1.0


def n_programs(gen) -> int:
    return sum(p is not None for programs in gen._executables.values() for p in programs)


def test_compiles_once_per_bucket(tiny):
    cfg, params, _ = tiny
    gen = SpeculativeGenerator(cfg, params)
    first = gen.generate([5, 6, 7], max_new_tokens=20)
    assert first.compile_s > 0 and n_programs(gen) == 4  # prefill, step, 2 commits
    again = gen.generate([9, 8, 7, 6], max_new_tokens=30)  # same buckets: nothing compiles
    assert again.compile_s == 0 and n_programs(gen) == 4


def test_min_prompt_len_gives_prompts_of_every_length_one_shape(tiny):
    """Sized for the longest prompt, AR and PPD compile once for prompts in other buckets
    (a GPU's slow compiles), and decode the same tokens as each prompt's own shape."""
    from jaxspec.ppd import PpdGenerator

    cfg, params, _ = tiny
    prompts = [[5, 6, 7], list(range(3, 40)), list(range(10, 70))]  # buckets 16, 48, 64
    for make in (lambda: SpeculativeGenerator(cfg, params), lambda: PpdGenerator(cfg, params, 2)):
        own, one = make(), make()
        one.min_prompt_len = max(map(len, prompts))
        for prompt in prompts:
            assert one.generate(prompt, 12).token_ids == own.generate(prompt, 12).token_ids
        warm = one._warm if isinstance(one, PpdGenerator) else one._executables
        assert len(warm) == 1, "one shape for every prompt"


def test_stops_at_eos_and_max_new_tokens(tiny):
    """Without an EOS the answer runs to max_new_tokens exactly; with one, it ends at the
    first token that is the EOS (here a token the model does emit, first at position `at`)."""
    cfg, params, _ = tiny
    prompt = list(range(10, 30))
    free = dataclasses.replace(cfg, eos_token_ids=())
    full = SpeculativeGenerator(free, params).generate(prompt, max_new_tokens=40).token_ids
    assert len(full) == 40
    assert len(SpeculativeGenerator(free, params).generate(prompt, 3).token_ids) == 3
    at = next(i for i in range(4, 40) if full[i] not in full[:i])
    never = next(t for t in range(3, cfg.vocab_size) if t not in full)  # a second EOS id
    eos = dataclasses.replace(cfg, eos_token_ids=(never, full[at]))
    assert SpeculativeGenerator(eos, params).generate(prompt, 40).token_ids == full[: at + 1]


def test_bad_lengths_are_clear_errors(tiny):
    cfg, params, _ = tiny
    gen = SpeculativeGenerator(cfg, params, max_len=64)
    with pytest.raises(JaxspecError, match="empty prompt"):
        gen.generate([], 5)
    with pytest.raises(JaxspecError, match="exceeds the limit of 64 positions; shorten the prompt"):
        gen.generate(list(range(3, 63)), 10)
    with pytest.raises(JaxspecError, match=r"max-new-tokens\) must be an integer >= 1"):
        gen.generate([4], 0)
    with pytest.raises(
        JaxspecError, match=f"integer from 1 to the model's context of {cfg.max_position} positions"
    ):
        SpeculativeGenerator(cfg, params, max_len=cfg.max_position + 1)
    with pytest.raises(JaxspecError, match=r"max_len \(--max-len\) must be an integer .* got 0"):
        checked_max_len(0, cfg.max_position)


def test_a_request_that_fills_the_cache_exactly_fits():
    """3 prompt tokens + 509 new are the 512 positions: they fit, with the 2 slots written
    ahead past them; one more does not; the cache is the request's bucket, cut to the limit
    and those slots."""
    assert cache_len(3, 509, 2, 512) == 514
    with pytest.raises(JaxspecError, match="need 513 positions"):
        cache_len(3, 510, 2, 512)
    assert cache_len(3, 10, 2, 512) == 128  # the smallest cache
    assert cache_len(3, 100, 2, 110) == 112  # bucket 128, past the limit


def test_rates_leave_compilation_out():
    r = GenerationResult([1], [5, 6, 7, 8, 9, 10], steps=3, prefill_s=0.5, decode_s=1.0,
                         compile_s=7.0)  # fmt: skip
    assert (r.new_tokens, r.mean_accepted, r.tokens_per_s) == (6, 2.0, 4.0)


def test_bucket():
    sizes = (1, 16, 17, 24, 25, 33, 48, 49, 100, 200)
    assert [bucket(n, 16) for n in sizes] == [16, 16, 24, 24, 32, 48, 48, 64, 128, 256]


def test_sampling_takes_numpy_scalars_as_pythons():
    s = Sampling(np.float64(0.5), np.int64(3), np.float64(0.9), np.True_)
    assert s == Sampling(0.5, 3, 0.9, True) and (type(s.top_k), type(s.typical)) == (int, bool)


def test_sampling_is_reproducible(tiny):
    cfg, params, _ = tiny
    gen = SpeculativeGenerator(cfg, params, sampling=Sampling(temperature=1.0, top_p=0.9))
    a = gen.generate([5, 6, 7], 30, seed=1).token_ids
    assert a == gen.generate([5, 6, 7], 30, seed=1).token_ids
    assert a != gen.generate([5, 6, 7], 30, seed=2).token_ids


@pytest.mark.parametrize(
    "s",
    [
        Sampling(0.7),
        Sampling(1.3, top_k=5),
        Sampling(1.0, top_p=0.8),
        Sampling(0.9, 7, 0.6),
        Sampling(0.2, 10, 0.95),  # SDSAT's sampling setting
    ],
)
def test_warping_matches_hf_logits_processors(s):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 2
    scores = torch.tensor(logits)
    scores = TemperatureLogitsWarper(s.temperature)(None, scores)
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p < 1:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    ref = torch.softmax(scores, -1).numpy()
    ours = np.exp(np.asarray(warped_logprobs(jnp.asarray(logits), s)))
    np.testing.assert_allclose(ours, ref, atol=1e-6)


@pytest.mark.parametrize("path", ["_candidate_nucleus", "_sorted_nucleus"])
def test_nucleus_among_top_candidates_or_whole_vocabulary_matches_hf(monkeypatch, path):
    """top_p alone: on CPU each row's nucleus is sought among its top 2, then top 8 tokens,
    then the whole vocabulary, and rows below need each of the three (they keep 1, 5 and
    > 8 tokens); elsewhere every row is sorted whole. (tests/test_export.py checks which
    path each platform's program holds.)"""
    from transformers.generation.logits_process import TopPLogitsWarper

    monkeypatch.setattr(sampling, "_keep_nucleus", getattr(sampling, path))
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (2, 8))
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 3, 50)).astype(np.float32)
    logits[:, 0, 7] = 10.0  # one token holds > 0.9 of the mass
    logits[:, 1, 10:15] = 6.0  # five tokens hold it
    ref = torch.softmax(TopPLogitsWarper(0.9)(None, torch.tensor(logits.reshape(6, 50))), -1)
    ref = ref.numpy().reshape(2, 3, 50)
    ours = np.exp(np.asarray(warped_logprobs(jnp.asarray(logits), Sampling(1.0, top_p=0.9))))
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    kept = (ref[0] > 0).sum(-1)
    assert kept[0] == 1 and kept[1] == 5 and kept[2] > 8, kept


@pytest.mark.parametrize("path", ["_candidate_nucleus", "_sorted_nucleus"])
@pytest.mark.parametrize("top_k", [0, 4])
def test_top_p_stops_at_the_token_whose_mass_before_it_reaches_p(monkeypatch, path, top_k):
    """Four equal tokens (0.25 each, exact in float32), top_p 0.5: the mass before the
    third is exactly 0.5, so it is left out (as HF's TopPLogitsWarper does): two stay, the
    lower ids first among equals."""
    from transformers.generation.logits_process import TopPLogitsWarper

    monkeypatch.setattr(sampling, "_keep_nucleus", getattr(sampling, path))
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (2, 3))
    logits = jnp.zeros((1, 4))
    probs = np.exp(np.asarray(warped_logprobs(logits, Sampling(1.0, top_k, 0.5))))[0]
    np.testing.assert_allclose(probs, [0.5, 0.5, 0, 0], atol=1e-6)
    hf = TopPLogitsWarper(0.5)(None, torch.zeros((1, 4)))
    assert int(torch.isfinite(hf).sum()) == 2


def test_top_k_keeps_exactly_k_tokens_lower_ids_first_among_equals():
    logits = jnp.array([[1.0, 2.0, 2.0, 2.0, 0.0]])
    for top_p in (1.0, 0.99):
        probs = np.exp(np.asarray(warped_logprobs(logits, Sampling(1.0, 2, top_p))))[0]
        np.testing.assert_allclose(probs, [0, 0.5, 0.5, 0, 0], atol=1e-6)
    # top_p 1 is no nucleus: a kept token whose mass float32 rounds away (e^-30) still stays
    far = np.asarray(warped_logprobs(jnp.array([[0.0, -30.0, -40.0]]), Sampling(1.0, 2)))[0]
    np.testing.assert_allclose(far[:2], [0.0, -30.0], atol=1e-4)
    assert far[2] < -1e30


def test_sampled_frequencies_follow_the_warped_distribution():
    from scipy.stats import chisquare

    s = Sampling(temperature=0.8, top_p=0.9)
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(1, 8)), jnp.float32)
    n = 20000
    keys = position_keys(jax.random.key(0), jnp.arange(n))
    draws = np.asarray(jax.vmap(lambda k: select_tokens(logits, k[None], s)[0])(keys))
    probs = np.exp(np.asarray(warped_logprobs(logits, s)))[0]
    support = probs > 0
    assert set(np.unique(draws)) <= set(np.flatnonzero(support))
    counts = np.bincount(draws, minlength=8)[support]
    assert chisquare(counts, probs[support] * n).pvalue > 1e-3


def test_rows_sampling_one_position_draw_apart():
    """A batch's rows at the same position get their own keys: 64 draws from a uniform
    distribution over 101 tokens, not one draw repeated."""
    keys = position_keys(jax.random.key(0), jnp.full(64, 7))
    draws = select_tokens(jnp.zeros((64, 101)), keys, Sampling(1.0))
    assert len(set(np.asarray(draws).tolist())) > 20


def test_invalid_sampling_settings():
    with pytest.raises(JaxspecError, match="top-p"):
        Sampling(1.0, top_p=0)
    with pytest.raises(JaxspecError, match="temperature"):
        Sampling(-1.0)
    with pytest.raises(JaxspecError, match=r"typical \(--typical\) needs sampling"):
        Sampling(typical=True)
    Sampling(1.0, top_k=101).check_vocabulary(101)  # every token: no cut, but allowed
    with pytest.raises(JaxspecError, match="exceeds the vocabulary"):
        Sampling(1.0, top_k=102).check_vocabulary(101)
