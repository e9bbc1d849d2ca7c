"""Test-split accuracy of the shipped Medusa, FIRP and PPD drafters, re-measured.

Their cards quote their trainers' final evaluation on the ShareGPT test split as it was
before it dropped the conversations whose first turn a train conversation repeats
(jaxspec.data.sources.split_tag). This runs the same trainers' evaluation functions on
the same number of test conversations of today's split:

    python -m repro.card_accuracy              # -> repro/results/card_accuracy.json
    python -m repro.card_accuracy --methods medusa

The base model's answers and features are cached beside the trainers' (JAXSPEC_HOME).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.drafters.store import load_drafter
from jaxspec.methods import shipped_drafter
from jaxspec.models import load_model
from train import firp, medusa, ppd
from train.features import answer_features, self_answers
from train.model_stamp import claimed_folder

OUT = Path(__file__).resolve().parent / "results" / "card_accuracy.json"
PROMPT_LEN, NEW_TOKENS = 128, 192  # as the shipped drafters were trained and evaluated
TEST_SEQS = {"medusa": 60, "firp": 40, "ppd": 40}  # as their cards


def rounded(rows) -> list:
    return [[round(float(x), 4) for x in row] for row in np.asarray(rows)]


def medusa_accuracy(model, root: Path) -> dict:
    """top-1..5 per head [K,5], targets the base model's greedy tokens."""
    settings, params, _ = load_drafter(shipped_drafter(model.cfg, "medusa"), "medusa", model.cfg)
    drafter = MedusaDrafter(model.cfg, settings.n_heads)
    test = answer_features(model, root, "test", TEST_SEQS["medusa"], PROMPT_LEN, NEW_TOKENS)
    return {"top1_5_per_head": rounded(medusa.evaluate(drafter, model.params, params, test, "kl"))}


def firp_accuracy(model, root: Path) -> dict:
    """top-1..5 per FIRP step [K,5] on the trainer's fixed test anchors."""
    settings, params, _ = load_drafter(shipped_drafter(model.cfg, "firp"), "firp", model.cfg)
    layers = settings.layers
    cache = firp.real_pass(model, root, root / "firp", "test", TEST_SEQS["firp"], PROMPT_LEN,
                           NEW_TOKENS, layers)  # fmt: skip
    accuracy = firp.evaluate(model, params["maps"], layers, cache)
    return {"layers": list(layers), "top1_5_per_step": rounded(accuracy)}


def ppd_accuracy(model, root: Path) -> dict:
    """p_correct at top-1/3/5 per layer, untrained and trained."""
    settings, params, _ = load_drafter(shipped_drafter(model.cfg, "ppd"), "ppd", model.cfg)
    answers = self_answers(model, root, "test", TEST_SEQS["ppd"], PROMPT_LEN, NEW_TOKENS)
    return ppd.evaluate(model, params["heads"], answers, settings.layers)


MEASURE = {"medusa": medusa_accuracy, "firp": firp_accuracy, "ppd": ppd_accuracy}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m repro.card_accuracy", description=__doc__)
    p.add_argument("--methods", default=",".join(MEASURE), help="comma-separated subset")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := set(methods) - set(MEASURE):
        p.error(f"unknown methods {sorted(unknown)}; choose among {', '.join(MEASURE)}")
    model = load_model(None)
    root = claimed_folder(model)
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    for method in methods:
        measured = MEASURE[method](model, root)
        results[method] = {"test_seqs": TEST_SEQS[method], **measured}
        print(method, json.dumps(measured))
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
