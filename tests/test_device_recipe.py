"""The training lines docs/device.md gives a GPU loan parse as the trainer parses them, and
leave the trainer its evaluation time before `timeout` ends it: a loan's 15 minutes are too
few to lose one to a mistyped flag."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from train import eagle

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "device.md"
# after the steps stop: the evaluation, the accepted-tokens measurement and the card
EVALUATION_S = 120


def _train_lines() -> list[str]:
    return [line for line in DOC.read_text(encoding="utf-8").splitlines()
            if "python3 -m train " in line]  # fmt: skip


def test_the_loan_training_lines_parse(tmp_path, monkeypatch):
    lines = _train_lines()
    assert len(lines) >= 2, "docs/device.md has lost its training lines"
    questions = tmp_path / "spec_bench_question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi?"]}))
    monkeypatch.chdir(ROOT)  # --init drafters/... is relative to the tree
    for line in lines:
        timeout = re.search(r"timeout (\d+) python3 -m train (\w+) (.*?) 2>&1", line)
        assert timeout, f"a training line without `timeout N` before it: {line[:80]}"
        seconds, method, rest = int(timeout[1]), timeout[2], timeout[3]
        assert method == "eagle"
        argv = shlex.split(rest.replace("$OUT", str(tmp_path / "out")))
        argv = [str(questions) if a.endswith("spec_bench_question.jsonl") else a for a in argv]
        args = eagle.parse_args(argv)
        assert args.init is not None and args.keep_vocab and args.states == "live"
        assert args.max_minutes * 60 + EVALUATION_S <= seconds, (
            f"timeout {seconds} leaves the trainer too little time after --max-minutes "
            f"{args.max_minutes}"
        )
