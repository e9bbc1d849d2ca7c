"""Hostile and careless inputs to jaxspec-generate, jaxspec-bench and jaxspec-convert, run
through the installed tools: each ends in one `error:` line (exit 2), never a traceback,
and the cases that could lose data leave the user's files byte-identical. (Training's
cases: test_bad_inputs_train.py; decoding limits: test_bad_inputs_decode.py.)"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxspec.checkpoint import CONFIG_FILE, load_checkpoint
from jaxspec.cli import run_main
from jaxspec.drafters.chimera import ChimeraSettings
from jaxspec.drafters.eagle import EagleSettings
from jaxspec.drafters.firp import FirpSettings
from jaxspec.drafters.medusa import MedusaSettings
from jaxspec.drafters.sdsat import SdsatSettings
from jaxspec.drafters.store import META, WEIGHTS, save_drafter
from jaxspec.errors import JaxspecError
from jaxspec.ppd import PpdSettings
from tests.cli_harness import Case, run_case

PROMPT = "w5 w9 w7"


def copy_ckpt(folder: Path, ckpt: Path, **config) -> None:
    """folder/m: the tiny checkpoint with `config` written over its jaxspec.json."""
    shutil.copytree(ckpt, folder / "m")
    cfg = json.loads((folder / "m" / CONFIG_FILE).read_text())
    (folder / "m" / CONFIG_FILE).write_text(json.dumps({**cfg, **config}))


def write(name: str, data: bytes | str):
    def setup(folder: Path, ckpt: Path) -> None:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)

    return setup


def questions(*lines) -> Callable:
    return write("q.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")


def gen(*args):
    """jaxspec-generate on the tiny checkpoint."""
    return lambda folder, ckpt: ["--model", ckpt, *args]


def without_tokenizer(ckpt: Path, out: Path) -> None:
    shutil.copytree(ckpt, out)
    for file in out.glob("tokenizer*"):
        file.unlink()


def bench(*args):
    return lambda folder, ckpt: ["--model", ckpt, "--questions", folder / "q.jsonl", *args]


# -- drafters that do not fit: each method's init, then one tensor dropped or misshapen --

SETTINGS = {
    "medusa": MedusaSettings(n_heads=2),
    "firp": FirpSettings(layers=(1, 2)),
    "chimera": ChimeraSettings(n_heads=2),
    "sdsat": SdsatSettings(rank=2),
    "eagle": EagleSettings(layers=(1, 1, 2)),
}


def _initial_drafter(method: str, ckpt: Path):
    from jaxspec.methods import make_drafter

    cfg, params = load_checkpoint(ckpt)
    drafter = make_drafter(method, cfg, SETTINGS[method])
    return cfg, drafter.init(params, jax.random.key(0))


def _first_leaf_parent(tree):
    """(dict, key) of the first array leaf, depth first."""
    while True:
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        key, value = next(iter(items))
        if isinstance(value, (dict, list)):
            tree = value
        else:
            return tree, key


def bad_drafter(method: str, damage: str):
    def setup(folder: Path, ckpt: Path) -> None:
        cfg, params = _initial_drafter(method, ckpt)
        parent, key = _first_leaf_parent(params)
        if damage == "missing":
            del parent[key]
        else:
            parent[key] = np.zeros((3, 5), np.float32)
        save_drafter(folder / "d", method, SETTINGS[method], params, cfg, "card")

    return setup


def settings_without(key: str):
    def setup(folder: Path, ckpt: Path) -> None:
        cfg, params = _initial_drafter("medusa", ckpt)
        save_drafter(folder / "d", "medusa", SETTINGS["medusa"], params, cfg, "card")
        meta = json.loads((folder / "d" / META).read_text())
        del meta["settings"][key]
        (folder / "d" / META).write_text(json.dumps(meta))

    return setup


def bad_ppd_heads(folder: Path, ckpt: Path) -> None:
    cfg, _ = load_checkpoint(ckpt)
    heads = {"layer1": {"w": np.zeros((cfg.dim, 3), np.float32), "b": np.zeros(cfg.dim)}}
    save_drafter(folder / "d", "ppd", PpdSettings(default_layer=1), {"heads": heads}, cfg, "card")


def drafter_files(meta: str):
    def setup(folder: Path, ckpt: Path) -> None:
        write(f"d/{META}", meta)(folder, ckpt)
        write(f"d/{WEIGHTS}", b"")(folder, ckpt)

    return setup


def with_drafter(method: str, *args):
    return lambda folder, ckpt: ["--model", ckpt, "--method", method, "--drafter", folder / "d",
                                 *args, PROMPT]  # fmt: skip


def hf_config(**changes):
    """folder/hf: an HF config.json of a tiny Llama with `changes` (weights are read after
    the config, so none are needed to be refused)."""
    base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 101,
            "hidden_size": 48, "intermediate_size": 83, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}  # fmt: skip
    return write("hf/config.json", json.dumps({**base, **changes}))


def ckpt_copy(folder: Path, ckpt: Path) -> None:
    shutil.copytree(ckpt, folder / "m")


def nonempty_out(folder: Path, ckpt: Path) -> None:
    write("out/notes.txt", "mine")(folder, ckpt)


CASES = [
    # silently wrong results become errors
    Case("temperature-nan", "generate", gen("--temperature", "nan", PROMPT), "finite"),
    Case("temperature-inf", "generate", gen("--temperature", "inf", PROMPT), "finite"),
    Case("temperature-negative", "generate", gen("--temperature", "-1", PROMPT), "greedy"),
    Case("top-p-zero", "generate", gen("--temperature", "1", "--top-p", "0", PROMPT), "(0, 1]"),
    Case("max-new-tokens-zero", "generate", gen("--max-new-tokens", "0", PROMPT), "at least 1"),
    Case("turns-string", "bench", bench(), "turns", questions({"question_id": 1, "turns": "hi"})),
    Case("turns-empty", "bench", bench(), "turns", questions({"question_id": 1, "turns": []})),
    Case("limit-zero", "bench", bench("--limit", "0"), "--limit", questions()),
    Case("limit-negative", "bench", bench("--limit", "-2"), "--limit", questions()),
    Case(
        "bench-ppd-layer-not-number",
        "bench",
        bench("--methods", "ppd@x"),
        "@LAYER (the early-prediction layer, a number) expected",
        questions({"question_id": 1, "turns": ["w5"]}),
    ),
    Case("per-category-zero", "bench", bench("--per-category", "0"), "--per-category"),
    Case("bench-row-twice", "bench", bench("--methods", "ar,lookup,lookup"), "names lookup twice"),
    Case("mesh-axis-twice", "generate", gen("--mesh", "model=2,model=4", PROMPT), "at most once"),
    Case("top-p-greedy", "generate", gen("--top-p", "0.5", PROMPT), "or drop it for greedy"),
    Case(
        "questions-folder",
        "bench",
        lambda f, c: ["--model", c, "--questions", f, "--methods", "ar"],
        "is a folder; pass a Spec-Bench-format .jsonl file",
    ),
    Case(
        "config-not-json",
        "convert",
        lambda f, c: [f / "hf", "--out", f / "o"],
        "config.json (JSONDecodeError: Expecting",
        write("hf/config.json", "{oops"),
    ),
    Case(
        "config-not-an-object",
        "convert",
        lambda f, c: [f / "hf", "--out", f / "o"],
        "config.json (ValueError: a JSON list, not an object); fix it",
        write("hf/config.json", "[]"),
    ),
    Case(
        "no-tokenizer",
        "generate",
        lambda f, c: ["--model", f / "bare", PROMPT],
        "has no tokenizer (tokenizer.json or tokenizer.model) to read the prompt with: convert",
        setup=lambda f, c: without_tokenizer(c, f / "bare"),
    ),
    Case(
        "typical-on-ar",
        "generate",
        gen("--method", "ar", "--typical", "--temperature", "1", PROMPT),
        "method 'ar' drafts none",
    ),
    Case(
        "qwen2-window-on-some-layers",
        "convert",
        lambda f, c: [f / "hf", "--out", f / "o"],
        "sliding window on some layers only",
        hf_config(model_type="qwen2", use_sliding_window=True, sliding_window=16),
    ),
    Case(
        "moe-architecture",
        "convert",
        lambda f, c: [f / "hf", "--out", f / "o"],
        "Qwen2/2.5 ('qwen2') and dense Qwen3",
        hf_config(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]),
    ),
    # one line, never a traceback
    Case(
        "n-layers-below-weights",
        "generate",
        lambda f, c: ["--model", f / "m", PROMPT],
        "n_layers=1",
        lambda f, c: copy_ckpt(f, c, n_layers=1),
    ),
    Case(
        "n-layers-not-integer",
        "generate",
        lambda f, c: ["--model", f / "m", PROMPT],
        "n_layers must be an integer",
        lambda f, c: copy_ckpt(f, c, n_layers="two"),
    ),
    Case(
        "drafter-json-invalid",
        "generate",
        with_drafter("medusa"),
        "not valid JSON",
        drafter_files("{not json"),
    ),
    Case(
        "drafter-json-no-settings",
        "generate",
        with_drafter("medusa"),
        '"settings"',
        drafter_files(json.dumps({"method": "medusa"})),
    ),
    Case(
        "drafter-settings-incomplete",
        "generate",
        with_drafter("medusa"),
        "settings do not fit MedusaSettings (missing n_heads)",
        settings_without("n_heads"),
    ),
    *[
        Case(
            f"drafter-{method}-{damage}",
            "generate",
            with_drafter(method),
            "missing" if damage == "missing" else "expected",
            bad_drafter(method, damage),
        )
        for method in SETTINGS
        for damage in ("missing", "misshapen")
    ],
    Case(
        "drafter-ppd-misshapen",
        "generate",
        with_drafter("ppd", "--ppd-layer", "1"),
        "PPD heads",
        bad_ppd_heads,
    ),
    Case(
        "top-k-above-vocabulary",
        "generate",
        gen("--temperature", "1", "--top-k", "500", PROMPT),
        "exceeds the vocabulary (101 tokens)",
    ),
    Case("seed-beyond-64-bits", "generate", gen("--seed", str(2**64), PROMPT), "seed"),
    Case("seed-beyond-32-bits", "generate", gen("--seed", str(2**32), PROMPT), "2**32 - 1"),
    Case("seed-negative", "generate", gen("--seed", "-1", PROMPT), "seed"),
    Case("prompt-not-utf8", "generate", gen(b"\xff\xfe bad"), "not UTF-8"),
    Case("stdin-not-utf8", "generate", gen("-"), "standard input is not UTF-8", stdin=b"\xff\n"),
    Case("questions-not-utf8", "bench", bench(), "not UTF-8", write("q.jsonl", b"\xff\xfe\n")),
    Case("ppd-k-negative", "generate", gen("--method", "ppd", "--ppd-k", "-1", PROMPT), "--ppd-k"),
    # k + 1 devices: refused before XLA is asked for them
    Case(
        "ppd-k-huge",
        "generate",
        gen("--method", "ppd", "--ppd-k", "1000000", PROMPT),
        "--ppd-k: must be from 1 to 16, got 1000000",
    ),
    # data loss: outputs checked before any work, sources and users' files never replaced
    Case(
        "bench-out-markdown",
        "bench",
        bench("--out", "r.md"),
        "name the results .json",
        questions({"question_id": 1, "turns": ["w5"]}),
    ),
    Case(
        "bench-out-folder",
        "bench",
        bench("--out", "r.json"),
        "is a folder",
        write("r.json/mine.txt", "mine"),
        keep=("r.json",),
    ),
    Case(
        "bench-out-unwritable",
        "bench",
        bench("--out", "f/r.json"),
        "is a file, not a folder",
        write("f", "mine"),
        keep=("f",),
    ),
    Case(
        "bench-out-no-permission",
        "bench",
        bench("--out", "/proc/jaxspec/r.json"),
        "is not writable",
        questions({"question_id": 1, "turns": ["w5"]}),
    ),
    Case(
        "bench-out-exists",
        "bench",
        bench("--out", "r.json"),
        "--overwrite",
        write("r.json", "{}"),
        keep=("r.json",),
    ),
    Case(
        "convert-out-is-source",
        "convert",
        lambda f, c: [f / "m", "--out", f / "m"],
        "would overwrite the source",
        ckpt_copy,
        keep=("m",),
    ),
    Case(
        "convert-to-hf-out-is-source",
        "convert",
        lambda f, c: [f / "m", "--out", f / "m", "--to", "hf", "--overwrite"],
        "would overwrite the source",
        ckpt_copy,
        keep=("m",),
    ),
    Case(
        "convert-out-inside-source",
        "convert",
        lambda f, c: [f / "m", "--out", f / "m" / "x"],
        "would overwrite the source",
        ckpt_copy,
        keep=("m",),
    ),
    Case(
        "convert-out-holds-source",
        "convert",
        lambda f, c: [f / "m", "--out", f, "--overwrite"],
        "would overwrite the source",
        ckpt_copy,
        keep=("m",),
    ),
    Case(
        "convert-out-not-empty",
        "convert",
        lambda f, c: [c, "--out", f / "out"],
        "--overwrite",
        nonempty_out,
        keep=("out",),
    ),
    Case("convert-no-out", "convert", lambda f, c: [c], "--out DIR is required when SRC is given"),
    Case(
        "convert-out-unwritable",
        "convert",
        lambda f, c: [c, "--out", f / "f" / "out"],
        "is a file, not a folder",
        write("f", "mine"),
        keep=("f",),
    ),
    Case(
        "convert-home-unwritable",
        "convert",
        lambda f, c: [],
        "model cache ($JAXSPEC_HOME)",
        env={"JAXSPEC_HOME": "/proc/jaxspec-home"},
    ),
    Case(
        "generate-home-unwritable",
        "generate",
        lambda f, c: [PROMPT],
        "model cache ($JAXSPEC_HOME)",
        env={"JAXSPEC_HOME": "/proc/jaxspec-home"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, tiny_ckpt, tmp_path):
    run_case(case, tmp_path / "case", tiny_ckpt[0])


def test_overwrite_lets_a_tool_into_a_folder_holding_files(tmp_path):
    from jaxspec.outputs import check_output_dir

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(JaxspecError, match="pass --overwrite"):
        check_output_dir(tmp_path / "out", [tmp_path / "src"])
    check_output_dir(tmp_path / "out", [tmp_path / "src"], overwrite=True)


def test_files_written_whole_take_the_umasks_mode(tmp_path, monkeypatch):
    """(mkstemp's 0600 once reached every result, model and drafter written atomically.)"""
    import os

    from jaxspec import outputs

    mask = os.umask(0o022)
    os.umask(mask)
    assert mask == outputs.UMASK  # read at import
    monkeypatch.setattr(outputs, "UMASK", 0o027)
    outputs.write_text(tmp_path / "a.md", "x")
    outputs.save_npz(tmp_path / "b.npz", {"x": np.zeros(2)})
    assert {(tmp_path / f).stat().st_mode & 0o777 for f in ("a.md", "b.npz")} == {0o640}


def test_bench_default_out_takes_a_free_name(tmp_path, monkeypatch):
    """The default FILE never replaces an earlier run's files: it takes the next number."""
    from infer.bench import output_paths

    monkeypatch.chdir(tmp_path)
    assert output_paths(None, False)[0] == Path("bench_results.json")
    Path("bench_results.md").write_text("earlier")
    assert output_paths(None, False) == tuple(
        Path(f"bench_results-2.{ext}") for ext in ("json", "md", "png")
    )
    assert output_paths(None, True)[0] == Path("bench_results.json")


@pytest.mark.parametrize(
    "raised, code, line",
    [
        (JaxspecError("no model at m;\n  convert one"), 2, "error: no model at m; convert one"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
)
def test_a_users_error_is_one_line_and_an_interrupt_exits_130(raised, code, line, capsys):
    def main(argv):
        raise raised

    with pytest.raises(SystemExit) as done:
        run_main(main, [])
    assert done.value.code == code and capsys.readouterr().err == line + "\n"


def test_a_warning_is_one_line(capsys, monkeypatch):
    def main(argv):
        warnings.warn("the shipped drafter\n  was trained for other weights", stacklevel=1)

    monkeypatch.delenv("JAXSPEC_DEBUG", raising=False)
    run_main(main, [])
    assert capsys.readouterr().err == (
        "warning: the shipped drafter was trained for other weights\n"
    )


def test_unexpected_failure_is_one_line(capsys, monkeypatch):
    """A bug still ends in one line naming the exception; JAXSPEC_DEBUG=1 shows the trace."""

    def broken(argv):
        raise RuntimeError("deep\ninside")

    monkeypatch.delenv("JAXSPEC_DEBUG", raising=False)
    with pytest.raises(SystemExit) as done:
        run_main(broken, [])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and "\n" not in err
    assert err == "error: RuntimeError: deep inside (run with JAXSPEC_DEBUG=1 for the traceback)"
    monkeypatch.setenv("JAXSPEC_DEBUG", "1")
    with pytest.raises(RuntimeError):
        run_main(broken, [])
