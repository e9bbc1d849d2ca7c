"""The command-line options every trainer shares; each trainer adds its own."""

from __future__ import annotations

import argparse
from pathlib import Path


def trainer_parser(
    method: str,
    doc: str | None,
    *,
    train_seqs: int = 400,
    steps: int = 400,
    steps_help: str | None = None,
    batch: int = 4,
    batch_help: str = "sequences per step",
    save_every: int = 50,
    can_init: bool = False,
) -> argparse.ArgumentParser:
    """Model and output, the self-distillation data (the model's own answers to ShareGPT
    train-split prompts), the optimisation schedule and the seed; with `can_init`, --init
    (the trainer starts from `checkpoints.initial_params`)."""
    p = argparse.ArgumentParser(prog=f"jaxspec-train {method}", description=doc)
    p.add_argument("--model", type=Path, help="jaxspec checkpoint (default: the default model)")
    p.add_argument("--out", type=Path, help=f"drafter folder (default: drafters/<model>/{method})")
    p.add_argument(
        "--work-dir", type=Path, help="data, features and checkpoints (default: in $JAXSPEC_HOME)"
    )
    if can_init:
        p.add_argument(
            "--init",
            type=Path,
            help="start from this drafter's weights (a folder of the same method and model), "
            "e.g. to train a shipped drafter further on more data",
        )
    p.add_argument("--train-seqs", type=int, default=train_seqs)
    p.add_argument("--test-seqs", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=128, help="longest prompt")
    p.add_argument("--new-tokens", type=int, default=192, help="answer length")
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--batch", type=int, default=batch, help=batch_help)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=save_every)
    p.add_argument("--seed", type=int, default=0)
    return p
