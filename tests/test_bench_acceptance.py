"""Per-step acceptance: GenerationResult.accepted and the bench's acceptance_by_depth."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.bench import acceptance, run_benchmark, summarize
from jaxspec.checkpoint import load_checkpoint
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.medusa import MedusaDrafter, MedusaSettings
from jaxspec.drafters.store import save_drafter
from jaxspec.errors import JaxspecError
from jaxspec.ppd import PpdGenerator
from jaxspec.tree import tree_preset
from tests.drafters import OracleDrafter
from tests.test_speculative import tiny


def check_accepted(result, max_new_tokens: int, max_depth: int, eos=False) -> None:
    """The exact bookkeeping: one entry per verify step (steps less the prefill), each
    step emitted accepted + 1 tokens and added at least one of them to the output (a row
    stops at its last), only the last step can be cut (by max_new_tokens or EOS)."""
    acc = result.accepted
    assert len(acc) == result.steps - 1
    assert all(0 <= a <= max_depth for a in acc)
    before_last = 1 + sum(a + 1 for a in acc[:-1])  # the prefill's token, then full steps
    emitted = before_last + (acc[-1] + 1 if acc else 0)
    assert not acc or before_last < result.new_tokens
    if eos:
        assert result.new_tokens <= emitted
    else:
        assert result.new_tokens == min(max_new_tokens, emitted)


def test_oracle_on_a_chain_accepts_the_whole_chain_every_step():
    cfg, params = tiny()  # no EOS
    tree, prompt, n = tree_preset("chain-4"), [5, 6, 7, 8, 9], 40
    ar = SpeculativeGenerator(cfg, params).generate(prompt, n)
    check_accepted(ar, n, 0)
    assert ar.accepted == [0] * (n - 1)
    reference = jnp.asarray(prompt + ar.token_ids + [0] * 16, jnp.int32)
    oracle = SpeculativeGenerator(cfg, params, OracleDrafter(cfg.vocab_size), reference, tree)
    result = oracle.generate(prompt, n)
    assert result.token_ids == ar.token_ids
    # Lossless + drafts equal to AR's tokens: every step accepts all 4. 1 + 8 * 5 = 41
    # tokens emitted, the last step's fifth cut by max_new_tokens.
    assert result.accepted == [4] * 8
    check_accepted(result, n, 4)


def test_batch_rows_and_eos_keep_the_bookkeeping():
    cfg, params = tiny()
    tree, prompts = tree_preset("chain-4"), [[5, 6, 7, 8, 9], [3, 1, 4]]
    ar = SpeculativeGenerator(cfg, params).generate_batch(prompts, 12)
    for r in ar:
        check_accepted(r, 12, 0)
    # An EOS the AR output reaches mid-way: the oracle's step that emits it is cut there.
    eos = ar[0].token_ids[6]
    cfg = dataclasses.replace(cfg, eos_token_ids=(eos,))
    reference = jnp.asarray(prompts[0] + ar[0].token_ids + [0] * 16, jnp.int32)
    oracle = SpeculativeGenerator(cfg, params, OracleDrafter(cfg.vocab_size), reference, tree)
    result = oracle.generate(prompts[0], 12)
    assert result.token_ids == ar[0].token_ids[: ar[0].token_ids.index(eos) + 1]
    check_accepted(result, 12, 4, eos=True)


def test_ppd_rounds_accept_nothing(tiny_ckpt):
    cfg, params = load_checkpoint(tiny_ckpt[0], jnp.float32)
    cfg = dataclasses.replace(cfg, eos_token_ids=())
    result = PpdGenerator(cfg, params, 2, 1).generate([5, 6, 7, 8], 6)
    assert result.accepted == [0] * 5
    check_accepted(result, 6, 0)


def test_acceptance_by_depth_counts_steps_at_least_that_deep():
    got = acceptance([0, 2, 1, 2, 0, 3], max_depth=4)
    assert got["accepted_histogram"] == [2, 1, 2, 1, 0]
    assert got["acceptance_by_depth"] == [4 / 6, 3 / 6, 1 / 6, 0.0]
    assert acceptance([0, 0, 0]) == {"acceptance_by_depth": [], "accepted_histogram": [3]}
    assert acceptance([]) == {"acceptance_by_depth": [], "accepted_histogram": [0]}
    # as deep as the most accepted when that is past max_depth (a row without a tree's depth)
    assert acceptance([1, 3], max_depth=2) == {
        "acceptance_by_depth": [1.0, 0.5, 0.5], "accepted_histogram": [0, 1, 0, 1]
    }  # fmt: skip
    # summarize: over all generations of a row (and per category); records as _play's.
    records = {
        "ar": [("a", [1, 2], 2, 1.0, [0]), ("b", [3], 1, 1.0, [])],
        "m": [("a", [1, 2], 1, 0.5, []), ("b", [3, 4, 5], 2, 0.5, [1])],
    }
    overall, categories = summarize(records, ["ar", "m"], {"ar": "ar", "m": "ar"}, {"m": 2})
    assert overall["ar"]["acceptance_by_depth"] == [] and overall["m"]["new_tokens"] == 5
    assert overall["m"]["acceptance_by_depth"] == [1.0, 0.0]
    assert overall["m"]["accepted_histogram"] == [0, 1, 0]
    assert categories["a"]["m"]["acceptance_by_depth"] == [0.0, 0.0]


@pytest.fixture
def medusa_folder(tiny_ckpt, tmp_path):
    cfg, params = load_checkpoint(tiny_ckpt[0])
    heads = MedusaDrafter(cfg, 2).init(params, jax.random.key(0))
    save_drafter(tmp_path / "medusa", "medusa", MedusaSettings(n_heads=2), heads, cfg, "untrained")
    return tmp_path / "medusa"


def test_bench_reports_acceptance_by_depth_for_every_row(tiny_ckpt, medusa_folder, tmp_path):
    questions = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "a", "turns": ["w5 w6", "w7"]},
        {"question_id": 2, "category": "b", "turns": ["w8 w9 w10"]},
    ]
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # comb-2-10: the top 10 guesses at two depths, so the untrained heads get some right.
    result = run_benchmark(
        ["ar", "medusa@comb-2-10"], str(questions), model=tiny_ckpt[0], max_new_tokens=8,
        drafters={"medusa": medusa_folder},
    )  # fmt: skip
    result = json.loads(json.dumps(result))  # as written
    tables = [(result["methods"], result["n_generations"])]
    tables += [(result["categories"][c], n) for c, n in [("a", 2), ("b", 1)]]
    for table, generations in tables:
        for m, stats in table.items():
            by_depth, histogram = stats["acceptance_by_depth"], stats["accepted_histogram"]
            steps = round(stats["new_tokens"] / stats["mean_accepted"])  # prefills included
            verify_steps = sum(histogram)
            assert verify_steps == steps - generations
            assert all(0.0 <= f <= 1.0 for f in by_depth)
            assert by_depth == sorted(by_depth, reverse=True)  # non-increasing
            if m == "ar":
                assert by_depth == [] and histogram == [verify_steps]
            else:
                assert len(by_depth) == 2 == len(histogram) - 1  # the tree's depth
                assert by_depth[0] == pytest.approx(1 - histogram[0] / verify_steps)
                assert by_depth[1] == pytest.approx(histogram[2] / verify_steps)
    assert set(result["methods"]["medusa@comb-2-10"]) >= {"tokens_per_s", "match_ar", "speedup"}


def test_bench_one_shape_decodes_the_same_tokens(tiny_ckpt, medusa_folder, tmp_path, monkeypatch):
    """one_shape pads every prompt to the longest one's shape: each row compiles one shape,
    same tokens and acceptance, with the rows compiled side by side in threads; it sizes
    programs for first turns, so a multi-turn run is refused; min_prompt_len sizes them
    for longer prompts than the run's own."""
    questions = tmp_path / "q.jsonl"
    turns = ["w5 w6", " ".join(f"w{i}" for i in range(5, 45))]  # prompt buckets 16 and 64
    lines = [{"question_id": i, "category": "a", "turns": [t]} for i, t in enumerate(turns)]
    questions.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    kw = dict(model=tiny_ckpt[0], max_new_tokens=8, drafters={"medusa": medusa_folder},
              single_turn=True)  # fmt: skip
    rows = ["ar", "medusa@comb-2-10", "ppd"]
    monkeypatch.setattr("jaxspec.bench.compiles_are_slow", lambda: False)  # a CPU's default
    own = run_benchmark(rows, str(questions), **kw)
    shapes = defaultdict(set)  # generator -> the (prompt width, cache length) it compiled
    programs = SpeculativeGenerator._programs

    def spy(self, pre_args, cache):
        if (pre_args[2].shape, cache.max_len) not in shapes[id(self)]:  # a compile
            threads.add(threading.get_ident())
        shapes[id(self)].add((pre_args[2].shape, cache.max_len))
        return programs(self, pre_args, cache)

    threads = set()
    monkeypatch.setattr(SpeculativeGenerator, "_programs", spy)
    one = run_benchmark(rows, str(questions), one_shape=True, warm_up_workers=3, **kw)
    assert len(shapes) == 2 and all(len(s) == 1 for s in shapes.values())  # ar, medusa
    assert threading.main_thread().ident not in threads  # compiled by the warm-up workers
    assert one["one_shape"] and not own["one_shape"]
    for m in rows:
        for key in ("new_tokens", "mean_accepted", "match_ar", "accepted_histogram"):
            assert one["methods"][m][key] == own["methods"][m][key], (m, key)
    with pytest.raises(JaxspecError, match="one_shape sizes programs for the first turns"):
        run_benchmark(["ar"], str(questions), model=tiny_ckpt[0], one_shape=True)
    # min_prompt_len: sized for more than the run's own prompts (a shape shared with another run)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps(lines[0]) + "\n")  # bucket 16 alone
    shapes.clear()
    run_benchmark(["ar"], str(short), one_shape=True, min_prompt_len=100, **kw)
    [(width, _)] = next(iter(shapes.values()))
    assert width[1] >= 100
    with pytest.raises(JaxspecError, match="min_prompt_len sizes the programs of one_shape"):
        run_benchmark(["ar"], str(short), min_prompt_len=100, **kw)
    # unset, one_shape is single_turn's where compiles are slow (an accelerator's default)
    monkeypatch.setattr("jaxspec.bench.compiles_are_slow", lambda: True)
    assert run_benchmark(["ar"], str(short), **kw)["one_shape"]
    assert not run_benchmark(["ar"], str(short), **{**kw, "single_turn": False})["one_shape"]
    assert not run_benchmark(["ar"], str(short), one_shape=False, **kw)["one_shape"]


@pytest.mark.parametrize("rows, dtype, loaded", [
    (["ar"], "float32", "float32"),
    (["ar", "ar:bfloat16"], "float32", "float32"),
    (["ar"], "bfloat16", None),  # the backend's default: bfloat16 on an accelerator
    (["ar", "ar:float32"], "bfloat16", "float32"),
])  # fmt: skip
def test_float32_rows_load_float32_weights_on_any_backend(rows, dtype, loaded, monkeypatch):
    """An accelerator loads bfloat16 weights by default: a float32 row cast up from them
    would be a bfloat16-rounded model named float32, so the run loads float32 weights."""
    import jaxspec.bench as bench

    asked = []

    def load_model(model, dtype=None, mesh=None):
        asked.append(dtype)
        raise KeyboardInterrupt  # the rest of the run is not this test's

    monkeypatch.setattr(bench, "load_model", load_model)
    monkeypatch.setattr(bench, "load_questions", lambda source: [])
    monkeypatch.setattr(bench, "select_questions", lambda *args: ["q"])
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(rows, "q.jsonl", dtype=dtype)
    assert asked == [loaded]


@pytest.mark.parametrize("mesh", [None, "data=1,model=1"])
def test_float32_asked_of_a_checkpoint_is_its_float32_weights_on_an_accelerator(
    mesh, tiny_ckpt, monkeypatch
):
    """load_model(dtype="float32") where the backend's default is bfloat16: the stored
    float32 weights exactly, not bfloat16-rounded ones cast back up."""
    import jaxspec.checkpoint as checkpoint
    from jaxspec.models import load_model

    _, stored = load_checkpoint(tiny_ckpt[0], jnp.float32)
    monkeypatch.setattr(checkpoint, "default_dtype", lambda: jnp.bfloat16)
    loaded = load_model(tiny_ckpt[0], "float32", mesh)
    jax.tree.map(np.testing.assert_array_equal, loaded.params, stored)
    assert load_model(tiny_ckpt[0], None, mesh).params["embed_tokens"].dtype == jnp.bfloat16
