"""Command-line tools end to end on a tiny checkpoint: outputs and one-line errors."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from infer.bench import main as bench_main
from infer.generate import main as generate_main
from jaxspec.bench import match_reference
from jaxspec.checkpoint import load_checkpoint
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError
from jaxspec.methods import resolve_tree
from jaxspec.text import encode_prompt
from tests.conftest import one_line_error, tiny_tokenizer
from train.cli import main as train_main


def run_ok(main, argv, capsys) -> str:
    capsys.readouterr()
    main(argv)
    return capsys.readouterr().out


def test_generate_json(tiny_ckpt, capsys):
    ckpt, _ = tiny_ckpt
    out = run_ok(
        generate_main,
        ["--model", str(ckpt), "--json", "--max-new-tokens", "12", "w5 w9 w7"],
        capsys,
    )
    got = json.loads(out)
    for field in ("text", "token_ids", "new_tokens", "steps", "mean_accepted", "tokens_per_s"):
        assert field in got
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    ids = encode_prompt(tiny_tokenizer(), "w5 w9 w7")
    assert got["token_ids"] == SpeculativeGenerator(cfg, params).generate(ids, 12).token_ids
    assert got["new_tokens"] == len(got["token_ids"]) and got["mean_accepted"] == 1.0


def test_generate_ppd_equals_ar(tiny_ckpt, capsys):
    """4 virtual devices (tests/conftest.py): k = 3 sub-processes."""
    ckpt, _ = tiny_ckpt
    argv = ["--model", str(ckpt), "--json", "--max-new-tokens", "16", "w5 w9 w7"]
    ar = json.loads(run_ok(generate_main, argv, capsys))
    ppd = json.loads(run_ok(generate_main, ["--method", "ppd", "--ppd-layer", "1", *argv], capsys))
    assert ppd["token_ids"] == ar["token_ids"] and ppd["method"] == "ppd"
    err = one_line_error(generate_main, ["--method", "ppd", "--temperature", "1", *argv], capsys)
    assert "ppd decodes greedily" in err
    err = one_line_error(generate_main, ["--firp-chains", "4", *argv], capsys)
    assert "firp_chains (--firp-chains) applies to method firp only" in err
    err = one_line_error(generate_main, ["--sdsat-loop", "one-forward", *argv], capsys)
    assert "sdsat_loop (--sdsat-loop) applies to method sdsat only" in err


def test_generate_batch_json_lines(tiny_ckpt, capsys):
    ckpt, _ = tiny_ckpt
    argv = ["--model", str(ckpt), "--json", "--max-new-tokens", "9", "w5 w9 w7", "w3"]
    lines = run_ok(generate_main, argv, capsys).strip().splitlines()
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    for line, prompt in zip(lines, ["w5 w9 w7", "w3"], strict=True):
        ids = encode_prompt(tiny_tokenizer(), prompt)
        expected = SpeculativeGenerator(cfg, params).generate(ids, 9).token_ids
        assert json.loads(line)["token_ids"] == expected


def test_generate_streams_text(tiny_ckpt, capsys):
    """The streamed pieces add up to the answer's text (as --json reports it)."""
    argv = ["--model", str(tiny_ckpt[0]), "--max-new-tokens", "5", "w5"]
    text = json.loads(run_ok(generate_main, ["--json", *argv], capsys))["text"]
    streamed = run_ok(generate_main, argv, capsys)
    assert text.strip() and streamed.startswith(text + "\n")


def test_generate_hands_every_flag_to_the_api(monkeypatch, capsys):
    """Each jaxspec-generate flag reaches load_model, the Generator or each call (stand-ins
    record them); one prompt streams its pieces, several print a `--- ` line each, with a
    report on stderr either way."""
    import infer.generate as cli
    from jaxspec.generate import GenerationResult

    seen = {}

    def answer(prompt):
        return GenerationResult([5], [6, 7, 8], 2, 1.0, 2.0, 0.0, text=f"re: {prompt}")

    class Pieces(list):
        result = None

    class Recording:
        def __init__(self, model, method, **options):
            seen.update(model=model, method=method, options=options)
            self.model = SimpleNamespace(bytes_per_device=lambda: None)

        def generate(self, prompts, max_new_tokens, **sampling):
            seen["call"] = (prompts, max_new_tokens, sampling)
            return [answer(p) for p in prompts] if isinstance(prompts, list) else answer(prompts)

        def stream(self, prompt, max_new_tokens, **sampling):
            seen["call"] = (prompt, max_new_tokens, sampling)
            pieces = Pieces(["re: ", prompt])
            pieces.result = answer(prompt)
            return pieces

    class Loaded(tuple):  # load_model's arguments, as a model with a tokenizer
        tokenizer = "its tokenizer"

    monkeypatch.setattr(cli, "load_model", lambda *args: Loaded(args))
    monkeypatch.setattr(cli, "Generator", Recording)
    capsys.readouterr()
    cli.main(["--model", "m", "--dtype", "bfloat16", "--method", "medusa", "--drafter", "d",
              "--tree", "chain-2", "--retrieval", "2", "--max-len", "64", "--products", "exact",
              "--no-chat", "--max-new-tokens", "3", "--temperature", "0.5", "--top-p", "0.9",
              "--top-k", "0", "--seed", "9", "--typical", "hi"])  # fmt: skip
    out, err = capsys.readouterr()
    assert (seen["model"], seen["method"]) == ((Path("m"), "bfloat16", None), "medusa")
    assert seen["options"] == dict(
        drafter=Path("d"), tree="chain-2", max_len=64, products="exact", chat=False,
        ppd_k=None, ppd_layer=None, firp_chains=None, sdsat_loop=None, retrieval=2,
    )  # fmt: skip
    sampling = dict(temperature=0.5, top_p=0.9, top_k=0, seed=9, typical=True)
    assert seen["call"] == ("hi", 3, sampling)
    assert out == "re: hi\n" and err.startswith("[medusa] 3 tokens in 2 steps (1.50 tokens/step)")
    cli.main(["--model", "m", "a", "b"])
    out, err = capsys.readouterr()
    assert seen["call"][0] == ["a", "b"] and out == "--- re: a\n\n--- re: b\n\n"
    assert err.startswith("[ar] batch of 2: 6 tokens in 3.0 s (2.0 tokens/s)")


def test_argument_types_take_their_range_and_refuse_the_rest():
    """The flags' types (jaxspec.cli) check a value as it is parsed, at each edge."""
    from jaxspec import cli
    from jaxspec.drafters.registry import MAX_PPD_K

    for parse, text, value in [
        (cli.probability, "1", 1.0), (cli.temperature, "0", 0.0),
        (cli.positive_float, "1e-9", 1e-9), (cli.nonnegative_float, "0", 0.0),
        (cli.seed, str(2**32 - 1), 2**32 - 1),
        (cli.ppd_k, str(MAX_PPD_K), MAX_PPD_K), (cli.nonnegative_int, "0", 0),
        (cli.positive_int, "1", 1),
    ]:  # fmt: skip
        assert parse(text) == value
    for parse, text in [
        (cli.probability, "0"), (cli.probability, "1.01"), (cli.probability, "nan"),
        (cli.temperature, "inf"), (cli.temperature, "-0.1"), (cli.positive_float, "0"),
        (cli.nonnegative_float, "nan"), (cli.seed, str(2**32)), (cli.seed, "1.5"),
        (cli.ppd_k, str(MAX_PPD_K + 1)), (cli.positive_int, "0"), (cli.nonnegative_int, "-1"),
    ]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_ppd_asks_for_k_plus_1_devices_of_the_model_split_each(monkeypatch):
    """(XLA reads the flag when jax starts: later changes, as here, do nothing.)"""
    from jaxspec.methods import provide_devices_for

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=x")
    provide_devices_for(["ar", "ppd"], 5, model_split=2)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=12"
    monkeypatch.setenv("XLA_FLAGS", "")
    provide_devices_for(["ar", "medusa"], 5)  # no pipeline: no devices asked for
    assert os.environ["XLA_FLAGS"] == ""
    provide_devices_for(["ppd"])  # the default k, 3
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    provide_devices_for(["ppd"], 7)  # a count already set is the user's
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "nope", "w5"], "unknown method 'nope'"),
        (["--max-len", "16", "w5 " * 20], "exceeds the limit of 16 positions"),
        (
            ["--max-len", "100000", "w5"],
            "max_len (--max-len) must be an integer from 1 to the model's context of",
        ),
        (["   "], "empty prompt"),
        (["--top-p", "0", "w5"], "argument --top-p: must be in (0, 1]"),
        (["--tree", "chain-2", "w5"], "tree (--tree) picks a draft tree; method 'ar' has none"),
        (["--method", "ppd", "--tree", "chain-2", "w5"], "method 'ppd' has none"),
        (["--drafter", "d", "w5"], "drafter (--drafter) applies to speculative methods"),
        (["--ppd-layer", "2", "w5"], "ppd_layer (--ppd-layer) applies to method ppd only"),
    ],
)
def test_generate_bad_input(tiny_ckpt, capsys, argv, message):
    err = one_line_error(generate_main, ["--model", str(tiny_ckpt[0]), *argv], capsys)
    assert message in err


def test_unknown_tree_names_the_drafters_own():
    settings = DrafterSettings(trees={"searched-8": [[0], [1]], "searched-16": [[0]]})
    assert resolve_tree("searched-8", settings).n_nodes == 3
    with pytest.raises(JaxspecError, match="drafter's own: searched-8, searched-16"):
        resolve_tree("searched-99", settings)
    with pytest.raises(JaxspecError, match="unknown tree 'searched-99'; known: [^;]*$"):
        resolve_tree("searched-99")


def test_convert_if_missing_leaves_a_checkpoint_alone(tiny_ckpt, tmp_path, capsys):
    from checkpoints_convert.cli import main as convert_main

    ckpt = tiny_ckpt[0]
    before = {p: p.read_bytes() for p in ckpt.iterdir()}
    out = run_ok(convert_main, [str(tmp_path / "hf"), "--out", str(ckpt), "--if-missing"], capsys)
    assert out == f"checkpoint already at {ckpt}\n"
    assert {p: p.read_bytes() for p in ckpt.iterdir()} == before


def test_convert_without_src_keeps_the_model_cache_a_jaxspec_checkpoint(
    tiny_ckpt, tmp_path, monkeypatch, capsys
):
    """`jaxspec-convert --to hf` once wrote HF files over the cache's checkpoint, and
    `--dtype` replaced the model every tool reads; both need an --out (or --overwrite)."""
    import shutil

    from checkpoints_convert.cli import main as convert_main
    from jaxspec.checkpoint import default_model_dir

    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path / "home"))
    cache = default_model_dir()
    shutil.copytree(tiny_ckpt[0], cache)
    before = {p: p.read_bytes() for p in cache.iterdir()}
    err = one_line_error(convert_main, ["--to", "hf"], capsys)
    assert "--to hf without SRC needs --out DIR" in err
    err = one_line_error(convert_main, ["--dtype", "bfloat16"], capsys)
    assert "already holds the default model" in err and "--overwrite" in err
    assert {p: p.read_bytes() for p in cache.iterdir()} == before


def test_generate_missing_model(tmp_path, capsys):
    err = one_line_error(generate_main, ["--model", str(tmp_path / "none"), "hi"], capsys)
    assert "no model at" in err and "jaxspec-convert" in err


def test_bench_ar_and_hf_agree(tiny_ckpt, tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "a", "turns": ["w5 w6", "w7"]},
        {"question_id": 2, "category": "b", "turns": ["w8 w9 w10"]},
    ]
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "r.json"
    argv = ["--methods", "ar,hf,ar:bfloat16", "--questions", str(questions),
            "--max-new-tokens", "8"]  # fmt: skip
    run_ok(bench_main, [*argv, "--model", str(tiny_ckpt[0]), "--out", str(out)], capsys)
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"ar", "hf", "ar:bfloat16"}
    assert set(result["categories"]) == {"a", "b"} and result["dtype"] == "float32"
    assert result["methods"]["ar:bfloat16"]["new_tokens"] == result["methods"]["ar"]["new_tokens"]
    assert result["n_generations"] == 3
    assert result["methods"]["hf"]["match_ar"] == 1.0  # same tokens from torch and JAX
    assert result["methods"]["ar"]["speedup"] == 1.0
    assert out.with_suffix(".md").read_text().startswith("| method |")
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_bad_questions(tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text('{"no": 1}\n')
    err = one_line_error(bench_main, ["--questions", str(tmp_path / "q.jsonl")], capsys)
    assert "is not a Spec-Bench question" in err
    err = one_line_error(bench_main, ["--questions", str(tmp_path / "missing.jsonl")], capsys)
    assert "no question file" in err
    argv = ["--methods", "ar,ar:float16", "--questions", str(tmp_path / "q.jsonl")]
    assert "ar:float16: unknown dtype 'float16'" in one_line_error(bench_main, argv, capsys)
    for row in ("medusa@searched-16/4", "firp@searched-16/x"):
        argv = ["--methods", row, "--questions", str(tmp_path / "q.jsonl")]
        assert f"{row}: /N (FIRP's pseudo chains" in one_line_error(bench_main, argv, capsys)
    argv = ["--methods", "sdsat/three-forward", "--questions", str(tmp_path / "q.jsonl")]
    err = one_line_error(bench_main, argv, capsys)
    assert "sdsat/three-forward: /LOOP (one of two-forward, one-forward) expected" in err
    argv = ["--methods", "ar,ar@chain-2", "--questions", str(tmp_path / "q.jsonl")]
    assert "ar@chain-2: ar decodes without a draft tree" in one_line_error(bench_main, argv, capsys)


def test_train_names_what_exists(capsys):
    err = one_line_error(train_main, ["hydra"], capsys)
    available = "medusa, firp, chimera, sdsat, ppd, eagle"
    assert f"no trainer for method 'hydra' (available: {available})" in err
    assert "name a method to train" in one_line_error(train_main, [], capsys)


def test_train_help_is_the_methods_own(capsys):
    train_main(["--help"])
    assert "one of medusa, firp, chimera, sdsat, ppd, eagle" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        train_main(["firp", "--help"])
    assert exit_info.value.code == 0 and "--layers" in capsys.readouterr().out


def test_bench_refuses_sampling_for_the_greedy_peer(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text('{"question_id": 1, "turns": ["w5"]}\n')
    argv = ["--methods", "ar,hf", "--questions", str(tmp_path / "q.jsonl"),
            "--temperature", "0.7", "--model", str(tiny_ckpt[0])]  # fmt: skip
    assert "greedy only" in one_line_error(bench_main, argv, capsys)


def test_bench_samples_with_top_k(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text('{"question_id": 1, "turns": ["w5 w6"]}\n')
    argv = ["--methods", "ar", "--questions", str(tmp_path / "q.jsonl"), "--max-new-tokens",
            "6", "--temperature", "1", "--model", str(tiny_ckpt[0])]  # fmt: skip
    err = one_line_error(bench_main, [*argv, "--top-k", "-1"], capsys)
    assert "argument --top-k: must be 0 or more" in err
    out = tmp_path / "r.json"
    run_ok(bench_main, [*argv, "--top-k", "3", "--out", str(out)], capsys)
    assert json.loads(out.read_text())["top_k"] == 3


def test_roofline_reports_a_fraction(capsys):
    from infer.roofline import main as roofline_main

    argv = ["--preset", "tiny-gqa", "--bandwidth-gbs", "10", "--steps", "4",
            "--trees", "chain-2", "cpu-8"]  # fmt: skip
    got = json.loads(run_ok(roofline_main, argv, capsys))
    assert got["model"] == "tiny-gqa" and got["fraction_of_floor"] > 0 and got["ms_per_token"] > 0
    assert {name: v["nodes"] for name, v in got["verify"].items()} == {"chain-2": 3, "cpu-8": 8}
    assert all(v["ms_per_step"] > 0 for v in got["verify"].values())
    with pytest.raises(SystemExit):  # argparse: usage and the reason, before any work
        roofline_main([*argv[:-2], "dynamic-8"])
    assert "roofline times static trees" in capsys.readouterr().err


def test_rowcost_times_every_dtype_and_order(tiny_ckpt, capsys):
    from infer.rowcost import main as rowcost_main

    ckpt, _ = tiny_ckpt
    dtypes = ["float32", "bfloat16", "bfloat16-in-out"]
    argv = ["--model", str(ckpt), "--dtype", *dtypes, "--rows", "1", "3", "--repeats", "1"]
    got = json.loads(run_ok(rowcost_main, argv, capsys))
    assert list(got["ms"]) == dtypes
    assert all(ms > 0 for row in got["ms"].values() for ms in row.values())


def test_bench_compares_each_row_with_ar_in_its_own_dtype():
    methods = ["ar", "ar:float32", "medusa", "firp@searched-8:float32", "hf"]
    refs = {m: match_reference(m, "bfloat16", methods) for m in methods}
    assert refs == {"ar": "ar", "ar:float32": "ar", "medusa": "ar",
                    "firp@searched-8:float32": "ar:float32", "hf": "ar:float32"}  # fmt: skip
    assert match_reference("firp:bfloat16", "float32", ["ar", "firp:bfloat16"]) == "ar"


@pytest.mark.parametrize(
    "trainer, flag, other",
    [("chimera", "bottom", ["--bottom", "transformer"]), ("medusa", "own_lm_head",
     ["--own-lm-head"]), ("firp", "training", ["--training", "paper"]),
     ("sdsat", "loss", ["--loss", "basic"]), ("eagle", "rows_within", ["--rows-within", "64"]),
     ("eagle", "loss_top", ["--loss-top", "10"]),
     ("eagle", "skip_prompts", ["--skip-prompts", "first:6400:128"])],
)  # fmt: skip
def test_a_flag_added_later_keeps_older_runs_resumable(trainer, flag, other):
    """Checkpoints are keyed by the training flags; a flag added later (Chimera's --bottom,
    Medusa's --own-lm-head, FIRP's --training, SDSAT's --loss, EAGLE's --rows-within,
    --loss-top and --skip-prompts) at its default must not change the key of runs made
    before it existed."""
    import importlib

    from train.checkpoints import run_name

    parse_args = importlib.import_module(f"train.{trainer}").parse_args
    args = parse_args(["--steps", "10"])
    older = parse_args(["--steps", "10"])
    delattr(older, flag)
    assert run_name(args) == run_name(older)
    assert run_name(parse_args(other)) != run_name(args)
    assert run_name(parse_args(["--steps", "99"])) == run_name(args)  # more steps continue


def test_a_card_names_the_whole_lineage_of_its_init(tmp_path):
    """started_from: the --init drafter's command and, when that card says where it
    started, that lineage too (its wrapped lines joined), so no earlier run is forgotten."""
    from types import SimpleNamespace

    from train.checkpoints import started_from

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    (first / "CARD.md").write_text("# card\n\n- Data: x\n- Command: `jaxspec-train a`\n")
    (second / "CARD.md").write_text(
        "# card\n\n- Started from the weights of the drafter then at `d` (top-1 0.5),\n"
        "  which `jaxspec-train a` trained.\n- 800 steps in all.\n"
        "- Command: `jaxspec-train b`\n"
    )
    assert started_from(SimpleNamespace(init=None)) == ""
    assert started_from(SimpleNamespace(init=first)) == (
        f"- Started from the weights of the drafter then at `{first}`, which `jaxspec-train a`"
        " trained.\n"
    )
    assert started_from(SimpleNamespace(init=second)) == (
        f"- Started from the weights of the drafter then at `{second}`, which `jaxspec-train b`"
        " trained; that drafter started from the weights of the drafter then at `d` (top-1"
        " 0.5), which `jaxspec-train a` trained.\n"
    )
