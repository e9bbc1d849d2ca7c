"""HumanEval pass@1 (greedy) for a chat model: each problem's prompt is asked as a chat
turn, the first Python block of the answer (or the whole answer) is completed into a
program with the problem's tests, and the program runs in `jaxspec.sandbox` (own session
and temp dir, scrubbed environment, resource limits, no network where the kernel allows,
not as root, nothing left running afterwards): generated code never runs in this process."""

from __future__ import annotations

import re
import warnings

from tqdm import tqdm

from jaxspec.data.sources import HUMANEVAL_PROMPT
from jaxspec.decode import SpeculativeGenerator
from jaxspec.sandbox import network_isolated, run_untrusted
from jaxspec.text import encode_conversation

CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.DOTALL)


def program(problem: dict, answer: str) -> str:
    """The answer's code (its first fenced block, else all of it) as a test program: the
    prompt first when the answer does not define the entry point itself."""
    match = CODE_BLOCK.search(answer)
    code = match.group(1) if match else answer
    if f"def {problem['entry_point']}" not in code:
        code = problem["prompt"] + code
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def passes(source: str, timeout_s: float = 10.0) -> bool:
    """Run `source` in the sandbox; True when it exits 0 within the time limit."""
    result = run_untrusted(source, timeout_s)
    return result.returncode == 0 and not result.timed_out


def pass_at_1(model, problems: list[dict], max_new_tokens: int = 384, batch: int = 16) -> dict:
    """Greedy answers of `model` (a LoadedModel) to every problem, batched -> {"pass@1",
    "passed": [task ids]}."""
    if not network_isolated():
        warnings.warn("no network namespace: HumanEval programs reach the network", stacklevel=2)
    generator = SpeculativeGenerator(model.cfg, model.params)
    passed = []
    for start in tqdm(range(0, len(problems), batch), desc="humaneval", unit="batch"):
        chunk = problems[start : start + batch]
        prompts = [
            encode_conversation(
                model.tokenizer,
                [{"role": "user", "content": HUMANEVAL_PROMPT.format(p["prompt"])}],
            )
            for p in chunk
        ]
        for problem, result in zip(
            chunk, generator.generate_batch(prompts, max_new_tokens), strict=True
        ):
            answer = model.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            if passes(program(problem, answer)):
                passed.append(problem["task_id"])
    return {"pass@1": round(len(passed) / len(problems), 4), "passed": passed}
