"""Runs the command-line tools on bad input and checks what a user sees: exit 2, one
`error: ...` line on stderr, no traceback, files untouched. A case runs the installed
console script in a new process when it needs one (raw argv bytes, stdin, environment),
else the script's own `main` in this process (the same code, without a second of start-up
and model loading per case)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

TOOLS = {
    "generate": ("jaxspec-generate", "infer.generate"),
    "bench": ("jaxspec-bench", "infer.bench"),
    "convert": ("jaxspec-convert", "checkpoints_convert"),
    "train": ("jaxspec-train", "train"),
}
# The function each console script calls (pyproject.toml's [project.scripts]).
MAINS = {
    "generate": "jaxspec.tools.infer.generate",
    "bench": "jaxspec.tools.infer.bench",
    "convert": "jaxspec.tools.checkpoints_convert.cli",
    "train": "jaxspec.tools.train.cli",
}


@dataclasses.dataclass
class Case:
    """One bad input. `args` and `setup` get the case's own folder and the tiny checkpoint's
    folder; `expect` is a piece of the error line; `keep` are paths (relative to the case's
    folder) whose bytes must be the same after the run."""

    id: str
    tool: str
    args: Callable[[Path, Path], list]
    expect: str
    setup: Callable[[Path, Path], None] | None = None
    stdin: bytes | None = None
    env: dict = dataclasses.field(default_factory=dict)
    keep: tuple[str, ...] = ()
    process: bool = False  # a new process even when this one could run it

    def needs_process(self, args: list) -> bool:
        return (
            self.process
            or self.stdin is not None
            or bool(self.env)
            or any(isinstance(a, bytes) for a in args)
        )


def tool_command(tool: str) -> list[str]:
    script, module = TOOLS[tool]
    installed = Path(sys.executable).parent / script
    return [str(installed)] if installed.exists() else [sys.executable, "-m", module]


def run_tool(tool: str, args: list, cwd: Path, stdin: bytes | None = None, env=None):
    """The tool's CompletedProcess (bytes out, bytes err); args may hold bytes (raw argv)."""
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    full_env.pop("JAXSPEC_DEBUG", None)
    full_env.update(env or {})
    return subprocess.run(
        [*tool_command(tool), *[a if isinstance(a, bytes) else str(a) for a in args]],
        cwd=cwd, input=stdin if stdin is not None else b"", capture_output=True, env=full_env,
        timeout=600,
    )  # fmt: skip


@dataclasses.dataclass
class Done:
    returncode: int
    stderr: bytes


def run_in_process(tool: str, args: list, cwd: Path) -> Done:
    """The console script's main(argv) here, with stderr captured."""
    main = importlib.import_module(MAINS[tool]).main
    err, code, before = io.StringIO(), 0, Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(before)
    return Done(code, err.getvalue().encode())


def digest(root: Path, paths) -> dict[str, str]:
    """sha1 of every file under each path (a file or a folder)."""
    out = {}
    for rel in paths:
        base = root / rel
        files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
        for f in files:
            out[str(f.relative_to(root))] = hashlib.sha1(f.read_bytes()).hexdigest()
    return out


def check_one_line_error(done, expect: str) -> str:
    err = done.stderr.decode("utf-8", "replace").strip()
    assert "Traceback" not in err, err
    assert done.returncode == 2, (done.returncode, err)
    assert err.startswith("error: ") and "\n" not in err, err
    assert expect in err, (expect, err)
    return err


def run_case(case: Case, folder: Path, ckpt: Path) -> str:
    """Set up, run and check one case -> its error line."""
    folder.mkdir(parents=True, exist_ok=True)
    if case.setup:
        case.setup(folder, ckpt)
    before = digest(folder, case.keep)
    assert before or not case.keep, "nothing to keep was set up"
    args = case.args(folder, ckpt)
    if case.needs_process(args):
        done = run_tool(case.tool, args, folder, case.stdin, case.env)
    else:
        done = run_in_process(case.tool, args, folder)
    err = check_one_line_error(done, case.expect)
    assert digest(folder, case.keep) == before, "the user's files changed"
    return err
