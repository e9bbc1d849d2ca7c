"""One training step of every drafter trainer lowers for CUDA and TPU from this CPU host
(jax.export), with nothing on it that only a CPU host runs (`pytest -k export`).

Each trainer is brought where `Trainer.run` has it before its first step (its own
`parse_args`, `prepare`, `make_optimizer` and `start`: the real state and optimizer) on
made-up answers and features of a tiny model; its `step` (firp: `fit`) then runs with the
jitted programs it calls replaced by recorders, so the programs are exported with exactly
the arguments and static options the trainer passes them. Its evaluation program is
recorded the same way."""

from __future__ import annotations

import dataclasses
import functools
import re
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train.chimera
import train.eagle
import train.features
import train.firp
import train.medusa
import train.ppd
import train.sdsat
import train.sdsat_full
from jaxspec import export
from jaxspec.config import preset
from jaxspec.drafters.firp import real_context
from jaxspec.llama import init_params

CFG = dataclasses.replace(preset("tiny-gqa"), n_layers=4)
S = 24  # tokens per made-up sequence: prompt 0..7, answer 8..length-1


@functools.cache
def model() -> SimpleNamespace:
    """What the trainers read of a loaded model."""
    return SimpleNamespace(cfg=CFG, params=init_params(CFG, jax.random.key(0)), mesh=None)


@functools.cache
def made_up_answers(n: int = 4) -> dict:
    """Made-up self-distillation answers (train/selfdata.py's fields)."""
    rng = np.random.default_rng(n)
    tokens = rng.integers(3, CFG.vocab_size, (n, S)).astype(np.int32)
    lengths = np.array([S - i % 3 for i in range(n)], np.int32)
    return {"tokens": tokens, "lengths": lengths, "starts": np.full(n, 8, np.int32)}


@functools.cache
def made_up_features(n: int = 4) -> dict:
    """Made-up answers with their features (train/features.py's fields)."""
    rng = np.random.default_rng(n)
    hidden = rng.standard_normal((n, S, CFG.dim)).astype(np.float16)
    predicted = rng.integers(3, CFG.vocab_size, (n, S)).astype(np.int32)
    return {**made_up_answers(n), "hidden": hidden, "predicted": predicted}


def made_up_layer_features(model, root, split, n, prompt_len, new_tokens, layers, **kw):
    """train.eagle.layer_features' stand-in: made-up features with random states of the
    layers asked for and the last one."""
    stored = sorted(set(layers) | {CFG.n_layers})
    rng = np.random.default_rng(len(split))
    states = rng.standard_normal((4, S, len(stored), CFG.dim)).astype(np.float16)
    return {**made_up_features(), "states": states, "layers": np.asarray(stored)}


class Stop(Exception):
    """Raised by a recorded program whose result the test does not need."""


def record(monkeypatch, programs: dict, module, name: str, stop: bool = True) -> None:
    """Replace `module.name` (a jitted program) by one that records its first call's
    arguments in `programs` and raises Stop (or, `stop` False, returns zeros shaped as its
    outputs, for a program whose results feed the next one: nothing runs)."""
    program = getattr(module, name)

    def called(*args, **static):
        programs.setdefault(name, (program, args, static))
        if stop:
            raise Stop
        out = program.trace(*args, **static).out_info
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out)

    monkeypatch.setattr(module, name, called)


def started(module, kind, argv: list[str], tmp, **data):
    """A `kind` trainer as `Trainer.run` has it before its first step, its data hooks
    replaced by `data` -> (trainer, checkpoint manager, state)."""
    flags = ["--work-dir", str(tmp), "--batch", "2", "--steps", "8", *argv]
    trainer = kind(module.parse_args(flags), model())
    vars(trainer).update(data)
    trainer.work, trainer.out = tmp / "work", tmp / "out"
    trainer.prepare()
    trainer.optimizer = trainer.make_optimizer()
    manager, state = trainer.start()
    return trainer, manager, state


def step(trainer, state) -> None:
    """The trainer's first step, which ends in a recorded program."""
    with pytest.raises(Stop):
        trainer.step(state, 0)


def medusa(tmp, monkeypatch, targets="self") -> dict:
    programs = {}
    record(monkeypatch, programs, train.medusa, "train_step")
    record(monkeypatch, programs, train.medusa, "head_guesses")
    trainer, manager, state = started(
        train.medusa, train.medusa.Medusa, ["--heads", "2", "--targets", targets], tmp,
        features=lambda split, n: made_up_features(),
    )  # fmt: skip
    step(trainer, state)
    h_future = programs["train_step"][1][4]  # the teacher's states (kl): [N,K,D]
    assert (h_future is None) == (targets != "kl")
    with pytest.raises(Stop):
        train.medusa.evaluate(trainer.drafter, model().params, state["params"], trainer.test_f,
                              targets)  # fmt: skip
    manager.close()
    return programs


def firp(tmp, monkeypatch, stage: int = 1, argv=()) -> dict:
    """FIRP step `stage` (1: no frozen map; 2: the first map frozen, as `fit` moves on)."""
    programs = {}
    monkeypatch.setattr(train.firp, "self_answers", lambda *args: made_up_answers())
    record(monkeypatch, programs, train.firp, "train_step")
    record(monkeypatch, programs, train.firp, "topk_hits")
    trainer, manager, state = started(
        train.firp, train.firp.Firp, ["--layers", "2,4", "--anchors", "4", *argv], tmp
    )
    if stage == 2:  # the first FIRP step's updates done: `fit` freezes its map
        state = {**state, "stage_step": jnp.int32(trainer.args.steps)}
    with pytest.raises(Stop):
        trainer.fit(manager, state)
    assert len(programs["train_step"][1][1]) == stage - 1  # the frozen maps
    maps = [*state["maps"][:-1], state["current"]]
    with pytest.raises(Stop):
        train.firp.evaluate(model(), maps, trainer.layers, trainer.test_pass)
    manager.close()
    return programs


def chimera(tmp, monkeypatch, argv=()) -> dict:
    programs = {}
    record(monkeypatch, programs, train.chimera, "train_step")
    record(monkeypatch, programs, train.chimera, "topk_hits")
    trainer, manager, state = started(
        train.chimera, train.chimera.Chimera, ["--heads", "2", "--rows", "4", *argv], tmp,
        answers=lambda features=False: (made_up_features(), made_up_features()),
    )  # fmt: skip
    step(trainer, state)
    with pytest.raises(Stop):
        train.chimera.evaluate(trainer.drafter, model().params, state["params"], trainer.test_f)
    manager.close()
    return programs


def eagle(tmp, monkeypatch, states="cached", products="exact", argv=()) -> dict:
    """states "live": the training answers' states made at every step (live_states), in
    `products` (--live-products); argv: more flags."""
    programs = {}
    record(monkeypatch, programs, train.eagle, "live_states", stop=False)
    record(monkeypatch, programs, train.eagle, "train_step")
    record(monkeypatch, programs, train.eagle, "topk_hits")

    monkeypatch.setattr(train.eagle, "layer_features", made_up_layer_features)
    monkeypatch.setattr(train.eagle, "self_answers", lambda *args: made_up_answers())
    argv = ["--ttt", "2", "--rows", "4", "--guess-vocab", "32", "--states", states,
            *(["--live-products", products] if states == "live" else []), *argv]  # fmt: skip
    trainer, manager, state = started(train.eagle, train.eagle.Eagle, argv, tmp)
    step(trainer, state)
    assert ("live_states" in programs) == (states == "live")
    with pytest.raises(Stop):
        scored = {**state["params"], "vocab": trainer.vocab}
        train.eagle.evaluate(trainer.drafter, model().params, scored, trainer.test_f, 2)
    manager.close()
    return programs


def sdsat(tmp, monkeypatch) -> dict:
    programs = {}
    record(monkeypatch, programs, train.sdsat, "train_step")
    record(monkeypatch, programs, train.sdsat, "span_hits")
    trainer, manager, state = started(
        train.sdsat, train.sdsat.Sdsat, ["--rank", "2", "--spans", "2", "--window", "3"], tmp,
        answers=lambda features=False: (made_up_answers(), made_up_answers()),
    )  # fmt: skip
    step(trainer, state)
    with pytest.raises(Stop):
        trainer.evaluate_test(trainer.drafter, model().params, state["params"])
    manager.close()
    return programs


def sdsat_full(tmp, monkeypatch, loss="improved") -> dict:
    programs = {}
    record(monkeypatch, programs, train.sdsat_full, "full_step")
    argv = ["--mode", "full", "--ids", "2", "--window", "3", "--mask-rate", "0.3", "--loss", loss]
    trainer, manager, state = started(
        train.sdsat, train.sdsat_full.FullSdsat, argv, tmp,
        answers=lambda features=False: (made_up_answers(), made_up_answers()),
    )  # fmt: skip
    step(trainer, state)
    manager.close()
    return programs


def ppd(tmp, monkeypatch) -> dict:
    programs = {}
    record(monkeypatch, programs, train.ppd, "layer_states", stop=False)
    record(monkeypatch, programs, train.ppd, "train_step")
    record(monkeypatch, programs, train.ppd, "match_hits")
    trainer, manager, state = started(
        train.ppd, train.ppd.Ppd, ["--layers", "2,3", "--rows", "4"], tmp,
        answers=lambda features=False: (made_up_answers(), made_up_answers()),
    )  # fmt: skip
    step(trainer, state)
    with pytest.raises(Stop):
        train.ppd.evaluate(model(), state["params"], trainer.test_data, trainer.layers)
    manager.close()
    return programs


# case -> (its recorded programs, those to export: a variant's train step only, its
# evaluation being the plain case's)
TRAINERS = {
    "medusa": (medusa, {"train_step", "head_guesses"}),
    "medusa-kl": (partial(medusa, targets="kl"), {"train_step"}),
    "firp": (firp, {"train_step", "topk_hits"}),
    "firp-stage2": (partial(firp, stage=2), {"train_step"}),
    "firp-paper": (partial(firp, stage=2, argv=["--training", "paper"]), {"train_step"}),
    "chimera": (chimera, {"train_step", "topk_hits"}),
    "chimera-distill": (
        partial(chimera, argv=["--targets", "self", "--distill", "0.5"]),
        {"train_step"},
    ),
    "sdsat": (sdsat, {"train_step", "span_hits"}),
    "eagle": (eagle, {"train_step", "topk_hits"}),
    "eagle-live": (partial(eagle, states="live"), {"live_states", "train_step"}),
    "eagle-live-plain": (partial(eagle, states="live", products="plain"), {"live_states"}),
    "eagle-noise": (partial(eagle, argv=["--feature-noise", "0.1"]), {"train_step"}),
    "eagle-loss-top": (partial(eagle, argv=["--loss-top", "3"]), {"train_step"}),
    "eagle-2-blocks": (partial(eagle, argv=["--blocks", "2"]), {"train_step", "topk_hits"}),
    "sdsat-full": (sdsat_full, {"full_step"}),
    "sdsat-full-basic": (partial(sdsat_full, loss="basic"), {"full_step"}),
    "ppd": (ppd, {"layer_states", "train_step", "match_hits"}),
}


def exported_everywhere(programs: dict) -> dict:
    """export_all(programs), each one checked to exist for every accelerator."""
    exported = export.export_all(programs)
    for name, by_platform in exported.items():
        assert set(by_platform) == set(export.ACCELERATORS), name
        for platform, program in by_platform.items():
            assert program.platforms == (platform,), (name, platform)
    return exported


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_export_training_step(trainer, tmp_path, monkeypatch):
    make, names = TRAINERS[trainer]
    programs = make(tmp_path, monkeypatch)
    assert names <= set(programs), f"{trainer} did not call {names - set(programs)}"
    exported_everywhere({name: programs[name] for name in names})


def test_export_plain_live_states_multiply_in_bfloat16(tmp_path, monkeypatch):
    """--live-products plain: the exported pass's products are bfloat16 ones, where the
    exact pass of this float32 model has none."""
    bf16_dot = re.compile(r"stablehlo\.dot_general[^\n]*tensor<[0-9x]*bf16>")
    for products, expected in (("plain", True), ("exact", False)):
        with monkeypatch.context() as patch:
            programs = eagle(tmp_path / products, patch, states="live", products=products)
        exported = exported_everywhere({"live_states": programs["live_states"]})
        for program in exported["live_states"].values():
            assert bool(bf16_dot.search(program.mlir_module())) == expected, products


def test_export_training_feature_programs():
    """The frozen base model's passes the trainers cache: features (last states and greedy
    predictions, train/features.py) and FIRP's real pass (train/firp.py RealPassCache)."""
    tokens = jax.ShapeDtypeStruct((4, S), jnp.int32)
    real_pass = jax.jit(partial(real_context, cfg=CFG, layers=(2, 4)))
    exported_everywhere({
        "features": (train.features._features, (model().params, tokens), {"cfg": CFG}),
        "layer_states": (train.features.layer_states, (model().params, tokens),
                         {"cfg": CFG, "layers": (1, 2, 4)}),
        "firp_real_pass": (real_pass, (model().params,), {"tokens": tokens}),
    })  # fmt: skip
