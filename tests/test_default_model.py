"""The real default model (SmolLM2-135M-Instruct) against HF transformers' own GGUF import."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPT = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def models():
    import torch
    from transformers import AutoModelForCausalLM

    from jaxspec.convert.default_model import packaged_gguf
    from jaxspec.models import load_model

    gguf = packaged_gguf()  # transformers dequantises and un-permutes it independently of us
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return load_model(), hf.eval()


def test_logits_match_hf(models):
    import torch

    from jaxspec.kv_cache import causal_mask, init_cache
    from jaxspec.llama import forward
    from jaxspec.text import encode_prompt

    ours, hf = models
    ids = np.array([encode_prompt(ours.tokenizer, PROMPT)])
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    T = ids.shape[1]
    logits, _, _ = forward(
        ours.params, ours.cfg, jnp.asarray(ids), jnp.arange(T)[None],
        init_cache(ours.cfg, 1, T), causal_mask(1, T),
    )  # fmt: skip
    # 30 float32 layers with logits up to ~35 in size: summation order alone moves a few
    # of the 1.8M logits by ~1e-4 (tiny models are held to 1e-4 in test_parity_hf).
    np.testing.assert_allclose(np.asarray(logits), ref, atol=5e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(logits).argmax(-1), ref.argmax(-1))


def test_generate_cli_equals_hf_greedy(models, capsys):
    import torch

    from infer.generate import main
    from jaxspec.text import encode_prompt

    ours, hf = models
    main(["--method", "ar", "--json", "--max-new-tokens", "32", PROMPT])
    got = json.loads(capsys.readouterr().out)
    ids = encode_prompt(ours.tokenizer, PROMPT)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2)
    assert got["token_ids"] == ref[0, len(ids) :].tolist()
    assert len(got["token_ids"]) >= 16


def test_random_drafter_is_lossless_on_the_default_model(models):
    from jaxspec.decode import SpeculativeGenerator
    from jaxspec.text import encode_prompt
    from jaxspec.tree import tree_preset
    from tests.drafters import RandomDrafter

    ours, _ = models
    ids = encode_prompt(ours.tokenizer, PROMPT)
    ar = SpeculativeGenerator(ours.cfg, ours.params).generate(ids, 24).token_ids
    drafter = RandomDrafter(ours.cfg.vocab_size)
    spec = SpeculativeGenerator(ours.cfg, ours.params, drafter, None, tree_preset("cpu-16"))
    assert spec.generate(ids, 24).token_ids == ar


@pytest.mark.parametrize(
    "method, tree",
    [
        ("medusa", None),
        ("firp", None),
        ("firp", "searched-16"),
        ("chimera", None),
        ("chimera", "searched-16"),
        ("sdsat", None),
        ("sdsat", "comb-6-3"),
        ("eagle", None),
        ("eagle", "dynamic-16"),
        ("chimera", "dynamic-16"),
    ],  # fmt: skip
)
def test_shipped_drafters_are_lossless_on_the_default_model(models, method, tree):
    from jaxspec.methods import build_generator
    from jaxspec.text import encode_prompt

    ours, _ = models
    ids = encode_prompt(ours.tokenizer, "Write a short poem about the sea.")
    ar = build_generator(ours, "ar").generate(ids, 48)
    spec = build_generator(ours, method, tree=tree).generate(ids, 48)  # shipped drafter
    assert spec.token_ids == ar.token_ids
    # Drafts were accepted (an SDSAT loop emits >= 2 tokens even with none accepted).
    assert spec.steps < (ar.steps + 1) // 2 if method == "sdsat" else spec.steps < ar.steps


@pytest.mark.parametrize("layer", [None, 25])
def test_ppd_is_greedy_on_the_default_model(models, layer):
    """4 virtual devices (tests/conftest.py), k = 3, the shipped head for the layer."""
    from jaxspec.methods import build_generator
    from jaxspec.text import encode_prompt

    ours, _ = models
    ids = encode_prompt(ours.tokenizer, "Write a short poem about the sea.")
    ar = build_generator(ours, "ar").generate(ids, 48)
    gen = build_generator(ours, "ppd", ppd_k=3, ppd_layer=layer)
    assert gen.head is not None  # the shipped heads cover the default and layer 25
    assert gen.generate(ids, 48).token_ids == ar.token_ids
    assert any(gen.last_stats.matches)


@pytest.mark.parametrize("method", ["medusa", "firp"])
def test_bfloat16_weights_stay_lossless_on_the_default_model(models, method):
    """With bfloat16 weights the products stay float32-accurate (`layers.dense`), so a
    16-node tree gives bfloat16 AR's tokens (bfloat16 activations flipped near-ties here)."""
    import dataclasses

    from jaxspec.llama import compute_params
    from jaxspec.methods import build_generator
    from jaxspec.text import encode_prompt

    ours, _ = models
    bf16 = dataclasses.replace(ours, params=compute_params(ours.params, "bfloat16"))
    for prompt in ("Write a short poem about the sea.", "What is 17 times 23? Explain."):
        ids = encode_prompt(bf16.tokenizer, prompt)
        ar = build_generator(bf16, "ar").generate(ids, 48)
        spec = build_generator(bf16, method, tree="searched-16").generate(ids, 48)
        assert spec.token_ids == ar.token_ids
        assert spec.steps < ar.steps


def test_the_shipped_drafters_were_trained_for_the_default_model(models):
    """Their stamps are the default model's weights (in either dtype): no warning."""
    from jaxspec.drafters.store import base_weights
    from jaxspec.methods import DRAFTERS_DIR
    from jaxspec.models import load_model

    model = models[0]
    stamps = {base_weights(p.parent) for p in DRAFTERS_DIR.glob(f"{model.cfg.name}/*/drafter.json")}
    assert stamps == {model.fingerprint} == {load_model(dtype="bfloat16").fingerprint}
