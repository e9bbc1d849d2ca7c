"""Logits parity with HF transformers in float32 on tiny random models."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec.checkpoint import load_checkpoint
from jaxspec.convert import convert
from jaxspec.kv_cache import causal_mask, init_cache
from jaxspec.llama import forward
from tests.conftest import VOCAB, save_tiny

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500.0,
    },
}


def jax_logits(ckpt, tokens, collect=()):
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    cache = init_cache(cfg, B, T + 3)
    logits, _, hidden = forward(
        params, cfg, jnp.asarray(tokens), positions, cache, causal_mask(B, T), collect
    )
    return np.asarray(logits), {k: np.asarray(v) for k, v in hidden.items()}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_logits_match_hf(tmp_path, n_kv_heads, tie, rope):
    hf_dir, model = save_tiny(tmp_path, n_kv_heads=n_kv_heads, tie=tie, rope=ROPES[rope])
    convert(hf_dir, tmp_path / "ours")
    cfg, _ = load_checkpoint(tmp_path / "ours")
    assert (cfg.rope_scaling.kind, cfg.n_kv_heads, cfg.tie_embeddings) == (rope, n_kv_heads, tie)
    # Positions up to 70 pass llama3's original_max_position (32): all rope bands are used.
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 71))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours, _ = jax_logits(tmp_path / "ours", tokens)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_hidden_states_match_hf(tiny_ckpt):
    ckpt, model = tiny_ckpt
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 13))
    with torch.no_grad():
        ref = model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    _, ours = jax_logits(ckpt, tokens, collect=(0, 1))
    for i in (0, 1):  # embeddings and the output of layer 0 (HF's last entry is normed)
        np.testing.assert_allclose(ours[i], ref[i].numpy(), atol=1e-4, rtol=1e-4)


def test_every_float32_product_asks_for_full_precision():
    """GPUs run float32 dots on TF32 tensor cores unless told otherwise; the model's
    float32 products must all ask for full precision (a no-op on CPU). Lowered under JAX's
    default precision: conftest's "highest" default would fill in a missing request."""
    import jax

    from jaxspec.config import preset
    from jaxspec.llama import init_params

    cfg = preset("tiny-gqa")
    params = init_params(cfg, jax.random.key(0))
    cache = init_cache(cfg, 1, 16)
    tokens, positions = jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None]
    run = jax.jit(lambda p, c: forward(p, cfg, tokens, positions, c, causal_mask(1, 3))[0])
    with jax.default_matmul_precision(None):
        hlo = run.lower(params, cache).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert dots and all("HIGHEST" in line for line in dots), dots[:2]
