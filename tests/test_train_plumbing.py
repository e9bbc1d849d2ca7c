"""The trainers' shared plumbing (train/skeleton.py, train/checkpoints.py), driven by a
stand-in method whose step is one AdamW update of a 3-vector (no model, no data): which
steps run, what is saved and when, resuming from the last checkpoint, --max-minutes, the run
record a rerun reports; and which flags keep a run's checkpoints."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from train import checkpoints, skeleton
from train.args import UNFINISHED, parse, trainer_parser, training_run
from train.checkpoints import command_flags, initial_params, run_name
from train.optim import apply_grads
from train.skeleton import Result, Trainer

MODEL = SimpleNamespace(
    cfg=SimpleNamespace(name="tiny", folder_name="tiny"), mesh=None, tokenizer=object()
)


class Counting(Trainer):
    """Step i adds the gradient i + 1 (a skipped or repeated step changes the weights) and
    one minute to the clock, preparing half a minute."""

    method = "medusa"

    def prepare(self):
        self.ran = []
        self.clock.now += 30.0  # its data: half a minute

    def fresh(self):
        return {"w": jnp.zeros(3)}

    def step(self, state, step):
        self.ran.append(step)
        self.clock.now += 60.0
        if step == self.die_at:
            self.manager.wait_until_finished()  # the saves so far on disk, as a kill finds them
            raise KeyboardInterrupt
        if step == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)  # caught before the step returns
        return apply_grads(state, {"w": jnp.full(3, step + 1.0)}, self.optimizer), step

    def fit(self, manager, state):
        self.manager = manager
        return super().fit(manager, state)

    def finish(self, state, aux):
        self.saving = self.manager.is_saving_in_progress()
        record = self.record(lambda: {"w": np.asarray(state["params"]["w"]).tolist()})
        report = {**record, "aux": aux, "step": int(state["step"])}
        return Result(report, None, None, "", measure_on={"rows": 2})

    def save(self, result):
        pass


class Split(Counting):
    data_parallel = True


@pytest.fixture
def fit(tmp_path, monkeypatch):
    """fit(*flags, die_at=step index, kind=a Counting subclass) -> (trainer, report): a run
    in tmp_path/work with --save-every 3 on a clock that only the steps move (a minute
    each)."""
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(skeleton, "measure_acceptance", lambda model, method, out, settings,
                        on: {"measured on": on})  # fmt: skip
    monkeypatch.setattr(skeleton, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    def fit(*flags, die_at=None, term_at=None, work="work", kind=None):
        argv = ["--work-dir", str(tmp_path / work), "--save-every", "3", *flags]
        trainer = (kind or Counting)(parse(trainer_parser("medusa", None), argv), MODEL)
        trainer.clock, trainer.die_at, trainer.term_at = clock, die_at, term_at
        try:
            return trainer, trainer.run(tmp_path / work, tmp_path / "out")
        finally:
            trainer.saved = sorted(int(p.name) for p in (tmp_path / work).glob("checkpoints/*/*")
                                   if p.name.isdigit())  # fmt: skip

    return fit


def test_a_killed_run_resumes_from_its_last_save_to_the_uninterrupted_weights(fit, capsys):
    whole, uninterrupted = fit("--steps", "7", work="whole")
    assert whole.ran == list(range(7)) and uninterrupted["aux"] == 6
    assert whole.saved == [6, 7]  # every 3 steps and the last (the 2 latest kept)
    assert not whole.saving  # finished writing before the drafter is
    assert uninterrupted["accepted_per_step"] == {"measured on": {"rows": 2}}
    with pytest.raises(KeyboardInterrupt):
        fit("--steps", "7", die_at=4)
    capsys.readouterr()
    resumed, report = fit("--steps", "7")
    assert "resumed from step 3\n" in capsys.readouterr().out
    assert resumed.ran == [3, 4, 5, 6] and report["step"] == 7
    np.testing.assert_array_equal(report["w"], uninterrupted["w"])  # moments restored too


def test_a_killed_run_saved_only_on_the_interval(fit):
    with pytest.raises(KeyboardInterrupt):
        fit("--steps", "7", die_at=5)
    resumed, _ = fit("--steps", "7")
    assert resumed.ran == [3, 4, 5, 6]


def test_max_minutes_saves_stops_and_a_rerun_goes_on_and_adds_the_minutes(fit, capsys, tmp_path):
    stopped, report = fit("--steps", "3", "--max-minutes", "2")
    assert stopped.ran == [0, 1] and stopped.saved == [1, 2] and report["step"] == 2
    assert "--max-minutes 2: stopped after step 2 of 3" in capsys.readouterr().out
    assert report["train_minutes"] == 2.5
    assert (tmp_path / "out" / UNFINISHED).is_file()  # its --out: for the rerun to go on
    resumed, report = fit("--steps", "3")  # the same run: --max-minutes is not a training flag
    assert resumed.ran == [2] and report["train_minutes"] == 4.0 and report["step"] == 3
    assert not (tmp_path / "out" / UNFINISHED).exists()
    again, rerun = fit("--steps", "3")  # finished: nothing trains, the record is reported
    assert again.ran == [] and rerun["aux"] is None
    assert rerun["train_minutes"] == 4.0 and rerun["w"] == report["w"]


class Constant(Counting):
    """Every step's gradient is 1: AdamW moves each weight by the step's learning rate."""

    def step(self, state, step):
        self.ran.append(step)
        self.clock.now += 60.0
        return apply_grads(state, {"w": jnp.ones(3)}, self.optimizer), step


def cosine(steps: int, *at: float) -> float:
    """The sum of the cosine decay's rates (from 1 to 0 over `steps`) at the steps `at`."""
    return sum((1 + np.cos(np.pi * a / steps)) / 2 for a in at)


def test_anneal_minutes_ends_the_decay_with_the_clock_and_a_rerun_takes_it_up(fit):
    """--max-minutes 4.5 after half a minute of data leaves 4 one-minute steps of 10: with
    --anneal minutes the clock starts when the first (its compile) is done, and the other
    three take the cosine's rates at 1, 10/3 and 20/3 (their place in the 3 minutes left,
    ahead of the steps' 1, 2, 3); the rerun, with minutes to spare, goes on at the steps'
    place (4..9) from the restored optimizer state."""
    flags = ("--lr", "0.1", "--steps", "10", "--max-minutes", "4.5")
    stopped, report = fit(*flags, "--anneal", "minutes", kind=Constant)
    assert stopped.ran == [0, 1, 2, 3]
    clock = (0, 1, 10 / 3, 20 / 3)
    np.testing.assert_allclose(report["w"], [-0.1 * cosine(10, *clock)] * 3, atol=1e-5)
    _, plain = fit(*flags, work="plain", kind=Constant)
    np.testing.assert_allclose(plain["w"], [-0.1 * cosine(10, 0, 1, 2, 3)] * 3, atol=1e-5)
    more = ("--lr", "0.1", "--steps", "10", "--max-minutes", "100", "--anneal", "minutes")
    resumed, report = fit(*more, kind=Constant)
    assert resumed.ran == [4, 5, 6, 7, 8, 9]
    rates = cosine(10, *clock, *range(4, 10))
    np.testing.assert_allclose(report["w"], [-0.1 * rates] * 3, atol=1e-5)


def test_anneal_minutes_needs_the_minutes():
    with pytest.raises(JaxspecError, match="--anneal minutes .* give them with --max-minutes"):
        parse(trainer_parser("medusa", None), ["--anneal", "minutes"])


def test_sigterm_saves_the_step_in_progress_stops_and_a_rerun_goes_on(fit, capsys, tmp_path):
    """A scheduler's or `timeout`'s SIGTERM stops the steps as --max-minutes does (the step
    saved off the --save-every interval, the drafter written, the folder left to finish),
    and the handler is the caller's again afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    _, uninterrupted = fit("--steps", "6", work="whole")
    stopped, report = fit("--steps", "6", term_at=3)
    assert stopped.ran == [0, 1, 2, 3] and stopped.saved == [3, 4] and report["step"] == 4
    assert "SIGTERM: stopped after step 4 of 6" in capsys.readouterr().out
    assert report["accepted_per_step"] == {"measured on": {"rows": 2}}  # the drafter's finish
    assert (tmp_path / "out" / UNFINISHED).is_file()
    assert signal.getsignal(signal.SIGTERM) == before
    resumed, report = fit("--steps", "6")
    assert resumed.ran == [4, 5] and report["step"] == 6
    np.testing.assert_array_equal(report["w"], uninterrupted["w"])


def test_a_run_killed_while_it_writes_its_drafter_finishes_when_rerun(fit, monkeypatch, tmp_path):
    """A kill after the last step (writing or measuring the drafter) leaves --out holding
    files; the same command may finish that folder, another run may not."""

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(skeleton, "measure_acceptance", killed)
    with pytest.raises(KeyboardInterrupt):
        fit("--steps", "4")
    out = tmp_path / "out"
    assert (out / UNFINISHED).is_file()
    argv = ["--work-dir", str(tmp_path / "work"), "--save-every", "3", "--steps", "4"]
    parse(trainer_parser("medusa", None), [*argv, "--out", str(out)])  # the same run
    with pytest.raises(JaxspecError, match="is not empty; pass --overwrite"):
        parse(trainer_parser("medusa", None), [*argv, "--out", str(out), "--lr", "0.5"])
    monkeypatch.setattr(skeleton, "measure_acceptance", lambda *args: {"chain-1": 1.5})
    trainer, report = fit("--steps", "4")
    assert trainer.ran == [] and report["accepted_per_step"] == {"chain-1": 1.5}
    assert not (out / UNFINISHED).exists()


def test_paths_read_late_are_checked_when_the_flags_are_parsed(tmp_path):
    """(--init and --eval-questions once failed only after the answers were made.)"""
    from train.eagle import parse_args as eagle_args

    with pytest.raises(JaxspecError, match="--init .*: no drafter there"):
        parse(trainer_parser("medusa", None, can_init=True), ["--init", str(tmp_path)])
    with pytest.raises(JaxspecError, match="no question file at"):
        eagle_args(["--eval-questions", str(tmp_path / "q.jsonl")])


def test_the_run_record_keeps_what_each_invocation_measured(tmp_path):
    args, other = SimpleNamespace(seed=0), SimpleNamespace(seed=1)
    checkpoints.run_record(tmp_path, args, {"history": [1], "loss": 2.0})
    assert checkpoints.run_record(tmp_path, args, {"loss": 1.0}) == {"history": [1], "loss": 1.0}
    assert checkpoints.run_record(tmp_path, args) == {"history": [1], "loss": 1.0}
    assert checkpoints.run_record(tmp_path, other) == {}  # another run's own


def test_a_damaged_run_record_is_one_line_naming_it(tmp_path):
    args = SimpleNamespace(seed=0)
    record = tmp_path / "checkpoints" / run_name(args) / "record.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"train_minutes": 1')  # cut short
    with pytest.raises(JaxspecError, match=f"{record} is damaged"):
        checkpoints.run_record(tmp_path, args)


def test_only_training_flags_start_a_new_run():
    """More --steps, another --save-every, --max-minutes, --answer-batch, --out or --mesh
    (and EAGLE's --eval-every, --states, --live-products) continue the same run's
    checkpoints; a training flag starts another."""
    eagle = importlib.import_module("train.eagle").parse_args
    base = run_name(eagle([]))
    same = (["--steps", "9"], ["--save-every", "7"], ["--max-minutes", "5"],
            ["--answer-batch", "3"], ["--out", "x", "--overwrite"], ["--mesh", "model=2"],
            ["--eval-every", "5"], ["--states", "live", "--live-products", "plain"])  # fmt: skip
    for flags in same:
        assert run_name(eagle(flags)) == base, flags
    for flags in (["--seed", "1"], ["--lr", "0.002"], ["--batch", "8"]):
        assert run_name(eagle(flags)) != base, flags


# The flags each trainer gained after runs were made: at their defaults, a run made before
# them keeps its checkpoints.
ADDED_LATER = ("bottom", "init", "own_lm_head", "training", "loss", "turns", "answers",
               "keep_vocab", "feature_noise", "blocks", "rows_within", "loss_top", "anneal",
               "skip_prompts")  # fmt: skip


@pytest.mark.parametrize("method", ["medusa", "firp", "chimera", "sdsat", "ppd", "eagle"])
def test_every_flag_added_later_at_its_default_keeps_older_runs(method):
    args = importlib.import_module(f"train.{method}").parse_args([])
    older = SimpleNamespace(**{k: v for k, v in vars(args).items() if k not in ADDED_LATER})
    assert run_name(older) == run_name(args)


def test_a_cards_command_names_the_training_flags_only():
    args = SimpleNamespace(model="m", out="o", overwrite=True, work_dir="w", steps=5,
                           own_lm_head=True, keep_vocab=False, init=None, lr=0.01)  # fmt: skip
    assert command_flags(args) == "--steps 5 --own-lm-head --lr 0.01"


def test_init_takes_the_drafters_weights_and_grown_parts_from_fresh(monkeypatch):
    stored = {"heads": jnp.zeros(2)}
    monkeypatch.setattr(checkpoints, "load_drafter", lambda *a: SimpleNamespace(params=stored))
    fresh = {"heads": jnp.ones(2), "bias": jnp.ones(1)}
    args = SimpleNamespace(init="d")
    got = initial_params(args, "medusa", None, fresh, grown=("bias",))
    assert got["heads"] is stored["heads"] and got["bias"] is fresh["bias"]
    stored["bias"] = jnp.zeros(1)  # a drafter trained with the grown part keeps its own
    assert initial_params(args, "medusa", None, fresh, grown=("bias",)) == stored
    del stored["bias"]
    with pytest.raises(JaxspecError, match="--init d: its weights do not fit"):
        initial_params(args, "medusa", None, fresh)  # bias not grown: another drafter
    with pytest.raises(JaxspecError, match="--init d: its weights do not fit"):
        initial_params(args, "medusa", None, {"heads": jnp.ones(3)})


def test_a_batch_split_over_data_devices_is_checked():
    args = SimpleNamespace(batch=3)
    model = SimpleNamespace(cfg=None, mesh=SimpleNamespace(shape={"data": 2, "model": 1}))
    with pytest.raises(JaxspecError, match="does not split its batch over devices"):
        Counting(args, model)
    with pytest.raises(JaxspecError, match="--batch 3 does not split over data=2 devices"):
        Split(args, model)
    Split(SimpleNamespace(batch=4), model)


def test_a_trainers_own_defaults_reach_its_flags():
    p = trainer_parser("ppd", None, train_seqs=7, steps=8, batch=9, save_every=10)
    args = p.parse_args([])
    assert (args.train_seqs, args.steps, args.batch, args.save_every) == (7, 8, 9, 10)


def test_jaxspec_train_h_is_its_help(capsys):
    from train.cli import main

    main(["-h"])
    assert "one of medusa, firp, chimera, sdsat, ppd, eagle" in capsys.readouterr().out


def test_the_run_writes_to_out_else_to_its_default(tmp_path):
    p, work, default = trainer_parser("medusa", None), tmp_path / "work", tmp_path / "default"
    with training_run(parse(p, ["--out", str(tmp_path / "given")]), work, default) as out:
        assert out == tmp_path / "given"
    with training_run(parse(p, []), work, default) as out:
        assert out == default


def test_adamw_decays_the_learning_rate_to_zero_over_the_steps():
    """A constant gradient moves each weight by the step's learning rate (Adam's first
    moment over the root of its second is 1), the cosine from --lr to 0 over --steps: 4
    steps at 0.1 move it 0.1 * (1 + (1 + cos(pi/4))/2 + 1/2 + (1 - cos(pi/4))/2) = 0.25 (and
    no weight decay pulls it further)."""
    args = parse(trainer_parser("medusa", None), ["--lr", "0.1", "--steps", "4"])
    optimizer = Counting(args, MODEL).make_optimizer()
    state = {"params": {"w": jnp.full(2, 10.0)}, "step": 0}
    state["opt_state"] = optimizer.init(state["params"])
    for _ in range(4):
        state = apply_grads(state, {"w": jnp.ones(2)}, optimizer)
    np.testing.assert_allclose(state["params"]["w"], [9.75, 9.75], atol=2e-5)
    assert state["step"] == 4


def test_a_data_split_puts_each_devices_rows_on_it():
    from jaxspec.mesh import make_mesh

    mesh = make_mesh({"data": 2, "model": 1})
    trainer = Split(SimpleNamespace(batch=4), SimpleNamespace(cfg=None, mesh=mesh))
    rows, none = trainer.split_batch(np.arange(12).reshape(4, 3), None)
    assert none is None and [s.data.shape for s in rows.addressable_shards] == [(2, 3)] * 2
    np.testing.assert_array_equal(rows, np.arange(12).reshape(4, 3))


def test_train_asks_for_the_meshs_devices_and_caches_slow_compiles(tmp_path, monkeypatch):
    got = {}
    monkeypatch.setattr(skeleton, "provide_devices", lambda n: got.setdefault("devices", n))
    monkeypatch.setattr(skeleton, "load_model", lambda path, mesh: MODEL)
    monkeypatch.setattr(skeleton, "claim", lambda folder, model: got.setdefault("claim", folder))
    monkeypatch.setattr(skeleton, "compiles_are_slow", lambda: True)
    monkeypatch.setattr(skeleton, "compile_cache", lambda folder: contextlib.nullcontext(
                        got.setdefault("cache", folder)))  # fmt: skip
    monkeypatch.setattr(Counting, "run", lambda self, work, out: "ran")
    argv = ["--work-dir", str(tmp_path / "work"), "--mesh", "data=2,model=2"]
    assert skeleton.train(Split, parse(trainer_parser("medusa", None), argv)) == "ran"
    assert got == {"devices": 4, "cache": skeleton.default_dir(), "claim": tmp_path / "work"}
