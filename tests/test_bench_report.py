"""What a benchmark reports, from made-up generations: jaxspec-bench's aggregation (tokens/s,
speedup, mean accepted, match_ar, per category), its table, the conversation each row is
asked, and the predictions of infer.roofline and infer.scaling."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from jaxspec import bench
from jaxspec.bench import Runner, _play, markdown, summarize
from jaxspec.config import preset
from jaxspec.data.sources import Question
from jaxspec.text import encode_conversation
from tests.conftest import tiny_tokenizer

# Records as _play's: (category, ids, steps, seconds, accepted per verify step, prompt ids).
# "m" is compared with "ar:bfloat16" (its own dtype's AR), which leaves "ar" at generation 1.
RECORDS = {
    "ar": [("a", [1, 2, 3], 3, 1.0, [0, 0]), ("b", [4, 5], 2, 1.0, [0]), ("a", [6], 1, 2.0, [])],
    "ar:bfloat16": [
        ("a", [1, 2, 3], 3, 1.0, [0, 0]),
        ("b", [4, 9], 2, 1.0, [0]),
        ("a", [6], 1, 2.0, []),
    ],
    "m": [("a", [1, 2, 3], 2, 0.5, [1]), ("b", [4, 9], 1, 0.5, []), ("a", [7], 1, 0.5, [])],
}
METHODS = ["ar", "ar:bfloat16", "m"]
REFERENCES = {"ar": "ar", "ar:bfloat16": "ar", "m": "ar:bfloat16"}


def test_summarize_adds_up_each_rows_generations_overall_and_per_category():
    overall, categories = summarize(RECORDS, METHODS, REFERENCES, {"m": 1})
    m = overall["m"]
    # 6 tokens in 0.5 + 0.5 + 0.5 s and 2 + 1 + 1 steps; AR's 6 tokens in 4 s.
    assert (m["new_tokens"], m["seconds"]) == (6, 1.5)
    assert m["tokens_per_s"] == pytest.approx(4.0)
    assert m["speedup"] == pytest.approx(4.0 / 1.5)
    assert m["mean_accepted"] == pytest.approx(1.5)
    assert m["match_ar"] == pytest.approx(2 / 3) and m["reference"] == "ar:bfloat16"
    assert overall["ar:bfloat16"]["match_ar"] == pytest.approx(2 / 3)  # against "ar"
    assert overall["ar"]["speedup"] == 1.0 and overall["ar"]["mean_accepted"] == 1.0
    # Category a: generations 0 and 2. m: 4 tokens in 1 s over 3 steps; AR: 4 in 3 s.
    a = categories["a"]["m"]
    assert (a["tokens_per_s"], a["speedup"]) == (pytest.approx(4.0), pytest.approx(3.0))
    assert a["mean_accepted"] == pytest.approx(4 / 3) and a["match_ar"] == 0.5
    b = categories["b"]["m"]  # 2 tokens in 0.5 s against AR's 2 in 1 s
    assert (b["tokens_per_s"], b["speedup"], b["match_ar"]) == (4.0, 2.0, 1.0)
    assert list(categories) == ["a", "b"]


def test_the_table_shows_each_rows_numbers_in_their_columns():
    overall, categories = summarize(RECORDS, METHODS, REFERENCES, {"m": 1})
    lines = markdown({"methods": overall, "categories": categories}).splitlines()
    assert lines[0] == "| method | tokens/s | speedup | mean accepted | match_ar |"
    assert lines[2] == "| ar | 1.50 | 1.00x | 1.00 | 1.00 |"
    assert lines[4] == "| m | 4.00 | 2.67x | 1.50 | 0.67 (vs ar:bfloat16) |"
    at = lines.index("| category | ar | ar:bfloat16 | m |")
    assert lines[at + 1].count("|---") == 4
    assert lines[at + 2] == "| a | 1.3 (1.00x) | 1.3 (1.00x) | 4.0 (3.00x) |"
    assert lines[at + 3] == "| b | 2.0 (1.00x) | 2.0 (1.00x) | 4.0 (2.00x) |"
    one = {"ar": RECORDS["ar"][:1], "m": RECORDS["m"][:1]}
    overall, categories = summarize(one, ["ar", "m"], {"ar": "ar", "m": "ar"})
    assert "category" not in markdown({"methods": overall, "categories": categories})


class FakeRunner:
    """A row that answers every prompt with its own words, recording the prompts."""

    def __init__(self, tokenizer, words: str):
        self.reply, self.prompts = tokenizer.encode(words, add_special_tokens=False), []

    def generate(self, prompt_ids, max_new_tokens):
        self.prompts.append(prompt_ids)
        return self.reply, 2, 0.5, [len(self.reply) - 2]


@pytest.mark.parametrize("single_turn", [False, True])
def test_each_row_is_asked_its_own_conversation_turn_by_turn(single_turn):
    tok = tiny_tokenizer()
    questions = [Question("1", "a", ("w5 w6", "w7")), Question("2", "b", ("w8", "w9 w10"))]
    runners = {"ar": FakeRunner(tok, "w20 w21"), "m": FakeRunner(tok, "w30 w31 w32")}
    records, turns = _play(runners, tok, questions, 8, single_turn)
    assert turns == (2 if single_turn else 4)
    for m, runner in runners.items():
        reply = tok.decode(runner.reply, skip_special_tokens=True)
        asked = []
        for q in questions:
            history = []
            for turn in q.turns[:1] if single_turn else q.turns:
                history.append({"role": "user", "content": turn})
                asked.append(encode_conversation(tok, history))
                history.append({"role": "assistant", "content": reply})
        warm_up = encode_conversation(tok, [{"role": "user", "content": "w5 w6"}])
        assert runner.prompts == [warm_up, *asked]  # the warm-up first, never recorded
        assert [r[5] for r in records[m]] == asked
        want = [q.category for q in questions for _ in (q.turns[:1] if single_turn else q.turns)]
        assert [r[0] for r in records[m]] == want
        assert all(r[1:5] == (runner.reply, 2, 0.5, [len(runner.reply) - 2]) for r in records[m])


def test_a_rows_time_is_its_prefill_and_decode_and_the_peer_accepts_nothing():
    generated = SimpleNamespace(token_ids=[4, 5, 6], steps=2, compile_s=30.0, prefill_s=0.25,
                                decode_s=0.5, accepted=[2])  # fmt: skip
    runner = Runner.__new__(Runner)
    runner.name, runner.seed = "medusa", 7
    runner.generator = SimpleNamespace(generate=lambda prompt, n, seed: generated)
    assert runner.generate([1, 2], 3) == ([4, 5, 6], 2, 0.75, [2])  # compile left out
    peer = Runner.__new__(Runner)
    peer.name, peer.peer = "hf", SimpleNamespace(generate=lambda prompt, n: ([4, 5, 6], 3, 0.5))
    assert peer.generate([1, 2], 3) == ([4, 5, 6], 3, 0.5, [0, 0])  # a verify step per token
    assert bench.acceptance(peer.generate([1, 2], 3)[3])["accepted_histogram"] == [2]


def test_roofline_puts_each_step_against_the_floor(monkeypatch):
    """The floor: every weight and the live cache (context plus half the steps, keys and
    values, float32) read once per token at the given bandwidth."""
    from infer import roofline

    cfg = preset("tiny-gqa")
    ms = {1: 2.0, 3: 5.0}  # by tree nodes
    monkeypatch.setattr(roofline, "step_ms", lambda cfg, params, tree, *a: ms[tree.n_nodes])
    monkeypatch.setattr(roofline, "init_params", lambda *a: None)  # times made up: no weights
    monkeypatch.setattr(roofline, "compute_params", lambda params, dtype: params)
    got = roofline.measure(cfg, 10.0, 16, 4, jnp.float32, ["chain-2"])
    cache = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (16 + 2) * 4
    floor_ms = (cfg.n_params * 4 + cache) / 10e9 * 1e3
    assert got["floor_ms_per_token"] == pytest.approx(floor_ms)
    assert got["fraction_of_floor"] == pytest.approx(floor_ms / 2.0)
    assert got["ms_per_token"] == 2.0 and got["tokens_per_s"] == 500.0
    assert got["verify"]["chain-2"] == {"nodes": 3, "depth": 2, "ms_per_step": 5.0,
                                        "over_ar_step": 2.5}  # fmt: skip


def test_scaling_speedups_are_each_taus_own_tree_and_shown_where_the_model_fits(capsys, tmp_path):
    from infer.scaling import main, parse_tau

    out = tmp_path / "s.json"
    main(["--models", "llama-3-70b", "--tp", "1", "8", "--accelerators", "h100", "--nodes",
          "256", "--tau", "small:8:2.0", "big:256:2.0", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    records = json.loads(out.read_text())
    assert [(r["tp"], r["fits"]) for r in records] == [(1, False), (8, True)]
    for r in records:  # the first table's verify / AR column
        ratio = r["verify"]["seconds"] / r["ar"]["seconds"]
        assert f"| {r['verify']['seconds'] * 1e3:.2f} | {ratio:.2f} |" in text
        # --nodes 256: the 256-node tau's speedup is tau over that verify step's cost
        assert r["speedups"]["big"] == pytest.approx(2.0 / ratio)
        assert r["speedups"]["small"] > r["speedups"]["big"]  # 256 rows are compute-bound, 8 not
    speedups = text[text.index("small (8 nodes") :].splitlines()
    assert [line.split(" | ")[2] for line in speedups[2:]] == ["8"]  # TP 1 does not fit
    with pytest.raises(argparse.ArgumentTypeError, match="TAU >= 1"):
        parse_tau("slow:8:0.5")  # fewer than one token a step


def test_the_bench_command_hands_every_sampling_flag_to_the_run(tmp_path, monkeypatch, capsys):
    from infer import bench as command
    from jaxspec.sampling import Sampling

    got = {}

    def run_benchmark(rows, questions, **kw):
        got.update(kw, rows=rows)
        return {"methods": {}}

    monkeypatch.setattr(command, "run_benchmark", run_benchmark)
    monkeypatch.setattr(command, "write_results", lambda result, paths: None)
    monkeypatch.setattr(command, "markdown", lambda result: "")
    command.main(["--methods", "medusa,ar", "--questions", "q.jsonl", "--temperature", "0.7",
                  "--top-p", "0.5", "--top-k", "4", "--typical", "--seed", "3",
                  "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert got["sampling"] == Sampling(0.7, 4, 0.5, True) and got["seed"] == 3
    assert got["rows"] == ["ar", "medusa"]


def test_rowcost_reports_the_median_forward(monkeypatch):
    """Each forward timed alone (3 warm-ups first), the median kept: one slow outlier (a
    made-up clock's 5 ms among 1 and 2) moves nothing."""
    from infer import rowcost

    ticks = iter([0.0, 0.001, 10.0, 10.005, 20.0, 20.002])
    monkeypatch.setattr(rowcost, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(rowcost, "forward", lambda p, cfg, t, pos, cache, mask: (t * p,))
    ms = rowcost.forward_ms(preset("tiny-gqa"), jnp.float32(1), 4, 8, 3)
    assert ms == pytest.approx(2.0)
