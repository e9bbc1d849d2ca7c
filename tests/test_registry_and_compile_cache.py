"""The method table's checks and bench-row syntax (jaxspec.drafters.registry), and the
compile cache's block (jaxspec.compile_cache): pure logic, no model, no compiles."""

from __future__ import annotations

import re

import jax
import pytest

from jaxspec import compile_cache as cc
from jaxspec.drafters.registry import MAX_PPD_K, check_options, method, parse_row, row_source
from jaxspec.errors import JaxspecError


def test_bench_rows_set_each_methods_own_options():
    assert parse_row("firp@searched-8/4") == ("firp", {"tree": "searched-8", "firp_chains": 4}, "")
    assert parse_row("firp/0") == ("firp", {"firp_chains": 0}, "")
    assert parse_row("sdsat/one-forward:bfloat16") == (
        "sdsat",
        {"sdsat_loop": "one-forward"},
        "bfloat16",
    )
    assert parse_row("ppd@2") == ("ppd", {"ppd_layer": 2}, "")
    assert parse_row("lookup#mine@comb-2-2") == ("lookup", {"tree": "comb-2-2"}, "")


@pytest.mark.parametrize(
    "row, message",
    [
        ("medusa@", "medusa@: @TREE (a tree preset or one the drafter ships) expected, got ''"),
        ("medusa# @cpu-8", "a label expected after #"),
        ("ppd@0", "@LAYER (the early-prediction layer, a number) expected, got '0'"),
        ("firp/²", "/N (FIRP's pseudo chains on N nodes, N >= 0) expected, got '²'"),
    ],
)
def test_bench_rows_refuse_empty_or_out_of_range_parts(row, message):
    with pytest.raises(JaxspecError, match=re.escape(message)):
        parse_row(row)


def test_row_source_is_the_method_and_label_without_options_or_dtype():
    assert row_source("medusa#zero@cpu-8+2:bfloat16") == "medusa#zero"
    assert row_source("medusa#zero:bfloat16") == "medusa#zero"
    assert row_source("firp/4") == "firp"


def test_option_checks_take_their_bounds_and_refuse_bools_and_blank_trees():
    check_options(method("ppd"), ppd_k=1, ppd_layer=1)
    check_options(method("ppd"), ppd_k=MAX_PPD_K)
    check_options(method("firp"), firp_chains=0, retrieval=1)
    for m, options, message in [
        (
            "ppd",
            {"ppd_k": MAX_PPD_K + 1},
            f"ppd_k (--ppd-k) must be a whole number from 1 to {MAX_PPD_K}",
        ),
        (
            "firp",
            {"firp_chains": True},
            "firp_chains (--firp-chains) must be a whole number >= 0, got True",
        ),
        (
            "eagle",
            {"retrieval": True},
            "retrieval (--retrieval) must be a whole number >= 1, got True",
        ),
        ("ar", {"tree": ""}, "tree (--tree) picks a draft tree; method 'ar' has none"),
    ]:
        with pytest.raises(JaxspecError, match=re.escape(message)):
            check_options(method(m), **options)


def test_an_unknown_method_lists_the_known_ones():
    with pytest.raises(JaxspecError, match="unknown method 'hydra'; available: ar, medusa, "):
        method("hydra")


def test_compiles_are_slow_on_every_accelerator(monkeypatch):
    for backend, slow in [("cpu", False), ("gpu", True), ("tpu", True)]:
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert cc.compiles_are_slow() == slow


def test_the_default_cache_lies_in_jaxspec_home(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path))
    assert cc.default_dir() == tmp_path / "xla-cache"


@pytest.fixture
def thresholds_not_zero():
    """The cache thresholds away from the 0s compile_cache sets (and conftest sets for the
    session), so that the block's setting and restoring them shows; restored after."""
    session = {name: getattr(jax.config, name) for name in cc.SETTINGS}
    for name, sentinel in zip(cc.SETTINGS, (5.0, 123), strict=True):
        jax.config.update(name, sentinel)
    yield
    for name, value in session.items():
        jax.config.update(name, value)


def test_compile_cache_counts_its_blocks_events_and_restores_jax_config(
    tmp_path, thresholds_not_zero
):
    """Events are recorded by hand (jax decides once per process whether to use a cache)."""
    names = ("jax_compilation_cache_dir", *cc.SETTINGS)
    before = {name: getattr(jax.config, name) for name in names}
    folder = tmp_path / "a" / "xla"
    with cc.compile_cache(folder) as stats:
        assert jax.config.jax_compilation_cache_dir == str(folder)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # every program kept
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
        for event in (cc.REQUESTS, cc.REQUESTS, cc.HITS, "/jax/other"):
            jax.monitoring.record_event(event)
        jax.monitoring.record_event_duration_secs(cc.SAVED, 1.234)
        jax.monitoring.record_event_duration_secs("/jax/other_sec", 5.0)
    want = {"dir": str(folder), "requests": 2, "hits": 1, "saved_s": 1.23}
    assert stats == want
    jax.monitoring.record_event(cc.REQUESTS)  # after the block: not counted
    jax.monitoring.record_event_duration_secs(cc.SAVED, 1.0)
    assert stats == want
    assert {name: getattr(jax.config, name) for name in names} == before
    with cc.compile_cache(None) as stats:
        assert jax.config.jax_compilation_cache_dir == before["jax_compilation_cache_dir"]
    assert stats == {"dir": None, "requests": 0, "hits": 0, "saved_s": 0.0}
