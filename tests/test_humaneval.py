"""HumanEval checking: programs built from answers, run in the sandbox."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_the_first_code_block_is_the_answer():
    right, wrong = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return 0\n"
    answer = f"```python\n{right}```\nor\n```python\n{wrong}```"
    assert program(PROBLEM, answer).startswith(right + "\n")


def test_pass_at_1_is_the_fraction_of_problems_whose_answer_passes(monkeypatch):
    """Every problem answered once (batched) and checked alone: 2 of 3 pass."""
    from jaxspec import humaneval

    answers = ["    return a + b\n", "    return a - b\n", "    return b + a\n"]
    problems = [{**PROBLEM, "task_id": f"t{i}", "prompt": PROBLEM["prompt"] + f"# {i}\n"}
                for i in range(3)]  # fmt: skip

    def encode(tokenizer, messages):  # the prompt -> its problem's index as the one token
        return [next(i for i, p in enumerate(problems) if p["prompt"] in messages[0]["content"])]

    class Generator:  # greedy answers: each prompt's own
        def __init__(self, cfg, params):
            pass

        def generate_batch(self, prompts, max_new_tokens):
            return [SimpleNamespace(token_ids=p) for p in prompts]

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: answers[ids[0]])
    monkeypatch.setattr(humaneval, "encode_conversation", encode)
    monkeypatch.setattr(humaneval, "SpeculativeGenerator", Generator)
    model = SimpleNamespace(cfg=None, params=None, tokenizer=tokenizer)
    got = humaneval.pass_at_1(model, problems, batch=2)
    assert got == {"pass@1": 0.6667, "passed": ["t0", "t2"]}
