"""The command-line options every trainer shares (each trainer adds its own), checked where
they are parsed, and the folders a run writes: checked before any work, the work folder held
for the whole run."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from jaxspec.checkpoint import CONFIG_FILE, default_model_dir, jaxspec_home
from jaxspec.cli import (
    ArgumentParser,
    mesh_flag,
    nonnegative_float,
    positive_float,
    positive_int,
    seed,
)
from jaxspec.config import LlamaConfig
from jaxspec.data.sources import load_questions
from jaxspec.drafters.store import META, WEIGHTS, check_drafter, read_settings
from jaxspec.errors import JaxspecError
from jaxspec.outputs import check_output_dir, check_writable_dir, exclusive

from .checkpoints import run_name
from .selfdata import ANSWER_BATCH, prompt_set


def int_list(text: str) -> str:
    """Comma-separated integers >= 1, kept as written (run names and cards show the text)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes comma-separated integers, e.g. 10,15,20; got {text!r}"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"takes integers >= 1, got {text!r}")
    return text


def prompt_set_text(text: str) -> str:
    """TURNS:N:LEN (selfdata.prompt_set), kept as written (run names and cards show it)."""
    try:
        prompt_set(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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
    can_stop_early: bool = True,
) -> argparse.ArgumentParser:
    """Model and output, the self-distillation data (the model's own answers to ShareGPT
    train-split prompts), the optimisation schedule and the seed; with `can_init`, --init
    (the trainer starts from `checkpoints.initial_params`); with `can_stop_early`,
    --max-minutes (`Trainer.fit` stops there)."""
    p = ArgumentParser(prog=f"jaxspec-train {method}", description=doc)
    p.add_argument("--model", type=Path, help="jaxspec checkpoint (default: the default model)")
    p.add_argument(
        "--out",
        type=Path,
        help=f"output folder (default: $JAXSPEC_HOME/drafters/<model>/{method}-<run>, this "
        "run's own: the same flags write the same folder; the shipped drafters/ is never "
        "written unless named here with --overwrite)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the files of a non-empty --out (without it such an --out is refused)",
    )
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
    p.add_argument(
        "--mesh", type=mesh_flag,
        help="data=D,model=M: each step's batch split over D devices (medusa, chimera, sdsat's "
        "adapter; the others data=1), the frozen model over M (ppd takes no --mesh; on CPU the "
        "D*M virtual devices are set up for you; default: one device)",
    )  # fmt: skip
    p.add_argument("--train-seqs", type=positive_int, default=train_seqs)
    p.add_argument("--test-seqs", type=positive_int, default=40)
    p.add_argument("--prompt-len", type=positive_int, default=128, help="longest prompt")
    p.add_argument("--new-tokens", type=positive_int, default=192, help="answer length")
    p.add_argument(
        "--answer-batch",
        type=positive_int,
        default=ANSWER_BATCH,
        help="prompts answered at once when the answers are made (a GPU: 256)",
    )
    p.add_argument("--steps", type=positive_int, default=steps, help=steps_help)
    p.add_argument("--batch", type=positive_int, default=batch, help=batch_help)
    p.add_argument(
        "--lr", type=nonnegative_float, default=1e-3, help="peak learning rate (0 keeps weights)"
    )
    p.add_argument("--save-every", type=positive_int, default=save_every)
    if can_stop_early:
        p.add_argument(
            "--max-minutes",
            type=positive_float,
            help="stop after this many minutes of the run (making its data counts), save, "
            "and write the drafter from the weights so far; the same command resumes later "
            "(a SIGTERM during the steps stops them the same way)",
        )
        p.add_argument(
            "--anneal",
            choices=("steps", "minutes"),
            default="steps",
            help="where the learning rate's decay ends: at --steps, or (minutes) also when "
            "--max-minutes does, whichever comes first, so that a run the clock stops writes a "
            "drafter trained to the schedule's end whatever the pace of its steps (a loan's "
            "fixed minutes); a rerun takes the schedule up at its step",
        )
    p.add_argument("--seed", type=seed, default=0)
    return p


def parse(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The trainer's arguments, with the folders given checked before anything loads."""
    args = p.parse_args(argv)
    if getattr(args, "anneal", "steps") == "minutes" and args.max_minutes is None:
        raise JaxspecError("--anneal minutes ends the learning rate's decay with the run's "
                           "minutes: give them with --max-minutes")  # fmt: skip
    check_folders(args, args.out, args.work_dir)
    if getattr(args, "init", None) is not None:
        method = p.prog.removeprefix("jaxspec-train ")
        check_init(args.init, method, args.model or default_model_dir())
    if getattr(args, "eval_questions", None):
        load_questions(args.eval_questions)  # a missing or malformed file: one line, now
    return args


def check_init(init: Path, method: str, model: Path) -> None:
    """--init holds a `method` drafter for the model's shapes (where the model's config is
    there yet: the default model may be converted later), or a one-line error before any
    work is done."""
    if not all((init / f).is_file() for f in (META, WEIGHTS)):
        raise JaxspecError(
            f"--init {init}: no drafter there (needs {META} and {WEIGHTS}); pass a drafter "
            "folder of this method, e.g. drafters/<model>/<method>"
        )
    if (model / CONFIG_FILE).is_file():
        check_drafter(init, method, LlamaConfig.load(model / CONFIG_FILE),
                      "start fresh (no --init), or from a drafter of this model")  # fmt: skip
    else:
        read_settings(init, method)


# In --out while a run writes its drafter and measures it: the run's name (run_name), so
# that the same command, rerun after a kill there, may finish the folder.
UNFINISHED = ".unfinished-run"


def check_folders(args, out: Path | None, work: Path | None) -> None:
    """`out` is writable, not the model's folder, and empty unless --overwrite, it is the
    run's own default folder, or this run was writing it when it stopped; `work` is
    writable."""
    if out is not None:
        model = args.model or default_model_dir()
        mark = Path(out) / UNFINISHED
        unfinished = mark.is_file() and mark.read_text().strip() == run_name(args)
        check_output_dir(out, [model], overwrite=args.overwrite or args.out is None or unfinished)
    if work is not None:
        check_writable_dir(work, "--work-dir")


def default_out(args, method: str, model_name: str) -> Path:
    """The run's own output folder, $JAXSPEC_HOME/drafters/<model>/<method>-<run name>:
    never the repository's drafters/; a rerun of the same run rewrites it."""
    return jaxspec_home() / "drafters" / model_name / f"{method}-{run_name(args)}"


@contextlib.contextmanager
def training_run(args, work: Path, default: Path) -> Iterator[Path]:
    """Yields the output folder (--out, else `default`), with `work` held: a second training
    on it is refused, naming this process. `parse` checked the folders given; the defaults
    are checked here."""
    out = args.out or default
    check_folders(args, None if args.out else out, None if args.work_dir else work)
    with exclusive(work):
        print(f"writing to {out} (work folder {work})", flush=True)
        yield out
