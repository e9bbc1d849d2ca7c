"""Interrupted training resumes where it stopped: a run killed after a checkpoint and run
again ends with the weights of a run that was never interrupted (the same parameters,
optimizer moments and batches), not merely with the same step count."""

from __future__ import annotations

import importlib
import re
import shutil

import jax
import numpy as np
import pytest

from jaxspec.checkpoint import load_checkpoint
from jaxspec.drafters.store import load_drafter

STEPS, KILLED_AFTER = 8, 4  # checkpoints every 2 steps
TRAINERS = {  # method: its flags for a seconds-long run
    "medusa": ["--heads", "2", "--batch", "16"],
    "chimera": ["--rows", "8", "--heads", "2"],
    "eagle": ["--rows", "6", "--ttt", "2", "--depth", "2", "--guess-vocab", "40"],
    "firp": ["--layers", "1,2", "--anchors", "4"],  # killed in its first map's training
    "sdsat": ["--spans", "4", "--window", "3", "--rank", "2", "--ids", "2", "--cpu-tree",
              "chain-3"],
    "ppd": ["--layers", "1", "--rows", "8"],
}  # fmt: skip


@pytest.mark.parametrize("method", list(TRAINERS))
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(
    method, tiny_ckpt, tmp_path, monkeypatch, capsys
):
    from tests.conftest import tiny_training_args, train_on_made_up_conversations

    trainer = importlib.import_module(f"train.{method}")
    skeleton = importlib.import_module("train.skeleton")
    monkeypatch.setattr(skeleton, "measure_acceptance", lambda *args: {})  # decoding: elsewhere

    def run(name: str) -> None:
        args = tiny_training_args(tiny_ckpt[0], tmp_path / name, train_seqs=6)
        train_on_made_up_conversations(trainer, [*args, *TRAINERS[method], "--steps", str(STEPS)])

    run("whole")
    fresh_run = shutil.ignore_patterns("checkpoints", "out")  # the answers and states kept
    shutil.copytree(tmp_path / "whole", tmp_path / "killed", ignore=fresh_run)

    save = skeleton.save
    caller = trainer if vars(trainer).get("save") is save else skeleton  # FIRP saves itself

    def save_then_die(manager, step, state, last):
        save(manager, step, state, last)
        if step == KILLED_AFTER:
            manager.wait_until_finished()
            raise KeyboardInterrupt

    monkeypatch.setattr(caller, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run("killed")
    monkeypatch.setattr(caller, "save", save)
    capsys.readouterr()
    run("killed")
    resumed_at = rf"resumed (from step|at FIRP step 1, update) {KILLED_AFTER}\n"
    assert re.search(resumed_at, capsys.readouterr().out)
    cfg, _ = load_checkpoint(tiny_ckpt[0])
    whole, resumed = (load_drafter(tmp_path / n / "out", method, cfg).params
                      for n in ("whole", "killed"))  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, resumed, whole)
