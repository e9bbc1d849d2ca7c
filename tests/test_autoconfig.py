"""jaxspec.autoconfig on the tiny checkpoint with an untrained Medusa drafter: the choice is
the fastest lossless candidate by the recorded numbers; it is cached under $JAXSPEC_HOME,
read back without measuring, and measured again with remeasure, when the key changes or
when the cache file is damaged; a candidate whose tokens differ from AR's is excluded."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import pytest

from jaxspec import autoconfig
from jaxspec.checkpoint import load_checkpoint
from jaxspec.drafters.medusa import MedusaDrafter, MedusaSettings
from jaxspec.drafters.store import META, save_drafter
from jaxspec.generate import GenerationResult

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
    # other prompts or lengths measure another protocol: not this cache's
    assert record["key"]["protocol"] == {"prompts": list(autoconfig.PROMPTS), "new_tokens": 16}
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


def test_the_demo_says_why_and_compares_with_ar_in_both_dtypes(monkeypatch, capsys):
    """`make demo` (infer/demo.py) on a made-up choice: bfloat16 Medusa at 30 tokens/s, the
    fastest AR float32's at 20. Its tokens are checked against AR in bfloat16 (the same
    model), its speed against AR in float32 (a stand-in Generator decodes)."""
    from infer import demo

    Row = autoconfig.Row
    best = Row("bfloat16", "medusa", "chain-1", 30.0, 2.0, lossless=True)
    ar32, ar16 = (
        Row("float32", "ar", None, 20.0, 1.0, True),
        Row("bfloat16", "ar", None, 10.0, 1.0, True),
    )
    table = (best, ar32, ar16, Row("float32", "medusa", "chain-1", 9.0, 2.0, lossless=False))
    choice = autoconfig.Choice(best, ar32, table, "2026-01-02T03:04:05", 12.3, Path("c.json"), True)
    assert demo.summary(choice) == (
        "measured 3 lossless configurations here on 2026-01-02T03:04:05 in 12 s (cached in "
        "c.json; --remeasure to redo): bfloat16 medusa@chain-1 is fastest, 1.50x the fastest "
        "AR there"
    )

    def decoded(tokens, tokens_per_s):  # 60 tokens
        return GenerationResult([5], tokens * 20, 60, 0.0, 60 / tokens_per_s, 0.0)

    class AR:
        def __init__(self, model):
            self.model = model

        def generate(self, prompt, max_new_tokens):
            return (
                decoded([6, 7, 8], 10.0) if self.model == "bfloat16" else decoded([6, 7, 9], 20.0)
            )

    monkeypatch.setattr(demo, "Generator", AR)
    monkeypatch.setattr(demo, "load_model", lambda dtype: dtype)
    capsys.readouterr()
    demo.compare_with_ar("bfloat16", choice, "hi", decoded([6, 7, 8], 30.0))
    assert capsys.readouterr().out.splitlines() == [
        "[float32 ar] 20.0 tokens/s -> speedup 1.50x over the fastest AR here (float32)",
        "outputs identical to bfloat16 AR: True",
    ]


def test_each_candidate_is_scored_against_ar_in_its_own_dtype(monkeypatch):
    """measure() with stand-in generators that decode 6 tokens a prompt in 1 s of prefill
    and 2 s of decoding (after 50 s of compiling), bfloat16 other tokens than float32 (a
    slightly different model): every built row is lossless against AR in its own dtype, its
    rate counts the prefill but not the compilation, and a row that cannot be built reports
    its exception by name."""
    Row = autoconfig.Row

    class Decoding:
        def __init__(self, row):
            self.row = row

        def generate(self, prompt, max_new_tokens):
            tokens = [5, 6] * 3 if self.row.dtype == "float32" else [5, 7] * 3
            steps = 6 if self.row.method == "ar" else 3
            return GenerationResult([1], tokens, steps, 1.0, 2.0, 50.0)

    def warm(model, row, drafters):
        assert model == row.dtype
        if row.method == "eagle":
            raise KeyError("layers")
        return Decoding(row)

    monkeypatch.setattr(autoconfig, "load_model", lambda model_dir, dtype: dtype)
    monkeypatch.setattr(autoconfig, "_warm_generator", warm)
    configs = [("ar", None), ("medusa", "chain-1"), ("eagle", "x")]
    rows = [Row(d, m, t) for m, t in configs for d in ("float32", "bfloat16")]
    lines = []
    table = {row.label: row for row in autoconfig.measure(rows, Path("m"), Path("d"), lines.append)}
    for dtype in ("float32", "bfloat16"):
        assert table[f"{dtype} ar"] == Row(dtype, "ar", None, 2.0, 1.0, lossless=True)
        medusa = table[f"{dtype} medusa@chain-1"]
        assert medusa == Row(dtype, "medusa", "chain-1", 2.0, 2.0, lossless=True)
        assert table[f"{dtype} eagle@x"].error == "KeyError: 'layers'"
    assert "  bfloat16 eagle@x: could not run (KeyError: 'layers')" in lines


def test_the_choice_is_the_fastest_lossless_row():
    Row = autoconfig.Row
    ar32, ar16 = (
        Row("float32", "ar", None, 2.0, 1.0, True),
        Row("bfloat16", "ar", None, 3.0, 1.0, True),
    )
    lossy = Row("float32", "medusa", "chain-1", 9.0, 2.0, lossless=False)
    assert autoconfig.choose([ar32, lossy, ar16]) == (ar16, ar16)
    failed = Row("float32", "eagle", "x", error="no drafter")
    with pytest.raises(autoconfig.JaxspecError, match=r"\(float32 eagle@x: no drafter\)"):
        autoconfig.choose([lossy, failed])
