"""Decoding limits through jaxspec-generate (tests/cli_harness.py) on the tiny checkpoint
(V 101, context 512): a tree wider than the vocabulary, a verify step too large for this
machine's memory and a request longer than the cache each end in one `error:` line (exit
2), refused before compiling. The trees come from a Medusa drafter written in each case's
setup (zero-initialised heads, as `jaxspec-train medusa` starts them), with a head for each
depth of the tree."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from jaxspec.checkpoint import load_checkpoint
from jaxspec.drafters.medusa import MedusaDrafter, MedusaSettings
from jaxspec.drafters.store import save_drafter
from tests.cli_harness import Case, run_case


def medusa(n_heads: int):
    """Setup: folder/d, an untrained Medusa drafter with n_heads heads for the checkpoint."""

    def setup(folder: Path, ckpt: Path) -> None:
        cfg, params = load_checkpoint(ckpt)
        heads = MedusaDrafter(cfg, n_heads).init(params, jax.random.key(0))
        save_drafter(folder / "d", "medusa", MedusaSettings(n_heads=n_heads), heads, cfg, "card")

    return setup


def generate(*args, method="medusa"):
    """jaxspec-generate on the tiny checkpoint; with medusa, the case's drafter."""

    def argv(folder: Path, ckpt: Path) -> list:
        drafter = ["--drafter", folder / "d"] if method == "medusa" else []
        return ["--model", ckpt, "--method", method, *drafter, "--no-chat", *args]

    return argv


CASES = [
    Case(
        "tree-wider-than-vocabulary",
        "generate",
        generate("w5 w9", "--tree", "comb-2-500"),
        "tree comb-2-500 (1001 nodes) takes the top 500 guesses per node, more than the "
        "model's vocabulary of 101 tokens",
        setup=medusa(2),
    ),
    # 20201 nodes against a 512-slot cache: about 14 GB a row for the attention scores and
    # probabilities ([B,4,T,S+T] float32, twice), 1.4 TB for the batch of 100. In a process
    # of its own: were the check missing, the allocation would not take the tests down.
    Case(
        "tree-too-large-for-memory",
        "generate",
        generate(*["w5"] * 100, "--tree", "comb-200-101", "--max-new-tokens", "1"),
        "a verify step of tree comb-200-101 (20201 nodes) with batch 100 and a 512-slot "
        "cache needs about",
        setup=medusa(200),
        process=True,
    ),
    # One prompt token + 511 new ones fill the 512 positions (the tree's 2 x (2 + 1) slots
    # lie past them); one more does not fit.
    Case(
        "prompt-and-answer-beyond-the-cache",
        "generate",
        generate("w5", "--tree", "chain-2", "--max-new-tokens", "512"),
        "prompt of 1 tokens + 512 new tokens need 513 positions, which exceeds the limit of "
        "512 positions",
        setup=medusa(2),
    ),
    Case(
        "prompt-beyond-the-cache",
        "generate",
        generate("w5 w9 w7", "--max-new-tokens", "600", method="ar"),
        "prompt of 3 tokens + 600 new tokens need 603 positions",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_decode_input(case: Case, tiny_ckpt, tmp_path):
    err = run_case(case, tmp_path / "case", tiny_ckpt[0])
    if case.id == "tree-too-large-for-memory":
        assert " GB, more than the " in err and "GB available" in err
