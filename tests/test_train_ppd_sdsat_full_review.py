"""What the PPD trainer and SDSAT's full-model trainer learn from what (mutation review):
rows, targets, masks and loss weights on literal data, the batches a step draws, which
parameters train, and the report, settings and card fields each writes."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train.ppd as ppd
import train.sdsat
import train.sdsat_full as full
from jaxspec.drafters.sdsat import SdsatSettings
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import forward
from jaxspec.ppd import PpdSettings, early_logits
from tests.test_export_training import CFG, Stop, made_up_answers, model, started

V = CFG.vocab_size  # 97; 4 layers


@partial(jax.jit, static_argnums=2)
def reference(params, tokens, collect=()):
    """The model on tokens [B,S] -> (logits [B,S,V], {n: the state after n layers})."""
    B, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    logits, _, states = forward(params, CFG, tokens, positions, None, causal_mask(B, S),
                                collect=collect)  # fmt: skip
    return logits, states


@jax.jit
def exits(params, heads, states):
    """{n: (untrained, trained) early logits} of the states after layer n."""
    return {
        n: (early_logits(params, CFG, None, h), early_logits(params, CFG, heads[f"layer{n}"], h))
        for n, h in states.items()
    }


def random_heads(layers, seed=1) -> dict:
    rng, D = np.random.default_rng(seed), CFG.dim
    noise = lambda *shape: jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return {f"layer{n}": {"w": noise(D, D), "b": noise(D)} for n in layers}


# -- PPD: layers


def test_ppd_drafts_from_half_the_depth_up_to_below_the_top():
    """d_bar runs from ceil(n/2) to n-1; --layers beyond the model, or with no such layer,
    are one-line errors naming the range to add from."""
    assert ppd.drafting_layers(range(1, 7), 6) == [3, 4, 5]
    assert ppd.drafting_layers(range(1, 8), 7) == [4, 5, 6]
    assert ppd.head_layers("3,6", 6) == (3, 6)  # the top layer may have a head
    with pytest.raises(JaxspecError, match=r"^--layers 1,7: this model has layers 1\.\.6$"):
        ppd.head_layers("1,7", 6)
    with pytest.raises(JaxspecError, match=r"add one of 4\.\.6$"):
        ppd.head_layers("1,3,7", 7)
    with pytest.raises(JaxspecError, match=r"below the top; add one of 3\.\.5$"):
        ppd.head_layers("2,6", 6)


def test_ppd_rows_run_from_the_last_prompt_position_to_the_answers_last_but_one():
    """Row t scores token t+1: rows from start-1 (the answer's first token next) while t+1 is
    in the answer; rows past the sequence are clamped to it and invalid; sampled rows are
    all valid and reach both ends."""
    data = {"tokens": np.zeros((2, 14), np.int32), "starts": np.array([5, 3]),
            "lengths": np.array([12, 10])}  # fmt: skip
    rows, valid = ppd.answer_rows(data, np.array([0, 1]), 12)
    np.testing.assert_array_equal(rows, [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 13, 13],
                                         list(range(2, 14))])  # fmt: skip
    np.testing.assert_array_equal(valid.sum(1), [7, 7])  # 4..10 and 2..8
    assert valid[0, 6] and not valid[0, 7] and valid[1, 6] and not valid[1, 7]
    rows, valid = ppd.answer_rows(data, np.array([0, 1] * 50), 8, np.random.default_rng(0))
    assert rows.shape == (100, 8) and valid.all()
    assert rows[::2].min() == 4 and rows[::2].max() == 10
    assert rows[1::2].min() == 2 and rows[1::2].max() == 8


# -- PPD: what the heads learn


def test_ppd_heads_learn_the_models_final_distribution_at_valid_rows():
    """layer_states: the state after each head's layer (its untrained exit: the model cut
    there) and the final logits, at the rows. train_step: per layer, the mean over valid
    rows of cross-entropy against softmax(final logits); the heads (only) step down the
    gradient of the layers' sum."""
    params = model().params
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, V, (2, 10)), jnp.int32)
    rows = jnp.asarray([[3, 5, 9], [2, 2, 7]], jnp.int32)
    states, final = ppd.layer_states(params, tokens, rows, cfg=CFG, layers=(1, 3))
    assert sorted(states) == [1, 3]
    pick = lambda x: np.take_along_axis(np.asarray(x), np.asarray(rows)[..., None], 1)  # noqa: E731
    logits, every = reference(params, tokens, (1, 2, 3))
    np.testing.assert_allclose(final, pick(logits), rtol=2e-5, atol=2e-5)
    for n in (1, 3):
        np.testing.assert_allclose(states[n], pick(every[n]), rtol=2e-5, atol=2e-5)
    valid = jnp.asarray([[True, True, False], [True, False, True]])
    heads = random_heads((1, 3))

    def expected(heads):  # (sum, {layer: loss}), by hand
        teacher = jax.nn.softmax(final, -1)
        out = {}
        for n in (1, 3):
            logp = jax.nn.log_softmax(early_logits(params, CFG, heads[f"layer{n}"], states[n]))
            ce = -(teacher * logp).sum(-1)
            out[n] = (ce[0, 0] + ce[0, 1] + ce[1, 0] + ce[1, 2]) / 4
        return out[1] + out[3], out

    optimizer = optax.sgd(1.0)
    copy = jax.tree.map(jnp.array, heads)  # (the step donates its state)
    state = {"params": copy, "opt_state": optimizer.init(copy), "step": jnp.int32(0)}
    new, losses = ppd.train_step(state, params, states, final, valid, cfg=CFG,
                                 optimizer=optimizer)  # fmt: skip
    (_, want), grads = jax.jit(jax.value_and_grad(expected, has_aux=True))(heads)
    np.testing.assert_allclose([losses[1], losses[3]], [want[1], want[3]], rtol=1e-5)
    stepped = jax.tree.map(lambda h, g: h - g, heads, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 new["params"], stepped)  # fmt: skip
    assert int(new["step"]) == 1


def test_ppd_p_correct_is_the_final_greedy_token_among_the_early_top_k():
    """evaluate: per layer, untrained (no head) then trained, the share of every valid
    answer row whose final greedy token is among the early top-1/3/5."""
    params = model().params
    tokens = np.random.default_rng(1).integers(3, V, (2, 14)).astype(np.int32)
    data = {"tokens": tokens, "starts": np.array([2, 3]), "lengths": np.array([14, 12])}
    heads = random_heads((1, 2))
    got = ppd.evaluate(model(), heads, data, (1, 2))
    logits, states = reference(params, jnp.asarray(tokens), (1, 2))
    target = np.asarray(logits.argmax(-1))  # [2,14]
    early = exits(params, heads, states)
    scored = [(0, t) for t in range(1, 13)] + [(1, t) for t in range(2, 11)]  # 21 rows
    for n in (1, 2):
        for i, name in enumerate(("untrained", "trained")):
            order = np.argsort(-np.asarray(early[n][i]), -1)
            rank = {(b, t): list(order[b, t]).index(target[b, t]) for b, t in scored}
            want = {f"top{k}": round(sum(r < k for r in rank.values()) / 21, 4) for k in (1, 3, 5)}
            assert got[f"layer{n}"][name] == want, (n, name)
    rates = [got[f"layer{n}"][name] for n in (1, 2) for name in ("untrained", "trained")]
    assert len({tuple(r.values()) for r in rates}) == 4  # the cases differ: they are told apart
    assert any(r["top1"] < r["top3"] < r["top5"] for r in rates)


# -- PPD: the trainer


def ppd_trainer(tmp_path, layers="1,2,3"):
    trainer, manager, state = started(
        ppd, ppd.Ppd, ["--layers", layers, "--rows", "4"], tmp_path,
        answers=lambda features=False: (made_up_answers(), made_up_answers(5)),
    )  # fmt: skip
    manager.close()
    return trainer, state


def test_ppd_starts_from_zero_heads_one_per_layer(tmp_path):
    """Fresh heads are zeros (the plain early exit), one per --layers entry."""
    trainer, state = ppd_trainer(tmp_path)
    assert sorted(state["params"]) == ["layer1", "layer2", "layer3"]
    for head in state["params"].values():
        assert head["w"].shape == (CFG.dim, CFG.dim) and head["b"].shape == (CFG.dim,)
        assert not np.any(head["w"]) and not np.any(head["b"])
    assert trainer.test_data is made_up_answers(5) and trainer.train_data is made_up_answers()


def test_ppd_steps_draw_their_own_batches_of_answer_rows(tmp_path, monkeypatch):
    """Step s: --batch training sequences (any of them) and --rows rows inside each answer,
    drawn from (seed, s): the same for a rerun of s, another for another s."""
    trainer, state = ppd_trainer(tmp_path)
    data, calls = trainer.train_data, []

    def states(params, tokens, rows, *, cfg, layers):
        calls.append((np.asarray(tokens), np.asarray(rows)))
        assert cfg is CFG and layers == (1, 2, 3)
        return "states", "final"

    def step(state, params, states, final, valid, *, cfg, optimizer):
        assert (states, final) == ("states", "final") and np.asarray(valid).all()
        assert np.asarray(valid).shape == (2, 4)
        raise Stop

    monkeypatch.setattr(ppd, "layer_states", states)
    monkeypatch.setattr(ppd, "train_step", step)
    for s in [*range(12), 0]:
        with pytest.raises(Stop):
            trainer.step(state, s)
    seqs = [[int(np.flatnonzero((data["tokens"] == t).all(1))[0]) for t in tokens]
            for tokens, _ in calls]  # fmt: skip
    assert sorted({n for batch in seqs for n in batch}) == [0, 1, 2, 3]
    assert seqs[0] == seqs[12] and np.array_equal(calls[0][1], calls[12][1])
    assert not np.array_equal(calls[0][1], calls[1][1])
    for batch, (_, rows) in zip(seqs, calls, strict=True):
        assert rows.shape == (2, 4)
        for n, r in zip(batch, rows, strict=True):
            assert r.min() >= data["starts"][n] - 1 and r.max() <= data["lengths"][n] - 2
    every = np.concatenate([rows.ravel() for _, rows in calls])
    assert every.min() == 7 and every.max() == 22  # start-1 and the longest's length-2


def match(u1, u3, u5, t1, t3, t5) -> dict:
    return {"untrained": {"top1": u1, "top3": u3, "top5": u5},
            "trained": {"top1": t1, "top3": t3, "top5": t5}}  # fmt: skip


def test_ppd_finish_picks_the_largest_saving_and_writes_float16_heads(tmp_path, monkeypatch):
    """The default layer: among the drafting layers, the largest (n - d) x trained top-3
    p_correct (Theorem 4.1) measured on the test split; report, settings, float16 heads
    and the card's table (untrained / trained) from it."""
    trainer, state = ppd_trainer(tmp_path)
    rates = {
        "layer1": match(0.9, 0.99, 0.99, 0.9, 0.99, 0.99),  # not a drafting layer
        "layer2": match(0.05, 0.1, 0.2, 0.1, 0.5, 0.6),  # 2 x 0.5 = 1.0
        "layer3": match(0.5, 0.9, 0.95, 0.8, 0.9, 0.95),
    }  # 1 x 0.9
    seen = []

    def evaluate(model, heads, data, layers):
        seen.append((heads, data, layers))
        return rates

    monkeypatch.setattr(ppd, "evaluate", evaluate)
    heads = random_heads((1, 2, 3))
    state = {**state, "params": heads, "step": jnp.int32(5)}
    trainer.first_step, trainer.start_time = 0, time.perf_counter()
    result = trainer.finish(state, {1: 1.23456, 2: 2.0, 3: 0.5})
    assert seen == [(heads, trainer.test_data, (1, 2, 3))]
    report = result.report
    assert report["steps"] == 5 and report["default_layer"] == 2 and report["p_correct"] == rates
    assert report["final_loss"] == {"1": 1.2346, "2": 2.0, "3": 0.5}
    assert result.settings == PpdSettings(layers=(1, 2, 3), default_layer=2)
    assert list(result.params) == ["heads"] and sorted(result.params["heads"]) == sorted(heads)
    for name, head in heads.items():
        for k in ("w", "b"):
            got = result.params["heads"][name][k]
            assert got.dtype == np.float16
            np.testing.assert_array_equal(got, np.asarray(head[k], np.float16))
    assert "| layer2 | 0.050 / 0.100 | 0.100 / 0.500 | 0.200 / 0.600 |" in result.card
    assert "- Default layer: 2 (" in result.card and "at 4 answer positions per" in result.card
    assert "- One head per layer (1,2,3 of 4)" in result.card


# -- SDSAT mode (a): the spans


class ScriptedRng:
    """rng.random(n) gives `draws` (a position is drawn where it is below the rate);
    rng.integers(lo, hi) gives the next of `lengths`, its (lo, hi) kept."""

    def __init__(self, draws, lengths):
        self.draws, self.lengths, self.asked = np.asarray(draws), list(lengths), []

    def random(self, n):
        assert n == len(self.draws)
        return self.draws

    def integers(self, lo, hi):
        self.asked.append((lo, hi))
        return self.lengths.pop(0)


def test_inplace_spans_literal():
    """A span starts at a drawn answer position (the last prompt position the earliest, not
    inside an earlier span, leaving room for one replaced token before the last), its
    length 1..L, cut before the sequence's last token; offsets count up from 0."""
    draws = np.ones(24)
    draws[[3, 4, 6, 8, 12, 17, 18]] = 0.2  # drawn at rate 0.5
    rng = ScriptedRng(draws, [3, 4, 4])
    masked, offset = full.inplace_spans(np.array([5]), np.array([20]), 24, 4, 0.5, rng)
    assert rng.asked == [(1, 5)] * 3  # lengths uniform in 1..L
    # 3: in the prompt; 4 -> 5,6,7; 6: inside; 8 -> 9..12; 12: inside; 17 -> 18 (cut at 19)
    np.testing.assert_array_equal(np.flatnonzero(masked[0]), [5, 6, 7, 9, 10, 11, 12, 18])
    np.testing.assert_array_equal(offset[0, [5, 6, 7, 9, 10, 11, 12, 18]], [0, 1, 2, 0, 1, 2, 3, 0])
    assert not offset[0, ~masked[0]].any()
    none, _ = full.inplace_spans(np.array([5]), np.array([20]), 24, 4, 0.1, ScriptedRng(draws, []))
    assert not none.any()  # 0.2 is not below a rate of 0.1


def test_a_batch_without_adaptive_targets_has_a_zero_loss_not_nan():
    """weighted_mean over no weight is 0 (a batch whose answers drew no span still trains)."""
    assert float(full.weighted_mean(jnp.ones(3), jnp.zeros(3))) == 0.0
    assert float(full.weighted_mean(jnp.asarray([1.0, 2.0, 6.0]), jnp.asarray([0.0, 1, 1]))) == 4


# -- SDSAT mode (a): the trainer


def full_trainer(tmp_path, *argv):
    trainer, manager, state = started(
        train.sdsat, full.FullSdsat,
        ["--mode", "full", "--ids", "2", "--window", "3", "--mask-rate", "0.3", *argv], tmp_path,
        answers=lambda features=False: (made_up_answers(), made_up_answers(5)),
    )  # fmt: skip
    manager.close()
    return trainer, state


def clean_loss_by_hand(params, data) -> float:
    """Mean next-token cross-entropy of every answer token, by hand."""
    logp = np.asarray(jax.nn.log_softmax(reference(params, jnp.asarray(data["tokens"]))[0]))
    answers = [
        (b, t) for b in range(len(logp)) for t in range(data["starts"][b], data["lengths"][b])
    ]
    ce = [-logp[b, t - 1, data["tokens"][b, t]] for b, t in answers]
    return float(np.mean(ce))


def test_full_mode_extends_the_whole_model_and_measures_the_original_first(tmp_path):
    """prepare: the vocabulary gains --ids rows (the mean embedding; zero lm_head columns),
    every weight starts from that extended model, and standard_loss_original is the
    original model's clean test-answer loss (all 5 test answers, batches of 4 and 1)."""
    trainer, state = full_trainer(tmp_path)
    base = model().params
    assert trainer.tuned_cfg == dataclasses.replace(CFG, vocab_size=V + 2)
    embed = np.asarray(state["params"]["embed_tokens"])
    assert embed.shape == (V + 2, CFG.dim)
    np.testing.assert_array_equal(embed[:V], base["embed_tokens"])
    mean = np.asarray(base["embed_tokens"]).mean(0)
    np.testing.assert_allclose(embed[V:], np.tile(mean, (2, 1)), rtol=1e-5, atol=1e-8)
    head = np.asarray(state["params"]["lm_head"])
    np.testing.assert_array_equal(head[:, :V], base["lm_head"])
    assert not head[:, V:].any()
    np.testing.assert_array_equal(
        state["params"]["layers"][2]["q_proj"], base["layers"][2]["q_proj"]
    )
    np.testing.assert_allclose(trainer.original_loss, clean_loss_by_hand(base, made_up_answers(5)),
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("loss", ["improved", "basic"])
def test_a_full_step_gets_answer_targets_spans_and_the_extended_model(loss, tmp_path, monkeypatch):
    """Step s: --batch sequences drawn from (seed, s), their answer targets (positions
    start..length-1), in-place spans inside the answers; the extended config, --ids ids,
    w 1 and --loss; its (standard, adaptive) losses join the curve."""
    trainer, state = full_trainer(tmp_path, "--loss", loss)
    data, calls = trainer.train_data, []

    def step(state, tokens, answer, masked, offset, **static):
        calls.append((state, np.asarray(tokens), answer, masked, offset, static))
        raise Stop

    monkeypatch.setattr(full, "full_step", step)
    for s in (0, 1, 0):
        with pytest.raises(Stop):
            trainer.step(state, s)
    got_state, tokens, answer, masked, offset, static = calls[0]
    assert got_state is state
    assert static == {"cfg": trainer.tuned_cfg, "optimizer": trainer.optimizer, "n_ids": 2,
                      "w": 1.0, "loss": loss}  # fmt: skip
    assert masked.any() and offset.max() < 3
    for b, row in enumerate(tokens):
        n = int(np.flatnonzero((data["tokens"] == row).all(1))[0])
        start, length = data["starts"][n], data["lengths"][n]
        np.testing.assert_array_equal(np.flatnonzero(answer[b]) + 1, np.arange(start, length))
        where = np.flatnonzero(masked[b])
        assert where.min() >= start and where.max() < length - 1
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a[1:5], b[1:5], strict=True))  # noqa: E731
    assert same(calls[0], calls[2]) and not same(calls[0], calls[1])
    monkeypatch.setattr(full, "full_step", lambda *args, **static: ("new", (3.0, 1.5, 4.5)))
    assert trainer.step(state, 0) == ("new", (3.0, 1.5, 4.5))
    assert trainer.curve == [(1.5, 4.5)]  # (standard, adaptive) per step


def test_the_loss_curve_averages_windows_of_steps():
    """Windows of `every` steps (the last one short), standard then adaptive, from the step
    this invocation started at."""
    curve = [(float(s), 10.0 * s) for s in range(12)]
    got = full.FullSdsat.loss_curve(SimpleNamespace(curve=curve, first_step=3), every=5)
    assert got == {"from_step": 3, "every": 5, "standard": [2.0, 7.0, 10.5],
                   "adaptive": [20.0, 70.0, 105.0]}  # fmt: skip


def test_full_finish_reports_the_tuned_models_losses_and_ships_its_adaptive_rows(
    tmp_path, monkeypatch
):
    """finish: the last step's three losses, the curve; the test split evaluated with the
    tuned model as a rank-0 drafter of --ids adaptive rows (the tuned embedding's new
    rows), its clean loss beside the original's; settings for that drafter."""
    trainer, state = full_trainer(tmp_path)
    trainer.curve = [(1.0, 2.0), (3.0, 4.0)]
    trainer.first_step, trainer.start_time = 0, time.perf_counter()
    tuned = jax.tree.map(lambda x: x + 1, state["params"])
    state = {**state, "params": tuned, "step": jnp.int32(2)}
    seen = []

    def evaluate_test(drafter, params, dparams):
        seen.append((drafter, params, dparams))
        return {"spans": 7}

    def clean(params, cfg, data, batch=4):
        assert params is tuned and cfg is trainer.tuned_cfg and data is trainer.test_data
        return 1.23456

    trainer.evaluate_test = evaluate_test
    monkeypatch.setattr(full, "clean_answer_loss", clean)
    result = trainer.finish(state, (jnp.float32(3.0), jnp.float32(1.5), jnp.float32(4.5)))
    ((drafter, params, dparams),) = seen
    assert drafter.cfg == trainer.tuned_cfg and (drafter.rank, drafter.n_ids) == (0, 2)
    assert params is tuned and list(dparams) == ["embed"]
    np.testing.assert_array_equal(dparams["embed"], tuned["embed_tokens"][V:])
    assert result.params is dparams
    report = result.report
    assert (report["steps"], report["final_loss"], report["final_standard_loss"],
            report["final_adaptive_loss"]) == (2, 3.0, 1.5, 4.5)  # fmt: skip
    assert report["loss_curve"]["standard"] == [2.0] and report["loss_curve"]["adaptive"] == [3.0]
    original = round(trainer.original_loss, 4)
    assert report["test"] == {
        "spans": 7,
        "standard_loss": 1.2346,
        "standard_loss_original": original,
    }
    assert "train_minutes" not in report
    assert result.settings == SdsatSettings(rank=0, n_ids=2, window=3, cpu_tree="chain-2",
                                            gpu_tree="comb-8-4")  # fmt: skip


def test_full_mode_trains_in_one_piece_and_writes_to_the_models_folder(monkeypatch, tmp_path):
    """A data mesh is refused (the step is not split over devices); the default --out is
    $JAXSPEC_HOME/models/<model>-sdsat-full."""
    args = train.sdsat.parse_args(["--mode", "full"])
    mesh = SimpleNamespace(shape={"data": 2, "model": 1})
    with pytest.raises(JaxspecError, match="jaxspec-train sdsat does not split its batch"):
        full.FullSdsat(args, SimpleNamespace(cfg=CFG, params=None, mesh=mesh))
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path))
    trainer = full.FullSdsat(args, model())
    assert trainer.default_out() == tmp_path / "models" / f"{CFG.name}-sdsat-full"
