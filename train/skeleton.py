"""What every drafter trainer does around its own loss, batches and parameters.

`train(kind, args)` runs a `Trainer` subclass:

    load the model; kind(args, model)      flags checked against the model, before any folder
    training_run(args, work, default out)  folders checked, the work folder held
    prepare()                              the method's data (cached) and drafter
    start()                                fresh or --init params; the run's latest checkpoint
    fit(manager, state)                    the steps: step() per batch, tqdm, periodic saves
    finish(state, aux) -> Result           evaluation, searched trees, settings, report, card
    save(result)                           the drafter folder and its card
    measure_acceptance(...)                accepted tokens per step, added to report and card

A subclass keeps only what is its method's: `prepare`, `fresh`, `step`, `finish` (and the
class attributes below); firp (staged maps) and sdsat's full mode replace a few more hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxspec.compile_cache import compile_cache, compiles_are_slow, default_dir
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.drafters.store import save_drafter
from jaxspec.errors import JaxspecError
from jaxspec.mesh import make_mesh, parse_mesh
from jaxspec.methods import provide_devices
from jaxspec.models import load_model
from jaxspec.outputs import write_text

from .acceptance import measure_acceptance
from .args import UNFINISHED, default_out, training_run
from .checkpoints import initial_params, resume_training, run_name, run_record, save
from .features import answer_features, self_answers
from .model_stamp import claim, training_folder


@dataclasses.dataclass
class Result:
    """What a trainer's `finish` hands back to be written and reported."""

    report: dict  # printed and returned by `train`; gains "accepted_per_step" when measured
    settings: DrafterSettings  # to drafter.json and the measurement
    params: Any  # the drafter weights to write
    card: str  # CARD.md
    measure_on: dict | None = None  # test data to measure accepted tokens on; None: not measured
    data: dict | None = None  # arrays named by the settings' DATA (drafter_data.safetensors)


class Trainer:
    """One training run of a drafter method; `train` drives the hooks in order."""

    method: ClassVar[str]  # drafter.json's method, the default --out, the bar
    folder: ClassVar[str | None] = None  # the work folder's name (default: `method`)
    desc: ClassVar[str | None] = None  # the progress bar's label (default: "train METHOD")
    show_every: ClassVar[int] = 10  # steps between progress-bar losses
    wrote: ClassVar[str] = "wrote the drafter to {out}"  # the last line printed

    data_parallel: ClassVar[bool] = False  # `step` splits its batch over `data` (split_batch)
    grown: ClassVar[tuple[str, ...]] = ()  # params --init's drafter may lack (initial_params)

    def __init__(self, args, model):
        """Subclasses check here the flags that depend on the model (before any folder)."""
        self.args, self.model, self.cfg = args, model, model.cfg
        self.mesh = model.mesh
        data = self.mesh.shape["data"] if self.mesh is not None else 1
        if data > 1 and not self.data_parallel:
            raise JaxspecError(
                f"jaxspec-train {self.method} does not split its batch over devices yet; "
                "use --mesh model=M (the frozen model split, the batch whole), or train "
                "medusa, chimera or sdsat's adapter"
            )
        if args.batch % data:
            raise JaxspecError(f"--batch {args.batch} does not split over data={data} devices; "
                               f"use a multiple of {data}")  # fmt: skip

    def split_batch(self, *arrays):
        """Batch arrays [N,...] split by rows over the mesh's `data` axis (as they are on
        one device): each device computes its rows' loss and gradient, and the compiled
        step sums the gradients over `data`."""
        if self.mesh is None:
            return arrays
        rows = NamedSharding(self.mesh, PartitionSpec("data"))
        return tuple(None if x is None else jax.device_put(x, rows) for x in arrays)

    def replicated(self, tree):
        """The training state on every device of the mesh (as it is on one device)."""
        if self.mesh is None:
            return tree
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    # -- where the run writes
    def default_work(self) -> Path:
        return training_folder(self.cfg) / (self.folder or self.method)

    def default_out(self) -> Path:
        return default_out(self.args, self.method, self.cfg.folder_name)

    @property
    def shared(self) -> Path:
        """The model's training folder (--work-dir when given): the self-distillation answers
        and features every trainer shares."""
        return self.args.work_dir or training_folder(self.cfg)

    def answers(self, features: bool = False) -> tuple[dict, dict]:
        """(train, test): the model's own greedy answers to --train-seqs train-split and
        --test-seqs test-split prompts, with `features` their last-layer states too, cached
        in the shared folder."""
        load, args = answer_features if features else self_answers, self.args

        def split(name: str, n: int) -> dict:
            return load(self.model, self.shared, name, n, args.prompt_len, args.new_tokens,
                        args.answer_batch)  # fmt: skip

        return split("train", args.train_seqs), split("test", args.test_seqs)

    # -- the method's part
    def prepare(self) -> None:
        """Data and drafter, kept on self."""
        raise NotImplementedError

    adamw: ClassVar[dict] = {"weight_decay": 0.0}  # AdamW's settings besides the rate

    def schedule(self):
        """The learning rate by step: cosine decay from --lr to 0 over --steps."""
        return optax.cosine_decay_schedule(self.args.lr, self.args.steps)

    @property
    def anneals_by_clock(self) -> bool:
        return getattr(self.args, "anneal", "steps") == "minutes"

    def make_optimizer(self):
        """AdamW on `schedule`; with --anneal minutes the rate is a hyperparameter in the
        optimizer state, set before each step (`clock_rate`)."""
        self.rate_at = self.schedule()
        if self.anneals_by_clock:
            return optax.inject_hyperparams(optax.adamw)(learning_rate=self.args.lr, **self.adamw)
        return optax.adamw(self.rate_at, **self.adamw)

    def fresh(self):
        """A new drafter's params."""
        raise NotImplementedError

    def start(self):
        """-> (checkpoint manager, {"params", "opt_state", "step"}): the run's latest saved
        state, else `fresh()` (or --init's weights) with a new optimizer state."""
        params = initial_params(self.args, self.method, self.cfg, self.fresh(), self.grown)
        manager, state = resume_training(self.work, self.args, params, self.optimizer)
        return manager, self.replicated(state)

    def step(self, state, step: int):
        """Batch `step` and one update -> (state, aux: what `shown` and `finish` read)."""
        raise NotImplementedError

    def shown(self, aux) -> dict:
        """The progress bar's postfix for aux."""
        return {}

    def finish(self, state, aux) -> Result:
        """Evaluation, settings, report and card from the trained state (aux: the last step's,
        None when this invocation trained no step)."""
        raise NotImplementedError

    # -- the skeleton
    def run(self, work: Path, out: Path) -> dict:
        """The hooks in order (module docstring), writing to `out`, `work` held -> report."""
        self.work, self.out = work, out
        self.start_time = time.perf_counter()
        self.prepare()
        self.optimizer = self.make_optimizer()
        manager, state = self.start()
        self.first_step = int(state["step"])
        state, aux = self.fit(manager, state)
        manager.wait_until_finished()
        mark = out / UNFINISHED  # until the folder is whole: a rerun may finish it
        write_text(mark, run_name(self.args))
        result = self.finish(state, aux)
        self.save(result)
        report = result.report
        if result.measure_on is not None:
            report["accepted_per_step"] = measure_acceptance(
                self.model, self.method, out, result.settings, result.measure_on
            )
        if int(state["step"]) >= self.args.steps:  # else (--max-minutes) a rerun goes on
            mark.unlink()
        print(json.dumps(report, indent=2))
        print(self.wrote.format(out=out))
        return report

    def fit(self, manager, state):
        """Steps from the state's to --steps (or until --max-minutes of the run have passed,
        or a SIGTERM came), each saved on the --save-every interval and the last one always
        -> (state, the last step's aux or None)."""
        steps, aux, limit = self.args.steps, None, self.args.max_minutes
        desc = self.desc or f"train {self.method}"
        bar = tqdm(range(int(state["step"]), steps), desc=desc, unit="step")
        began = None  # when this invocation's first step (its compile) was done
        with sigterm_stops() as stop:
            for step in bar:
                if self.anneals_by_clock:
                    state = self.clock_rate(state, step, began)
                state, aux = self.step(state, step)
                began = began or time.perf_counter()
                if (step + 1) % self.show_every == 0 and (postfix := self.shown(aux)):
                    bar.set_postfix(**postfix)
                late = limit is not None and time.perf_counter() - self.start_time >= limit * 60
                why = stop.reason or (f"--max-minutes {limit:g}" if late else None)
                save(manager, step + 1, state, last=step + 1 == steps or why is not None)
                if why and step + 1 < steps:
                    bar.close()
                    print(f"{why}: stopped after step {step + 1} of {steps}")
                    break
        return state, aux

    def clock_rate(self, state, step: int, began: float | None):
        """-> state with step's learning rate under --anneal minutes: the schedule's at the
        later of the step's place in --steps and the clock's (the time since this
        invocation's first step `began`, None before it, over what --max-minutes leaves
        from there, scaled to --steps), so the rate reaches its end when the minutes do, at
        whatever pace the steps go (the first step's compile not counted as training)."""
        spent = 0.0
        if began is not None:
            left = self.args.max_minutes * 60 - (began - self.start_time)
            spent = min((time.perf_counter() - began) / left, 1.0) if left > 0 else 1.0
        opt = state["opt_state"]
        old = opt.hyperparams["learning_rate"]
        rate = self.rate_at(max(step, spent * self.args.steps))
        rate = jax.device_put(jnp.asarray(rate, old.dtype), old.sharding)
        hyper = {**opt.hyperparams, "learning_rate": rate}
        return {**state, "opt_state": opt._replace(hyperparams=hyper)}

    def save(self, result: Result) -> None:
        save_drafter(self.out, self.method, result.settings, result.params, self.cfg, result.card,
                     result.data, self.model.fingerprint)  # fmt: skip

    def minutes(self, before: float = 0.0) -> float:
        """Minutes since the run began, plus `before`, rounded for reports."""
        return round((time.perf_counter() - self.start_time) / 60 + before, 1)

    def record(self, measured, minutes: bool = True) -> dict:
        """The run record (checkpoints.run_record): when this invocation trained, updated
        with measured() (the final losses) and, with `minutes`, the training minutes of all
        its invocations; a rerun after the last step reports the recorded ones."""
        record = run_record(self.work, self.args)
        if self.first_step < self.args.steps:
            update = measured()
            if minutes:
                update["train_minutes"] = self.minutes(record.get("train_minutes", 0.0))
            record = run_record(self.work, self.args, update)
        return record


@contextlib.contextmanager
def sigterm_stops():
    """While the steps run, a SIGTERM (a scheduler's or `timeout`'s stop) ends them after the
    step in progress as --max-minutes does: saved, the drafter written from the weights so
    far, the same command going on from there; a second SIGTERM acts as it did before. Only
    the main thread can catch signals: elsewhere nothing changes. -> a namespace whose
    `reason` is "SIGTERM" once one came."""
    stop = SimpleNamespace(reason=None)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    before = signal.getsignal(signal.SIGTERM)
    before = signal.SIG_DFL if before is None else before  # set outside Python

    def caught(signum, frame):
        stop.reason = "SIGTERM"
        signal.signal(signal.SIGTERM, before)

    signal.signal(signal.SIGTERM, caught)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, before)


def train(kind: type[Trainer], args) -> dict:
    """Train with `kind` for the parsed `args` -> its report."""
    shape = parse_mesh(args.mesh) if args.mesh else None
    if shape:
        provide_devices(shape["data"] * shape["model"])
    # Where compiles are slow, a resumed run loads its programs instead of compiling them.
    with compile_cache(default_dir() if compiles_are_slow() else None):
        model = load_model(args.model, mesh=shape and make_mesh(shape))
        if model.tokenizer is None:
            raise JaxspecError(
                f"the model at {model.path} has no tokenizer, and training encodes prompts "
                "with it: train from a model folder (or .gguf) that holds one"
            )
        trainer = kind(args, model)
        work = args.work_dir or trainer.default_work()
        with training_run(args, work, trainer.default_out()) as out:
            claim(trainer.shared, trainer.model)
            return trainer.run(work, out)
