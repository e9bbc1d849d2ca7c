"""What each trainer learns from what: the exact (input position, target, weight) a loss
sees on literal sequences. A trainer whose targets are shifted by one, whose mask takes a
prompt token or drops the first answer token, or whose depth weights are reversed still
ships a lossless drafter (verification catches every bad guess), so only these pin it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.drafters.chimera import training_logits
from jaxspec.drafters.eagle import EagleDrafter, shifted, training_outputs
from jaxspec.llama import lm_logits
from tests.test_export_training import (
    CFG,
    Stop,
    made_up_features,
    made_up_layer_features,
    model,
    started,
)

STARTS, LENGTHS = np.array([5, 3]), np.array([12, 10])  # prompts 0..4 and 0..2


def literal_features(T: int = 14) -> dict:
    """Two sequences whose every field names its position: tokens[n,t] = 100n + t, the
    model's greedy guess for t+1 predicted[n,t] = 1000 + 100n + t, hidden[n,t] all t."""
    at = 100 * np.arange(2)[:, None] + np.arange(T)[None]
    hidden = np.broadcast_to(at[..., None], (2, T, 4)).astype(np.float16)
    return {"tokens": at.astype(np.int32), "predicted": (1000 + at).astype(np.int32),
            "hidden": hidden, "starts": STARTS, "lengths": LENGTHS}  # fmt: skip


def test_medusa_head_k_learns_the_token_k_plus_one_ahead_on_answer_positions():
    """Head k (1-based) at position t: the data token t+k+1 or the model's greedy guess for
    it (predicted at t+k), for t from the last prompt position (whose next token is the
    answer's first) while t+K+1 is in the answer; with KL targets the model's
    distribution at t+k."""
    from train.medusa import gather, samples

    f, K = literal_features(), 2
    pairs, data = samples(f, K, "data")
    _, greedy = samples(f, K, "self")
    expected = [(0, t) for t in range(4, 9)] + [(1, t) for t in range(2, 7)]
    np.testing.assert_array_equal(pairs, expected)
    np.testing.assert_array_equal(data, [[100 * n + t + 2, 100 * n + t + 3] for n, t in expected])
    np.testing.assert_array_equal(greedy, [[1000 + 100 * n + t + 1, 1000 + 100 * n + t + 2]
                                           for n, t in expected])  # fmt: skip
    h, future = gather(f, pairs, K, True)
    np.testing.assert_array_equal(h[:, 0], [100 * n + t for n, t in expected])
    np.testing.assert_array_equal(future[:, :, 0], [[100 * n + t + 1, 100 * n + t + 2]
                                                    for n, t in expected])  # fmt: skip


def test_chimera_and_eagle_rows_score_the_next_answer_token():
    """Row i scores token i+1: rows from the last prompt position (at least K) to the
    answer's last but one; labels the data token i+1 or the model's guess at i."""
    from train.chimera import batch_arrays, row_range
    from train.eagle import window_width

    f = literal_features()
    assert row_range(f, 0, 2) == (4, 11) and row_range(f, 1, 2) == (2, 9)
    assert row_range(f, 1, 4) == (4, 9)  # step/head K needs K positions before it
    # EAGLE's window: the longest answer's rows (4..10) and the 3-1 positions before them
    assert window_width(f, 3) == 7 + 2
    rows = np.array([[4, 10], [2, 8]])
    for targets, expected in (("data", [[5, 11], [103, 109]]),
                              ("self", [[1004, 1010], [1102, 1108]])):  # fmt: skip
        tokens, hidden, got_rows, labels = batch_arrays(f, np.array([0, 1]), rows, targets)
        np.testing.assert_array_equal(labels, expected)
        np.testing.assert_array_equal(got_rows, rows)
        np.testing.assert_array_equal(hidden[:, :, 0], f["tokens"])


def test_eagle_teacher_is_the_models_distribution_at_the_row():
    """The target of row i is the model's next-token distribution from its last state at
    i (restricted to the draft vocabulary), the fused states those of the drafter's
    layers in order, the last one the model's last layer's."""
    from train.eagle import fused_and_last, teacher

    stored, layers = (1, 2, 3, 4), (1, 2, 3)
    states = np.broadcast_to(np.arange(1, 5)[None, None, :, None], (1, 6, 4, CFG.dim))
    states = states * (1 + np.arange(6))[None, :, None, None]  # layer n at t: n (t+1)
    fused3, last = fused_and_last(states, stored, layers)
    np.testing.assert_array_equal(fused3[0, :, :, 0], np.outer(1 + np.arange(6), [1, 2, 3]))
    np.testing.assert_array_equal(last[0, :, 0], 4 * (1 + np.arange(6)))
    last = jax.random.normal(jax.random.key(0), (1, 6, CFG.dim))
    rows = jnp.asarray([[2, 4]])
    vocab = {"ids": jnp.asarray([3, 7, 11])}
    got = teacher(model().params, CFG, last, rows, vocab)
    expected = jax.nn.softmax(lm_logits(model().params, CFG, last[:, [2, 4]])[..., [3, 7, 11]])
    np.testing.assert_allclose(got[:, :, 0], expected, rtol=1e-6)


def random_eagle(seed: int = 0):
    drafter = EagleDrafter(CFG, (1, 2, 3), 3)
    leaves, tree = jax.tree.flatten(drafter.init(model().params))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return drafter, jax.tree.unflatten(tree, noisy)


def test_eagle_step_logits_are_the_whole_sequence_test_at_the_rows():
    """The training step's window: each step's guess at each scored row (the rows' first
    included) is the whole-sequence training-time test's there, whose every step has its
    path of earlier outputs."""
    from train.eagle import step_logits

    drafter, dp = random_eagle()
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, (2, 14)))
    fused3 = jax.random.normal(jax.random.key(1), (2, 14, 3, CFG.dim))
    rows, steps = jnp.asarray([[6, 9, 7], [4, 5, 4]]), 3
    got = step_logits(drafter, model().params, dp, tokens, fused3, rows, steps, width=6)
    features = shifted(drafter.fuse(dp, {n: fused3[:, :, i] for i, n in enumerate((1, 2, 3))}))
    whole = training_outputs(drafter, model().params, dp, tokens, features, steps)
    for k, y in enumerate(whole):
        at = jnp.take_along_axis(y, rows[..., None], axis=1)
        np.testing.assert_allclose(got[:, :, k], drafter.logits(model().params, dp, at),
                                   rtol=2e-4, atol=2e-4)  # fmt: skip


def test_training_time_test_trains_the_drafter_through_its_own_earlier_outputs():
    """Step k's loss reaches the weights through the features step k-1's outputs feed it
    (no stop-gradient between depths): the gradient is the loss's finite difference."""
    drafter, dp = random_eagle(seed=2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, CFG.vocab_size, (1, 8)))
    fused3 = jax.random.normal(jax.random.key(3), (1, 8, 3, CFG.dim))
    target = jax.random.normal(jax.random.key(4), (1, 8, CFG.dim))

    def loss(fuse_w):  # the last step's output alone: earlier steps reach it as features
        p = {**dp, "fuse": {**dp["fuse"], "w": fuse_w}}
        f = shifted(drafter.fuse(p, {n: fused3[:, :, i] for i, n in enumerate((1, 2, 3))}))
        out = training_outputs(drafter, model().params, p, tokens, f, 3)[-1]
        return jnp.sum(out[:, 4:] * target[:, 4:])

    w = dp["fuse"]["w"]
    direction = jax.random.normal(jax.random.key(5), w.shape)
    grad = float(jnp.sum(jax.grad(loss)(w) * direction))
    eps = 1e-2
    finite = (float(loss(w + eps * direction)) - float(loss(w - eps * direction))) / (2 * eps)
    assert abs(grad - finite) < 0.02 * abs(finite) + 1e-3, (grad, finite)


def recorded_steps(monkeypatch, module, name: str, trainer, steps) -> list[tuple]:
    """The arguments `trainer.step(state, s)` passes its jitted `module.name` for each s."""
    calls = []

    def called(*args, **static):
        calls.append(args)
        raise Stop

    monkeypatch.setattr(module, name, called)
    for s in steps:
        with pytest.raises(Stop):
            trainer.step(trainer.state, s)
    return calls


def started_trainer(tmp_path, monkeypatch, method: str):
    """A `method` trainer on the made-up answers of tests/test_export_training.py, as
    Trainer.run has it before its first step (its state as `.state`)."""
    import train.chimera
    import train.eagle
    import train.medusa
    import train.sdsat

    monkeypatch.setattr(train.eagle, "layer_features", made_up_layer_features)
    both = lambda features=False: (made_up_features(), made_up_features())  # noqa: E731
    module, kind, argv, data = {
        "eagle": (train.eagle, train.eagle.Eagle,
                  ["--ttt", "3", "--rows", "4", "--guess-vocab", "32", "--decay", "0.5"], {}),
        "medusa": (train.medusa, train.medusa.Medusa, ["--heads", "3", "--decay", "0.5"],
                   {"features": lambda split, n: made_up_features()}),
        "chimera": (train.chimera, train.chimera.Chimera,
                    ["--heads", "3", "--rows", "4", "--decay", "0.5"], {"answers": both}),
        "sdsat": (train.sdsat, train.sdsat.Sdsat, ["--rank", "2", "--spans", "2"],
                  {"answers": both}),
    }[method]  # fmt: skip
    trainer, manager, state = started(module, kind, argv, tmp_path, **data)
    manager.close()
    trainer.state = state
    return module, trainer


@pytest.mark.parametrize(
    "method, weights, at",
    [
        ("eagle", [1, 0.5, 0.25], 6),
        ("medusa", [0.5, 0.25, 0.125], 5),
        ("chimera", [0.5, 0.25, 0.125], 6),
    ],
)
def test_the_nearest_guess_weighs_most(method, weights, at, tmp_path, monkeypatch):
    """--decay 0.5: EAGLE's step k weighs decay**(k-1), Medusa's and Chimera's head k
    decay**k, in the weights the training step receives."""
    module, trainer = started_trainer(tmp_path, monkeypatch, method)
    (args,) = recorded_steps(monkeypatch, module, "train_step", trainer, [0])
    np.testing.assert_allclose(args[at], weights)


@pytest.mark.parametrize("method", ["eagle", "medusa", "chimera", "sdsat"])
def test_each_step_draws_its_own_batch_and_a_rerun_the_same(method, tmp_path, monkeypatch):
    """Steps draw different sequences and rows (a resumed run must redraw step s's batch:
    drawn from the seed and the step, not the seed alone)."""
    module, trainer = started_trainer(tmp_path, monkeypatch, method)
    calls = recorded_steps(monkeypatch, module, "train_step", trainer, [0, 1, 2, 0])
    batches = [[np.asarray(a) for a in args[2:6] if hasattr(a, "shape")] for args in calls]
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # noqa: E731
    assert same(batches[0], batches[3])
    assert not same(batches[0], batches[1]) and not same(batches[1], batches[2])


def test_firp_step_i_learns_the_models_distribution_i_positions_on(tmp_path, monkeypatch):
    """FIRP step i's pseudo state at anchor q is scored against the model's distribution at
    q+i (its last state there), for the map being trained at either stage; anchors run from
    the last prompt position while q+K is in the answer."""
    from tests.test_export_training import firp
    from train.firp import pseudo_logits, valid_anchor_range

    low, high = valid_anchor_range({"starts": STARTS, "lengths": LENGTHS}, 2)
    np.testing.assert_array_equal(low, [4, 2])
    np.testing.assert_array_equal(high, [9, 7])
    for stage in (1, 2):
        with monkeypatch.context() as patch:
            program, args, static = firp(tmp_path / str(stage), patch, stage=stage)["train_step"]
        state, frozen, base, batch, anchors = args
        maps = [*frozen, state["current"]]
        logits = pseudo_logits(base, CFG, maps, static["layers"], batch, anchors,
                               static["variant"], static["paper"])[:, :, -1]  # fmt: skip
        h = jnp.take_along_axis(batch["last"], (anchors + stage)[..., None], axis=1)
        teacher = jax.nn.softmax(lm_logits(base, CFG, h), -1)
        expected = optax.softmax_cross_entropy(logits, teacher).mean()
        _, loss = program(*args, **static)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_sdsat_adaptive_token_j_learns_the_token_after_its_position(tmp_path, monkeypatch):
    """Span at i: adaptive row j (0-based) sits at i+1+j and learns token i+j+2, scored
    while inside the sequence, weighted (L-j)/L (the paper's random window); spans start
    at the last prompt position at the earliest and leave room for their first target."""
    from tests.test_export_training import sdsat
    from train.sdsat import span_logits, span_starts, span_targets

    spans = span_starts(STARTS, LENGTHS, 500, np.random.default_rng(0))
    assert spans[0].min() == 4 and spans[0].max() == 9
    assert spans[1].min() == 2 and spans[1].max() == 7
    tokens = jnp.asarray(100 + np.arange(8)[None])
    labels, valid = span_targets(tokens, jnp.asarray([7]), jnp.asarray([[2, 3, 5, 6]]))
    np.testing.assert_array_equal(labels, [[103, 104, 106, 107]])
    np.testing.assert_array_equal(valid, [[True, True, True, False]])
    program, args, static = sdsat(tmp_path, monkeypatch)["train_step"]
    state, params, tokens, lengths, spans = args
    L = static["L"]
    logits, j, positions = span_logits(static["drafter"], params, state["params"], tokens,
                                       spans, L)  # fmt: skip
    labels, valid = span_targets(tokens, lengths, positions)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    weight = valid * (L - j)[None] / L
    expected = float((ce * weight).sum() / weight.sum())
    _, (loss, _) = program(*args, **static)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_feature_noise_perturbs_the_drafters_inputs_not_its_targets(tmp_path, monkeypatch):
    """--feature-noise: the training step's losses are those of the drafter on the noisy
    fused states against the model's distribution from its clean last states."""
    import train.eagle as eagle

    program = eagle.train_step
    module, trainer = started_trainer(tmp_path, monkeypatch, "eagle")
    (args,) = recorded_steps(monkeypatch, module, "train_step", trainer, [0])
    state, base, tokens, fused3, last, rows, weights, vocab, seed = args
    static = {"drafter": trainer.drafter, "optimizer": trainer.optimizer, "steps": 3,
              "width": trainer.width, "noise": 0.1, "top": 0}  # fmt: skip
    target = eagle.teacher(base, CFG, last, rows, vocab)
    noisy = eagle.noisy(fused3, 0.1, seed)
    scored = {**state["params"], "vocab": vocab}
    logits = eagle.step_logits(trainer.drafter, base, scored, tokens, noisy, rows, 3,
                               trainer.width)  # fmt: skip
    expected = optax.softmax_cross_entropy(logits, target).mean((0, 1))
    _, losses = program(*args, **static)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_chimera_kl_targets_are_the_models_distribution_at_the_row():
    """--targets kl: every head at row i against the model's next-token distribution from
    its state at i (the token i+1 the greedy labels name)."""
    from tests.test_chimera import random_chimera
    from train.chimera import losses_fn

    drafter, dp = random_chimera(CFG, model().params, n_heads=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, (2, 12)))
    hidden = jax.random.normal(jax.random.key(0), (2, 12, CFG.dim))
    rows = jnp.asarray([[4, 7, 10], [3, 5, 9]])
    labels = jnp.zeros((2, 3), jnp.int32)
    losses, _ = losses_fn(drafter, model().params, dp, tokens, hidden, rows, labels, "kl", 0.0)
    logits = training_logits(drafter, model().params, dp, tokens, hidden, rows)
    at = jnp.take_along_axis(hidden, rows[..., None], 1)
    teacher = jax.nn.softmax(lm_logits(model().params, CFG, at), -1)[:, :, None]
    np.testing.assert_allclose(losses, optax.softmax_cross_entropy(logits, teacher).mean((0, 1)),
                               rtol=1e-5)  # fmt: skip


def test_each_firp_map_starts_with_a_fresh_optimizer(tmp_path, monkeypatch):
    """When FIRP step 1's map is final, step 2's map trains with a new optimizer state: no
    Adam moments of another map, its learning-rate schedule from its start (a carried
    count would have it at the cosine's end, lr 0)."""
    import train.firp
    from tests.test_export_training import made_up_answers, record

    programs = {}
    monkeypatch.setattr(train.firp, "self_answers", lambda *args: made_up_answers())
    record(monkeypatch, programs, train.firp, "train_step")
    trainer, manager, state = started(train.firp, train.firp.Firp,
                                      ["--layers", "2,4", "--anchors", "4"], tmp_path)  # fmt: skip
    worn = jax.tree.map(lambda x: x + 1, state["opt_state"])  # as step 1's map leaves it
    state = {**state, "opt_state": worn, "stage_step": jnp.int32(trainer.args.steps)}
    with pytest.raises(Stop):
        trainer.fit(manager, state)
    manager.close()
    got = programs["train_step"][1][0]["opt_state"]
    fresh = trainer.optimizer.init(state["maps"][1])
    jax.tree.map(np.testing.assert_array_equal, got, fresh)


@pytest.mark.parametrize(
    "flag",
    [
        ["--lr", "0.5"],
        ["--decay", "0.5"],
        ["--seed", "3"],
        ["--batch", "7"],
        ["--train-seqs", "9"],
        ["--heads", "2"],
    ],
)
def test_a_rerun_with_other_training_flags_starts_a_new_run(flag):
    """Checkpoints are keyed by every flag that changes the weights: a rerun with another
    learning rate (or decay, seed, batch, data, heads) must not resume the old run's."""
    from train.checkpoints import run_name
    from train.medusa import parse_args

    assert run_name(parse_args(flag)) != run_name(parse_args([]))
