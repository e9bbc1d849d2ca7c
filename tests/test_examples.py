"""The examples in examples/ run as a newcomer runs them (`python examples/NAME.py ...`), here
on the tiny checkpoint with tiny settings and untrained drafters: each exits 0 and prints
what its docstring promises, every method matching AR's tokens. The three run at once, in
processes of their own, so that their compilations overlap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxspec
from tests.test_api import write_drafters

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300

# train_and_use.py as a script, with the tests' made-up conversations in place of ShareGPT
# (what tests/conftest.py::train_on_made_up_conversations does in-process), on the path a
# user's Python has: the installed package, no repository root (where `train` would be).
WITHOUT_SHAREGPT = """
import os, runpy, sys
import jaxspec.tools.train.features as features
from tests.test_medusa import conversations
features.sharegpt_split = lambda split: conversations(seed=len(split))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.getcwd()]
for name in [m for m in sys.modules if m.split(".")[0] in ("train", "infer")]:
    del sys.modules[name]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def start(command: list, home: Path) -> subprocess.Popen:
    # The test's own caches and work folders (XLA_FLAGS from conftest: optimisations off).
    env = {**os.environ, "JAXSPEC_HOME": str(home)}
    return subprocess.Popen([str(c) for c in command], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def finish(run: subprocess.Popen) -> str:
    """The example's output, once it has exited 0."""
    stdout, stderr = run.communicate(timeout=TIMEOUT_S)
    assert run.returncode == 0, f"exit {run.returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return stdout


@pytest.fixture(scope="module")
def runs(tiny_ckpt, tmp_path_factory):
    """name -> the running example (each started here, read by its test)."""
    tmp = tmp_path_factory.mktemp("examples")
    ckpt = tiny_ckpt[0]
    drafters = write_drafters(ckpt, tmp / "drafters")
    tiny = ["--model", ckpt, "--max-new-tokens", "8"]
    started = {
        "generate": [EXAMPLES / "generate.py", *tiny, "--drafters", drafters,
                     "--prompt", "w5 w9 w7"],
        "compare": [EXAMPLES / "compare.py", *tiny, "--drafters", drafters,
                    "--methods", "ar", "medusa", "lookup"],
        "train_and_use": ["-c", WITHOUT_SHAREGPT, EXAMPLES / "train_and_use.py", *tiny,
                          "--out", tmp / "trained", "--steps", "4", "--train-seqs", "4",
                          "--prompt", "w5 w9 w7"],
    }  # fmt: skip
    procs = {name: start([sys.executable, *cmd], tmp / "home") for name, cmd in started.items()}
    yield procs
    for proc in procs.values():  # a test that failed early leaves none running
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow  # CI time (~38 s); the other examples stay fast
def test_generate_example_runs_every_method(runs):
    out = finish(runs["generate"])
    for method in jaxspec.METHODS:
        assert f"== {method}: " in out and "tokens/step" in out
    assert out.count("same tokens as AR") == len(jaxspec.METHODS), out
    assert "w" in out.split("\n", 2)[1]  # AR's text: words of the tiny vocabulary


def test_compare_example_prints_a_table(runs):
    out = finish(runs["compare"])
    header, *rows = out.strip().splitlines()
    assert header.split()[:3] == ["method", "tokens/step", "tokens/s"]
    assert [row.split()[0] for row in rows] == ["ar", "medusa", "lookup"]
    assert rows[0].split()[3:] == ["1.00x", "yes"]
    assert all(row.split()[-1] == "yes" for row in rows), out


def test_train_and_use_example_trains_then_decodes_with_the_drafter(runs, tmp_path_factory):
    out = finish(runs["train_and_use"])
    assert "trained: top-1 accuracy per head" in out
    assert out.strip().endswith("the same tokens as AR"), out
    trained = Path(out.split("wrote the drafter to ")[1].split()[0])
    assert (trained / "drafter.json").is_file() and trained.name == "trained"
