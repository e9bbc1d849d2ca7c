"""HumanEval checking: programs built from answers, run in the sandbox."""

from __future__ import annotations

from jaxspec.humaneval import passes, program

PROBLEM = {
    "prompt": 'def add(a, b):\n    """Sum."""\n',
    "entry_point": "add",
    "test": "def check(f):\n    assert f(2, 3) == 5\n",
}


def test_program_takes_the_code_block_or_completes_the_prompt():
    whole = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert program(PROBLEM, whole).startswith("def add(a, b):\n    return a + b\n")
    body = "    return a + b\n"
    assert program(PROBLEM, body).startswith(PROBLEM["prompt"] + body)
    assert program(PROBLEM, body).endswith("check(add)\n")


def test_passes_runs_code_in_the_sandbox_with_a_time_limit(monkeypatch):
    assert passes(program(PROBLEM, "    return a + b\n"))
    assert not passes(program(PROBLEM, "    return a - b\n"))
    assert not passes(program(PROBLEM, "    while True:\n        pass\n"), timeout_s=2)
    assert not passes("import sys\nsys.exit(3)\n")
    monkeypatch.setenv("JAXSPEC_HUMANEVAL_SECRET", "x")
    assert passes("import os\nassert 'JAXSPEC_HUMANEVAL_SECRET' not in os.environ\n")
