"""jaxspec-train on bad input (issue 27): one `error:` line, exit 2, no traceback, the user's
files untouched, found before any work; where a run writes by default; caches written whole."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import numpy as np
import pytest

from jaxspec.drafters.store import save_drafter
from jaxspec.errors import JaxspecError
from jaxspec.outputs import exclusive
from tests.cli_harness import Case, run_case
from tests.conftest import tiny_training_args

CACHE = "work/self-train-8-p40-n24.npz"  # the answers ppd reads first with tiny_args()
REPO_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
SHIPPED = REPO_DRAFTERS / "SmolLM2-135M-Instruct"


def tiny_args(method: str, *extra):
    """`jaxspec-train METHOD` on the tiny checkpoint, its folders in the case's own, then
    `extra` (later flags win; a callable gets the case's folder and the checkpoint)."""

    def args(folder: Path, ckpt: Path) -> list:
        flags = tiny_training_args(ckpt, folder)
        if method in ("ppd", "firp"):
            flags += ["--layers", "1,2"]
        return [method, *flags, *(e(folder, ckpt) if callable(e) else e for e in extra)]

    return args


def write(rel: str, data: bytes = b"kept"):
    def setup(folder: Path, ckpt: Path) -> None:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)

    return setup


def tiny_sdsat_drafter(folder: Path, ckpt: Path) -> None:
    """folder/d: an untrained SDSAT adapter of the tiny checkpoint."""
    from tests.test_bad_inputs import SETTINGS, _initial_drafter

    cfg, params = _initial_drafter("sdsat", ckpt)
    save_drafter(folder / "d", "sdsat", SETTINGS["sdsat"], params, cfg, "card")


def truncated_npz() -> bytes:
    """An answers file cut short, as a crash mid-write left it before writes were atomic."""
    buffer = io.BytesIO()
    np.savez(buffer, tokens=np.zeros((8, 64), np.int32), lengths=np.ones(8, np.int32))
    return buffer.getvalue()[:200]


CASES = [
    Case("train-seqs-0", "train", tiny_args("ppd", "--train-seqs", "0"),
         "--train-seqs: must be at least 1, got 0"),
    Case("train-seqs-negative", "train", tiny_args("medusa", "--train-seqs", "-3"),
         "--train-seqs: must be at least 1, got -3"),
    Case("steps-0", "train", tiny_args("chimera", "--steps", "0"), "--steps: must be at least 1"),
    # paths read late (after the answers are made) are checked first
    Case("init-missing", "train", tiny_args("medusa", "--init", lambda f, c: f / "none"),
         "none: no drafter there (needs drafter.json and drafter.safetensors)"),
    Case("init-other-method", "train", tiny_args("medusa", "--init", str(SHIPPED / "firp")),
         "holds a 'firp' drafter, not 'medusa'; pass a medusa drafter folder"),
    Case("init-other-model", "train", tiny_args("medusa", "--init", str(SHIPPED / "medusa")),
         "was trained for 'SmolLM2-135M-Instruct'"),
    Case("eval-questions-missing", "train",
         tiny_args("eagle", "--eval-questions", lambda f, c: f / "q.jsonl"),
         "no question file at"),
    Case("skip-prompts-form", "train", tiny_args("eagle", "--skip-prompts", "first:64"),
         "--skip-prompts: takes TURNS:N:LEN"),
    Case("skip-prompts-zero", "train", tiny_args("eagle", "--skip-prompts", "every:0:40"),
         "integers >= 1, e.g. first:6400:128; got 'every:0:40'"),
    Case("skip-prompts-written", "train",
         tiny_args("eagle", "--turns", "written", "--skip-prompts", "first:8:40"),
         "--skip-prompts leaves ShareGPT prompts out"),
    Case("seed-too-big", "train", tiny_args("sdsat", "--seed", str(2**64)), "--seed: a seed is"),
    Case("lr-inf", "train", tiny_args("firp", "--lr", "inf"), "--lr: 'inf' is not a finite"),
    Case("layers-text", "train", tiny_args("firp", "--layers", "1,two"),
         "--layers: takes comma-separated integers"),
    Case("layers-0", "train", tiny_args("ppd", "--layers", "0,2"),
         "--layers: takes integers >= 1, got '0,2'"),
    Case("cpu-tree", "train", tiny_args("sdsat", "--cpu-tree", "bushy"), "unknown tree 'bushy'"),
    Case("cpu-tree-dynamic", "train", tiny_args("sdsat", "--cpu-tree", "dynamic-8"),
         "sdsat drafts fixed trees"),  # fmt: skip
    Case("loss-basic-adapter", "train", tiny_args("sdsat", "--loss", "basic"),
         "--loss basic applies to --mode full only"),  # fmt: skip
    Case("init-full-sdsat", "train",
         tiny_args("sdsat", "--mode", "full", "--init", lambda f, c: f / "d"),
         "--mode full fine-tunes the model itself from its own weights: drop --init",
         setup=tiny_sdsat_drafter),
    Case("out-not-empty", "train", tiny_args("medusa"), "is not empty; pass --overwrite",
         setup=write("out/CARD.md"), keep=("out",)),
    Case("out-under-a-file", "train", tiny_args("ppd", "--out", lambda f, _: f / "f" / "sub"),
         "is a file, not a folder", setup=write("f"), keep=("f",)),
    Case("out-in-proc", "train", tiny_args("ppd", "--out", "/proc/jaxspec-out"),
         "--out /proc/jaxspec-out is not writable"),
    Case("out-is-the-model", "train", tiny_args("ppd", "--out", lambda _, c: c, "--overwrite"),
         "would overwrite the source"),
    Case("work-dir-under-a-file", "train",
         tiny_args("sdsat", "--work-dir", lambda f, _: f / "f" / "work"),
         "--work-dir", setup=write("f"), keep=("f",)),
    Case("damaged-cache", "train", tiny_args("ppd"), f"{CACHE} is damaged (BadZipFile)",
         setup=write(CACHE, truncated_npz()), keep=(CACHE,)),
]  # fmt: skip


@pytest.fixture
def ckpt(tiny_ckpt, monkeypatch, tmp_path):
    """The tiny checkpoint; $JAXSPEC_HOME a fresh folder, for the tools run here too."""
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path / "home"))
    return tiny_ckpt[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_one_line(case, ckpt, tmp_path):
    run_case(case, tmp_path, ckpt)


@pytest.mark.parametrize("init", ["firp", "medusa"])  # another method's; another model's
def test_a_wrong_init_is_refused_before_any_answers_are_made(init, ckpt, tmp_path):
    import train.medusa as medusa

    args = tiny_args("medusa", "--init", str(SHIPPED / init))(tmp_path, ckpt)[1:]
    with pytest.raises(JaxspecError):
        medusa.train(args)
    assert not list(tmp_path.rglob("*.npz")) and not list(tmp_path.rglob("*.partial*"))


def test_a_second_training_on_a_work_dir_is_refused(ckpt, tmp_path):
    case = Case("busy", "train", tiny_args("ppd"), f"is in use by process {os.getpid()}")
    with exclusive(tmp_path / "work"):
        run_case(case, tmp_path, ckpt)


@pytest.mark.parametrize("method", ["medusa", "firp", "chimera", "sdsat", "ppd"])
def test_the_default_out_is_the_runs_own_folder_in_jaxspec_home(method, ckpt, tmp_path,
                                                                monkeypatch, capsys):  # fmt: skip
    """Without --out a trainer writes to $JAXSPEC_HOME/drafters/<model>/<method>-<run>, never
    the repository's drafters/; the same flags (--overwrite aside) name the same folder."""
    import importlib

    from train.skeleton import Trainer

    trainer = importlib.import_module(f"train.{method}")
    monkeypatch.setattr(Trainer, "run", lambda self, work, out: out)
    args = tiny_args(method)(tmp_path, ckpt)[1:]
    del args[args.index("--out") : args.index("--out") + 2]
    out = trainer.train(args)
    assert out.parent.parent == tmp_path / "home" / "drafters" and REPO_DRAFTERS not in out.parents
    assert out.name.startswith(f"{method}-")
    assert f"writing to {out}" in capsys.readouterr().out
    assert trainer.train([*args, "--overwrite"]) == out
    write("drafter.json")(out, ckpt)  # a finished run's folder: its rerun rewrites it
    assert trainer.train(args) == out
    assert trainer.train([*args, "--save-every", "7"]) == out  # not a training flag
    assert trainer.train([*args, "--seed", "7"]) != out


def test_a_default_folder_that_cannot_be_written_is_refused_first(ckpt, tmp_path, monkeypatch):
    """Without --out and --work-dir the defaults in $JAXSPEC_HOME are checked as given ones
    are, before the run starts."""
    from train import medusa
    from train.skeleton import Trainer

    monkeypatch.setattr(Trainer, "run", lambda self, work, out: pytest.fail("it ran"))
    write("home")(tmp_path, ckpt)  # $JAXSPEC_HOME is a file
    args = tiny_training_args(ckpt, tmp_path)
    del args[args.index("--out") : args.index("--out") + 2]
    with pytest.raises(JaxspecError, match="--out .*home is a file, not a folder"):
        medusa.train(args)


def test_a_crash_mid_write_leaves_no_cache_file(tiny_ckpt, tmp_path, monkeypatch):
    from jaxspec.models import load_model
    from train.features import extract_sequences

    def crash(file, **arrays):
        file.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", crash)
    data = {"tokens": np.arange(16, dtype=np.int32).reshape(2, 8) + 5,
            "lengths": np.array([8, 6], np.int32)}  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        extract_sequences(load_model(tiny_ckpt[0]), data, tmp_path / "features.npz", batch=2)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_real_pass_names_its_file(tmp_path):
    from train.firp import open_array

    path = tmp_path / "keys.npy"
    np.save(path, np.zeros((4, 8), np.float16))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(JaxspecError, match=re.escape(f"cache file {path} is damaged")):
        open_array(path, (4, 8), resume=True)
