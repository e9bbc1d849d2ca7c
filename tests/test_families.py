"""The Llama family as people use it: a tiny random Llama 3.2 (tied, llama3 RoPE, two eos
ids), Mistral (a sliding window shorter than the prompt + new tokens), Qwen2 (q/k/v biases,
tied) and Qwen3 (per-head q/k norms, head_dim 16 != 48 / 4 heads), made with transformers'
own config classes and saved with save_pretrained (tests/conftest.py). Each converts with
jaxspec-convert; its logits equal HF's over a prefill and a cached decode; jaxspec-generate
and `jaxspec.load_model` give `generate`'s greedy tokens; HF export reloads in transformers
with the same weights. Every method decodes losslessly on Qwen3 and on Mistral, and every
trainer runs on them."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from checkpoints_convert.cli import main as convert_main
from infer.generate import main as generate_main
from jaxspec.checkpoint import load_checkpoint
from jaxspec.convert import convert
from jaxspec.kv_cache import causal_mask, commit, init_cache
from jaxspec.llama import forward
from tests.conftest import (
    FAMILIES,
    FAMILY_WINDOW,
    VOCAB,
    save_tiny_family,
    tiny_training_args,
    train_on_made_up_conversations,
)
from tests.test_api import TREE, options, write_drafters

# 22 words: with the chat template's tokens the prompt alone is longer than Mistral's window.
PROMPT = " ".join(f"w{i}" for i in range(5, 93, 4))
N = 20  # new tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """family -> (HF folder, jaxspec checkpoint made by jaxspec-convert, the HF model)."""
    tmp = tmp_path_factory.mktemp("families")
    made = {}
    for family in FAMILIES:
        folder, model = save_tiny_family(tmp, family)
        convert_main([str(folder), "--out", str(tmp / f"{family}-ckpt")])
        made[family] = (folder, tmp / f"{family}-ckpt", model)
    return made


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def cached_logits(cfg, params, tokens: np.ndarray, prefill: int) -> np.ndarray:
    """Logits [B,T,V] of a prefill of the first `prefill` tokens, then one token a step
    through the cache."""
    B, T = tokens.shape
    cache = init_cache(cfg, B, T + 4)
    step = jax.jit(lambda c, t, p, m: forward(params, cfg, t, p, c, m))
    out = []
    for start, stop in [(0, prefill), *((t, t + 1) for t in range(prefill, T))]:
        positions = jnp.broadcast_to(jnp.arange(start, stop), (B, stop - start))
        logits, block, _ = step(cache, jnp.asarray(tokens[:, start:stop]), positions,
                                causal_mask(B, stop - start))  # fmt: skip
        cache = commit(cache, block, jnp.full((B,), stop - start, jnp.int32))
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_over_prefill_and_cached_decode(models, family):
    _, ckpt, model = models[family]
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    expected = {"llama3.2": ("llama", True, False, False, 0, (2, 3)),
                "mistral": ("mistral", False, False, False, FAMILY_WINDOW, (2,)),
                "qwen2": ("qwen2", True, True, False, 0, (2,)),
                "qwen3": ("qwen3", False, False, True, 0, (2,))}[family]  # fmt: skip
    got = (cfg.family, cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window,
           cfg.eos_token_ids)  # fmt: skip
    assert got == expected
    if family == "qwen3":
        assert cfg.head_dim == 16 and cfg.dim // cfg.n_heads == 12
    if family == "qwen2":  # transformers 5's rope_parameters
        assert cfg.rope_theta == 1e6
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40))  # past the window (16)
    ref = hf_logits(model, tokens)
    ours = cached_logits(cfg, params, tokens, prefill=24)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    if cfg.sliding_window:  # the window matters: without it the late positions differ
        full = cached_logits(dataclasses.replace(cfg, sliding_window=0), params, tokens, 24)
        np.testing.assert_allclose(full[:, :FAMILY_WINDOW], ref[:, :FAMILY_WINDOW], atol=1e-4)
        assert np.abs(full[:, FAMILY_WINDOW:] - ref[:, FAMILY_WINDOW:]).max() > 1e-2


def test_within_window_literal():
    """Window 2: a query sees its own position and the one before (causality is the other
    mask's job)."""
    from jaxspec.llama import within_window

    got = within_window(jnp.array([[2, 3]]), jnp.arange(4)[None], 2)
    np.testing.assert_array_equal(got[0], [[0, 1, 1, 1], [0, 0, 1, 1]])


def test_window_holds_across_prefill_chunks(models):
    """Mistral's window when a long prompt is prefilled in 8-token chunks (each chunk
    attends over the cache written before it): HF's greedy tokens, as one shot gives."""
    from jaxspec.decode import SpeculativeGenerator

    _, ckpt, model = models["mistral"]
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    prompt = np.random.default_rng(2).integers(5, VOCAB, 30).tolist()
    one_shot = SpeculativeGenerator(cfg, params).generate(prompt, N).token_ids
    chunked = SpeculativeGenerator(cfg, params, prefill_chunk=8).generate(prompt, N).token_ids
    assert chunked == one_shot == hf_greedy(model, prompt)


def test_window_over_a_context_block_is_by_position():
    """run_layers' context_block (T' uncommitted tokens right after each row's committed
    ones, as FIRP's and SDSAT's drafts read a prompt's forward) under a sliding window: the
    block's keys sit at positions length + t, so the hidden states are those of committing
    the block first. Rows of 6 and 9 committed tokens; the window (4) hides the oldest."""
    from jaxspec.config import preset
    from jaxspec.llama import embed, init_params, run_layers

    cfg = dataclasses.replace(preset("tiny-gqa"), family="mistral", sliding_window=4)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    rng = np.random.default_rng(0)
    B, S, P, T = 2, 32, 5, 3
    lengths = jnp.array([6, 9], jnp.int32)
    prompt, context, chain = (jnp.asarray(rng.integers(3, 97, (B, n))) for n in (9, P, T))

    def positions(start, n):
        return start[:, None] + jnp.arange(n)

    def run(tokens, pos, cache, **kw):
        h = embed(params, tokens)
        return run_layers(params, cfg, h, pos, cache, causal_mask(B, pos.shape[1]), **kw)

    zero = jnp.zeros((B,), jnp.int32)
    cache = commit(init_cache(cfg, B, S), run(prompt, positions(zero, 9), None)[1], lengths)
    _, block, _ = run(context, positions(lengths, P), cache)
    committed = jnp.arange(S) < lengths[:, None, None]  # [B,1,S]
    sees = jnp.concatenate(
        [jnp.broadcast_to(committed, (B, T, S)), jnp.ones((B, T, P), bool)], axis=-1
    )
    at = positions(lengths + P, T)
    got, _, _ = run(chain, at, cache, context_mask=sees, context_block=block)
    want, _, _ = run(chain, at, commit(cache, block, jnp.full((B,), P, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-4)  # hidden states ~50


def test_every_norm_reads_the_configs_epsilon(tmp_path):
    """Qwen3 (input, post-attention, final and per-head q/k norms) with rms_norm_eps 0.1,
    large enough to move the logits (1e-5 hardly does): a norm that used another epsilon
    would show."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_family_config

    config = tiny_family_config("qwen3")
    config.rms_norm_eps = 0.1
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.15 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ours")
    cfg, params = load_checkpoint(tmp_path / "ours", jnp.float32)
    assert cfg.norm_eps == 0.1
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 20))
    ours = cached_logits(cfg, params, tokens, prefill=12)
    np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=1e-4, rtol=1e-4)


def hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=N, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf_generate(models, family, capsys):
    """jaxspec-generate on the converted checkpoint and `load_model` on the HF folder itself
    give transformers' greedy tokens for the same prompt ids."""
    folder, ckpt, model = models[family]
    capsys.readouterr()
    generate_main(["--model", str(ckpt), "--json", "--max-new-tokens", str(N), PROMPT])
    cli = json.loads(capsys.readouterr().out)
    result = jaxspec.Generator(jaxspec.load_model(folder, dtype="float32")).generate(
        PROMPT, max_new_tokens=N
    )
    assert cli["prompt_tokens"] == len(result.prompt_ids) > FAMILY_WINDOW
    expected = hf_greedy(model, result.prompt_ids)
    assert cli["token_ids"] == result.token_ids == expected
    assert len(expected) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_export_reloads_in_transformers(models, family, tmp_path):
    from transformers import AutoModelForCausalLM

    _, ckpt, model = models[family]
    convert(ckpt, tmp_path / "back", to="hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(back) is type(model)
    if family == "mistral":
        assert back.config.sliding_window == FAMILY_WINDOW
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    tokens = np.arange(5, 45)[None]
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(model, tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_benchmark_peer_row_runs_the_family_in_transformers(models, family, tmp_path, capsys):
    """jaxspec-bench's `hf` row builds the family's own transformers class from the
    checkpoint and decodes AR's tokens (a Llama class would ignore biases, norms, window)."""
    from infer.bench import main as bench_main

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "a", "turns": [PROMPT]}))
    out = tmp_path / "r.json"
    bench_main(["--model", str(models[family][1]), "--methods", "ar,hf", "--questions",
                str(questions), "--max-new-tokens", str(N), "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["methods"]
    assert rows["hf"]["match_ar"] == 1.0 and rows["hf"]["new_tokens"] == N


@pytest.mark.parametrize(
    "family",
    ["qwen3", pytest.param("mistral", marks=pytest.mark.slow)],  # ~30 s each
)
def test_every_method_decodes_losslessly(models, family, tmp_path):
    """Untrained drafters (losslessness does not depend on their quality) with a tree of the
    top 10 guesses at two depths: every method's tokens are AR's, which are HF's."""
    folder, ckpt, model = models[family]
    drafters = write_drafters(ckpt, tmp_path)
    loaded = jaxspec.load_model(ckpt, dtype="float32")
    ar = jaxspec.Generator(loaded).generate(PROMPT, max_new_tokens=N)
    assert ar.token_ids == hf_greedy(model, ar.prompt_ids)
    for method in jaxspec.METHODS[1:]:
        out = jaxspec.Generator(loaded, method, **options(method, drafters)).generate(
            PROMPT, max_new_tokens=N
        )
        assert out.token_ids == ar.token_ids, method
        if method not in ("ppd", "lookup"):  # lookup finds nothing to copy in this prompt
            assert out.steps < ar.steps, f"{method} accepted no drafted token ({TREE})"


TRAINERS = {
    "medusa": ["--seq-len", "64", "--heads", "2"],
    "firp": ["--anchors", "8", "--layers", "1,2"],
    "chimera": ["--rows", "8", "--heads", "2"],
    "sdsat": ["--spans", "4", "--window", "3", "--rank", "2", "--ids", "2", "--cpu-tree",
              "chain-3"],
    "ppd": ["--layers", "1", "--rows", "8"],
    "eagle": ["--rows", "6", "--ttt", "2", "--depth", "2", "--guess-vocab", "30"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("method", list(TRAINERS))
def test_every_trainer_trains_on_the_family(models, family, method, tmp_path):
    import importlib

    trainer = importlib.import_module(f"train.{method}")
    _, ckpt, _ = models[family]
    args = [*tiny_training_args(ckpt, tmp_path, train_seqs=4, test_seqs=2, new_tokens=16),
            *TRAINERS[method], "--steps", "2"]  # fmt: skip
    train_on_made_up_conversations(trainer, args)
    model = jaxspec.load_model(ckpt)
    assert jaxspec.load_drafter(model, method, tmp_path / "out").params
