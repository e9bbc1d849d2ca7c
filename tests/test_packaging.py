"""The built wheel: the tools install under jaxspec.tools (no top-level `train`, `infer`,
`checkpoints_convert` or `repro` to shadow a user's modules), the shipped drafters travel as
package data and are found there, outside any source checkout."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = out / "src"  # a copy of the work tree: building in place would leave build/ here
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (build / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, build / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(build)],
        check=True, capture_output=True,
    )  # fmt: skip
    (found,) = out.glob("jaxspec-*.whl")
    return found


def test_wheel_namespaces_the_tools(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith("-info")}
    assert tops == {"jaxspec"}, tops
    for module in ("tools/train/cli.py", "tools/infer/generate.py", "tools/train/firp.py",
                   "tools/checkpoints_convert/cli.py", "drafters/settings.py"):  # fmt: skip
        assert f"jaxspec/{module}" in names
    shipped = [n for n in names if n.startswith("jaxspec/shipped_drafters/")]
    for method in ("medusa", "firp", "chimera", "sdsat", "ppd", "eagle"):
        for file in ("drafter.json", "drafter.safetensors", "CARD.md"):
            assert any(n.endswith(f"/{method}/{file}") for n in shipped), (method, file)
    entry = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith("entry_points.txt")))
        .decode()
    )
    assert "jaxspec-train = jaxspec.tools.train.cli:main" in entry


def test_installed_wheel_finds_its_drafters_and_tools(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import importlib.util, jaxspec.methods as m, jaxspec.tools.train.firp;"
        "print(m.DRAFTERS_DIR);"
        "print(importlib.util.find_spec('train'), importlib.util.find_spec('infer'))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    drafters, specs = run.stdout.splitlines()
    assert Path(drafters) == site / "jaxspec" / "shipped_drafters"
    assert (Path(drafters) / "SmolLM2-135M-Instruct" / "firp" / "drafter.json").is_file()
    assert specs == "None None"


def load_check_python():
    spec = importlib.util.spec_from_file_location("check_python", ROOT / "scripts/check_python.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_python_floor_is_the_one_jax_needs():
    """requires-python is the oldest jax we allow's (checked where that jax is installed:
    a newer one may need a newer Python, which pip sees to)."""
    check = load_check_python()
    pyproject = (ROOT / "pyproject.toml").read_text()
    ours = check.required(pyproject)
    oldest_jax = re.search(r'"jax>=([0-9.]+)', pyproject).group(1)
    if importlib.metadata.version("jax").startswith(oldest_jax + "."):
        jax_requires = importlib.metadata.metadata("jax")["Requires-Python"]
        jax_floor = re.fullmatch(r">=\s*([0-9.]+)", jax_requires).group(1)
        assert ours == tuple(int(p) for p in jax_floor.split("."))
    assert f"Python {'.'.join(map(str, ours))}+" in (ROOT / "README.md").read_text()
    assert check.problem((*ours, 0), ours) is None and check.problem((3, 99, 1), ours) is None
    message = check.problem((3, 10, 13), (3, 11))
    assert message.startswith("error: ") and "\n" not in message
    assert "Python 3.11 or newer" in message and "3.10.13" in message
    assert "PYTHON=python3.11" in message


def test_make_refuses_an_old_python_before_making_the_venv(tmp_path):
    for name in ("Makefile", "pyproject.toml", "scripts/check_python.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    old = tmp_path / "python3.10"  # this interpreter, reporting itself as 3.10.13
    old.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import runpy, sys; "
        'sys.version_info = (3, 10, 13, "final", 0); sys.argv = sys.argv[1:]; '
        'runpy.run_path(sys.argv[0], run_name="__main__")\' "$@"\n'
    )
    old.chmod(0o755)
    run = subprocess.run(["make", "setup", f"PYTHON={old}"], cwd=tmp_path, capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode != 0
    assert "jaxspec needs Python 3.11 or newer" in run.stderr
    assert "this is Python 3.10.13" in run.stderr
    assert not (tmp_path / ".venv").exists()
