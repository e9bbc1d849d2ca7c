"""PPD: exact greedy output over virtual devices, early predictions, bad settings."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.llama import init_params
from jaxspec.ppd import PpdGenerator, check_settings

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (virtual) devices")


def deep_tiny(name="tiny-gqa", n_layers=6):
    cfg = dataclasses.replace(preset(name), n_layers=n_layers, eos_token_ids=())
    return cfg, init_params(cfg, jax.random.key(0), scale=0.3)


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mqa"])
@pytest.mark.parametrize("k, layer", [(1, 3), (3, 3), (2, 4), (3, 5)])
def test_ppd_output_is_greedy(name, k, layer):
    cfg, params = deep_tiny(name)
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 40).token_ids
    gen = PpdGenerator(cfg, params, k, layer)
    assert gen.generate(prompt, 40).token_ids == ar
    assert any(gen.last_stats.matches)  # sub-processes' states were handed over


def test_a_trained_head_changes_the_guesses_not_the_output():
    cfg, params = deep_tiny()
    D = cfg.dim
    head = {"w": 0.5 * jax.random.normal(jax.random.key(1), (D, D)), "b": np.zeros(D)}
    prompt = [3, 1, 4, 1, 5]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    plain, trained = PpdGenerator(cfg, params, 2, 4), PpdGenerator(cfg, params, 2, 4, head)
    assert plain.generate(prompt, 30).token_ids == ar == trained.generate(prompt, 30).token_ids
    assert plain.last_stats.matches != trained.last_stats.matches


@pytest.mark.parametrize(
    "k, layer, devices, message",
    [
        (3, 2, 4, "below half the depth"),
        (3, 6, 4, "--ppd-layer must be in 1..5"),
        (4, 3, 4, "needs 5 devices, 4 found"),
        (0, 3, 4, "--ppd-k must be >= 1"),
    ],
)
def test_bad_settings_are_clear_errors(k, layer, devices, message):
    cfg, _ = deep_tiny()
    with pytest.raises(JaxspecError, match=message):
        check_settings(cfg, k, layer, devices)
