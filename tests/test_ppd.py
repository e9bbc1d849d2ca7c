"""PPD: exact greedy output over virtual devices, early predictions, bad settings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec.checkpoint import load_checkpoint
from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import init_cache
from jaxspec.llama import compute_params, init_params, lm_logits
from jaxspec.ppd import PpdGenerator, _put, check_settings, early_logits, place, stages
from tests.conftest import tiny_training_args, train_on_made_up_conversations

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


def test_a_zero_head_is_the_untrained_early_exit():
    """A head is a ResBlock, h + SiLU(h w + b): zero-initialised, the untrained early exit
    (no head); its bias counts (w = 0: h + SiLU(b))."""
    cfg, params = deep_tiny(n_layers=2)
    h = jax.random.normal(jax.random.key(2), (1, 3, cfg.dim))
    zero = {"w": jnp.zeros((cfg.dim, cfg.dim)), "b": jnp.zeros(cfg.dim)}
    untrained = lm_logits(params, cfg, h)
    np.testing.assert_array_equal(early_logits(params, cfg, None, h), untrained)
    np.testing.assert_allclose(early_logits(params, cfg, zero, h), untrained, rtol=1e-6)
    b = jnp.linspace(-1.0, 1.0, cfg.dim)
    biased = lm_logits(params, cfg, h + jax.nn.silu(b))
    np.testing.assert_allclose(early_logits(params, cfg, {**zero, "b": b}, h), biased, rtol=1e-5)


def test_stages_and_where_the_sub_processes_run():
    """Each run of model_split devices is a stage; the main stage is the first, the k
    sub-processes take one each, or share the rest in turn (with a warning) when there are
    fewer than k + 1."""
    devices = jax.devices()[:4]
    assert stages(devices, 1) == devices
    assert [list(s.devices.flat) for s in stages(devices, 2)] == [devices[:2], devices[2:]]
    assert [list(s.devices.flat) for s in stages(devices[:3], 2)] == [devices[:2]]
    assert place(list("abcd"), 3) == ("a", ["b", "c", "d"])
    for found, k, shared in [("abc", 3, "bcb"), ("a", 2, "aa")]:
        with pytest.warns(RuntimeWarning, match=f"{k} sub-processes on {len(set(shared))} shared"):
            assert place(list(found), k) == ("a", list(shared))
    # On a stage of 2, a cache's keys and values are split by kv heads, its lengths whole.
    cache = _put(init_cache(deep_tiny()[0], 1, 8), stages(devices[:2], 2)[0])
    split = P(None, "model", None, None)  # [B,K,S,H]
    assert cache.keys[0].sharding.spec == cache.values[-1].sharding.spec == split
    assert cache.lengths.sharding.is_fully_replicated


@pytest.mark.parametrize("products", ["plain-prefill", "plain"])
def test_ppd_multiplies_as_ar_does(products):
    """bfloat16 weights with one-pass products (a GPU's default: the prefill's): PPD's
    tokens are AR's with the same products (split stages: test_mesh)."""
    cfg, params = deep_tiny()
    params = compute_params(params, jnp.bfloat16)
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params, products=products).generate(prompt, 30).token_ids
    gen = PpdGenerator(cfg, params, 2, 3, products=products)
    assert gen.generate(prompt, 30).token_ids == ar


@pytest.mark.parametrize("products", ["exact", "plain-prefill"])
def test_a_long_prompt_is_prefilled_in_ar_s_chunks(products):
    """A prompt over the chunk size is prefilled chunk by chunk, as SpeculativeGenerator
    does (the same bits under one-pass products): AR's tokens."""
    cfg, params = deep_tiny()
    params = compute_params(params, jnp.bfloat16)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, cfg.vocab_size, 37)]
    ar = SpeculativeGenerator(cfg, params, products=products, prefill_chunk=16)
    want = ar.generate(prompt, 20).token_ids
    gen = PpdGenerator(cfg, params, 2, 3, products=products, prefill_chunk=16)
    assert gen.generate(prompt, 20).token_ids == want
    assert any(chunked and P == 16 for P, _, chunked in gen._warm)  # compiled in chunks


def test_a_trained_head_changes_the_guesses_not_the_output():
    cfg, params = deep_tiny()
    D = cfg.dim
    head = {"w": 0.5 * jax.random.normal(jax.random.key(1), (D, D)), "b": np.zeros(D)}
    prompt = [3, 1, 4, 1, 5]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    plain, trained = PpdGenerator(cfg, params, 2, 4), PpdGenerator(cfg, params, 2, 4, head)
    assert plain.generate(prompt, 30).token_ids == ar == trained.generate(prompt, 30).token_ids
    assert plain.last_stats.matches != trained.last_stats.matches


@pytest.mark.parametrize("method", ["ar", "ppd"])
def test_compilation_is_reported_and_kept_out_of_the_timings(tiny_ckpt, method):
    """AR's contract, for PPD too: the first call in a prompt bucket and cache length
    reports its compilation as compile_s and compiles nothing once tokens stream (so the
    timings behind tokens/s exclude it); a second call in those buckets compiles nothing."""
    cfg, params = load_checkpoint(tiny_ckpt[0], jnp.float32)
    cfg = dataclasses.replace(cfg, eos_token_ids=())
    gen = SpeculativeGenerator(cfg, params) if method == "ar" else PpdGenerator(cfg, params, 2, 1)
    events: list[str] = []

    def on_compile(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append("compile")

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        first = gen.generate([5, 6, 7], 30, on_tokens=lambda ids: events.append("tokens"))
        streamed = events[events.index("tokens") :]
        events.clear()
        again = gen.generate([9, 8, 7, 6], 25)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert first.compile_s > 0 and "compile" not in streamed and len(first.token_ids) == 30
    assert again.compile_s == 0 and events == []


@pytest.mark.parametrize("n_devices", [1, 2])
def test_fewer_devices_than_k_plus_1_share_them_and_stay_greedy(n_devices):
    """Also: generate_batch streams each row's tokens (the first included) under the row's
    index, a row ends at its first end token as AR's would, and the early-exit layer
    defaults to half the depth, rounded up."""
    cfg, params = deep_tiny()
    prompts = [[5, 6, 7], [3, 1, 4, 1]]
    ar = SpeculativeGenerator(cfg, params)
    free = [ar.generate(p, 16).token_ids for p in prompts]  # no end token
    eos = free[0][9]
    with pytest.warns(
        RuntimeWarning, match=f"3 sub-processes on 1 shared device.*{n_devices} found"
    ):
        gen = PpdGenerator(dataclasses.replace(cfg, eos_token_ids=(eos,)), params, 3,
                           devices=jax.devices()[:n_devices])  # fmt: skip
    assert set(gen.subs) == set(jax.devices()[max(n_devices - 1, 0) : n_devices])
    assert gen.layer == 3
    streamed: dict[int, list[int]] = {0: [], 1: []}
    got = gen.generate_batch(prompts, 16, on_tokens=lambda row, ids: streamed[row].extend(ids))
    want = [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in free]
    assert [r.token_ids for r in got] == want == [streamed[0], streamed[1]]


def test_a_prompt_bucket_longer_than_the_cache_is_cut_to_it():
    """A 17-token prompt (bucket 24) and 3 new tokens fill a 20-slot cache exactly, as
    the pipeline needs; one more token is refused."""
    cfg, params = deep_tiny(n_layers=4)
    prompt = list(range(3, 20))
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 3).token_ids
    gen = PpdGenerator(cfg, params, 2, 2, max_len=20)
    assert gen.generate(prompt, 3).token_ids == ar
    assert any(gen.last_stats.matches)  # a handed-over guess was committed
    with pytest.raises(JaxspecError, match="need 21 positions"):
        gen.generate(prompt, 4)


@pytest.mark.parametrize(
    "k, layer, message",
    [
        (3, 2, "below half the depth"),
        (3, 6, r"ppd_layer \(--ppd-layer\) must be in 1..5"),
        (0, 3, r"ppd_k \(--ppd-k\) must be >= 1"),
    ],
)
def test_bad_settings_are_clear_errors(k, layer, message):
    cfg, _ = deep_tiny()
    with pytest.raises(JaxspecError, match=message):
        check_settings(cfg, k, layer)


def test_ppd_training_resumes_and_ships_heads(tiny_ckpt, tmp_path):
    import train.ppd as ppd
    from jaxspec.methods import build_generator
    from jaxspec.models import load_model

    common = [*tiny_training_args(tiny_ckpt[0], tmp_path, train_seqs=6, test_seqs=3,
                                  new_tokens=16), "--layers", "1,2", "--rows", "8",
              "--overwrite"]  # fmt: skip
    first, second = train_on_made_up_conversations(
        ppd, [*common, "--steps", "2"], [*common, "--steps", "4"]
    )
    assert first["steps"] == 2 and second["steps"] == 4
    assert first["final_loss"] != second["final_loss"]
    rates = second["p_correct"]["layer1"]
    assert 0 <= rates["untrained"]["top1"] <= rates["untrained"]["top5"] <= 1
    assert second["default_layer"] in (1, 2)
    model = load_model(tiny_ckpt[0])
    gen = build_generator(model, "ppd", tmp_path / "out", ppd_k=2, ppd_layer=1)
    assert gen.head is not None
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(model.cfg, model.params).generate(prompt, 20).token_ids
    assert gen.generate(prompt, 20).token_ids == ar
