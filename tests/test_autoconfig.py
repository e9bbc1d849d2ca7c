"""jaxspec.autoconfig on the tiny checkpoint with an untrained Medusa drafter: the choice is
the fastest lossless candidate by the recorded numbers; it is cached under $JAXSPEC_HOME,
read back without measuring, and measured again with remeasure, when the key changes or
when the cache file is damaged; a candidate whose tokens differ from AR's is excluded."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import pytest

from jaxspec import autoconfig
from jaxspec.checkpoint import load_checkpoint
from jaxspec.drafters.medusa import MedusaDrafter, MedusaSettings
from jaxspec.drafters.store import META, save_drafter

LABELS = {"float32 ar", "bfloat16 ar", "float32 medusa@chain-1", "bfloat16 medusa@chain-1"}


@pytest.fixture
def setup(tiny_ckpt, tmp_path, monkeypatch):
    """(run best_configuration, methods of the Generators built so far, the drafter folder,
    progress lines): a Medusa drafter for the tiny checkpoint, $JAXSPEC_HOME in tmp_path."""
    ckpt = tiny_ckpt[0]
    cfg, params = load_checkpoint(ckpt)
    folder = tmp_path / "drafters" / cfg.name / "medusa"
    heads = MedusaDrafter(cfg, 2).init(params, jax.random.key(0))
    save_drafter(folder, "medusa", MedusaSettings(n_heads=2), heads, cfg, "untrained")
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(autoconfig, "NEW_TOKENS", 16)
    built, lines = [], []

    class Counting(autoconfig.Generator):
        def __init__(self, model, method, **options):
            built.append(method)
            super().__init__(model, method, **options)

    monkeypatch.setattr(autoconfig, "Generator", Counting)

    def run(**kw):
        return autoconfig.best_configuration(
            ckpt, drafters=tmp_path / "drafters", progress=lines.append, **kw
        )

    return run, built, folder, lines


def test_the_fastest_lossless_candidate_is_chosen_and_cached(setup):
    run, built, _, _ = setup
    choice = run()
    assert {row.label for row in choice.table} == LABELS and len(built) == 4
    assert all(row.lossless for row in choice.table)  # greedy speculative decoding is AR
    assert choice.best.tokens_per_s == max(row.tokens_per_s for row in choice.table)
    ars = [row for row in choice.table if row.method == "ar"]
    assert choice.fastest_ar.tokens_per_s == max(row.tokens_per_s for row in ars)
    record = json.loads(choice.path.read_text())
    assert record["choice"] == {k: getattr(choice.best, k) for k in ("dtype", "method", "tree")}
    assert {"model", "jax", "backend", "device_kind", "cpu", "drafters"} <= set(record["key"])
    assert not choice.cached

    again = run()
    assert again.cached and len(built) == 4  # read back: nothing built, nothing measured
    assert (again.best, again.table, again.path) == (choice.best, choice.table, choice.path)
    assert not run(remeasure=True).cached and len(built) == 8


def test_a_changed_key_or_a_damaged_cache_is_measured_again(setup):
    run, built, folder, lines = setup
    first = run()
    meta = folder / META
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 10**9))
    second = run()
    assert not second.cached and second.path != first.path and len(built) == 8

    text = second.path.read_text()
    second.path.write_text(text[: len(text) // 2])  # cut short
    third = run()
    assert not third.cached and len(built) == 12
    assert any("damaged" in line for line in lines)
    assert json.loads(third.path.read_text())["key"] == json.loads(text)["key"]


def test_a_candidate_whose_tokens_differ_from_ar_is_excluded(setup, monkeypatch):
    run, _, _, lines = setup

    class Lossy(autoconfig.Generator):
        def generate(self, prompts, *args, **kw):
            result = super().generate(prompts, *args, **kw)
            if self.method != "medusa":
                return result
            return dataclasses.replace(result, token_ids=[t ^ 1 for t in result.token_ids])

    monkeypatch.setattr(autoconfig, "Generator", Lossy)
    choice = run()
    assert [row.lossless for row in choice.table if row.method == "medusa"] == [False, False]
    assert choice.best.method == "ar" and choice.best == choice.fastest_ar
    assert sum("excluded" in line for line in lines) == 2
