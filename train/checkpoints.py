"""Resumable orbax checkpoints shared by the drafter trainers."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxspec.drafters.store import load_drafter
from jaxspec.errors import JaxspecError
from jaxspec.outputs import write_text

# Flags added after runs were made, with their defaults: hashed only when set otherwise, so
# those runs still resume.
LATER_FLAGS = {
    "bottom": "ngram",
    "init": None,
    "own_lm_head": False,
    "training": "chained",
    "loss": "improved",
    "turns": "first",
    "answers": "self",
    "keep_vocab": False,
    "feature_noise": 0.0,
    "blocks": 1,
    "rows_within": 0,
    "loss_top": 0,
    "anneal": "steps",
    "skip_prompts": None,
}


def run_name(args) -> str:
    """Checkpoints live per training setting: a rerun with the same flags resumes, a run
    with different ones starts fresh (more --steps continue the same run)."""
    # Flags that do not change the weights (a mesh, states computed live: within float
    # tolerance, in plain products within ~1%; the answer batch: AR's tokens do not depend
    # on the rows beside them).
    after_training = ("save_every", "out", "overwrite", "steps", "draft_vocab", "cache_prefill",
                      "mesh", "states", "live_products", "answer_batch", "max_minutes",
                      "eval_every")  # fmt: skip
    flags = {
        k: v
        for k, v in vars(args).items()
        if k not in after_training and LATER_FLAGS.get(k, object()) != v
    }
    return hashlib.sha1(repr(sorted(flags.items())).encode()).hexdigest()[:10]


def run_record(work: Path, args, update: dict | None = None) -> dict:
    """What the run's training part measured (final losses, minutes), kept beside its
    checkpoints so that a rerun after the last step still reports it."""
    path = work / "checkpoints" / run_name(args) / "record.json"
    record = load_json(path) if path.is_file() else {}
    if update:
        record.update(update)
        write_text(path, json.dumps(record))
    return record


def load_json(path: Path):
    """A JSON file the trainers wrote; a damaged one is a one-line error naming it."""
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise JaxspecError(
            f"{path} is damaged ({type(e).__name__}); delete it and rerun to rebuild it"
        ) from None


def resume(work: Path, args, state):
    """-> (manager saving every --save-every steps, the latest saved state or `state`,
    whether it resumed)."""
    manager = ocp.CheckpointManager(
        (work / "checkpoints" / run_name(args)).resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=args.save_every),
    )
    if manager.latest_step() is None:
        return manager, state, False
    return (
        manager,
        manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state)),
        True,
    )


def initial_params(args, method: str, cfg, fresh, grown: tuple[str, ...] = ()):
    """`fresh` (a new drafter's params), or with --init DIR that drafter's weights in float32,
    which must have the same structure and shapes (same heads, n-gram size, ...); a `grown`
    entry of `fresh` that drafter lacks (a part the flags add) is taken from `fresh`."""
    if getattr(args, "init", None) is None:
        return fresh
    loaded = load_drafter(args.init, method, cfg).params
    loaded = {**{k: fresh[k] for k in grown if k in fresh and k not in loaded}, **loaded}
    same = jax.tree.structure(loaded) == jax.tree.structure(fresh) and jax.tree.all(
        jax.tree.map(lambda a, b: a.shape == b.shape, loaded, fresh)
    )
    if not same:
        raise JaxspecError(
            f"--init {args.init}: its weights do not fit the drafter these flags build; "
            "train with the flags in its CARD.md"
        )
    return loaded


def started_from(args) -> str:
    """A card line naming the drafter that --init started from, the command that trained it
    and where that one started (both read from its card), or "" for a fresh start."""
    if getattr(args, "init", None) is None:
        return ""
    card = Path(args.init) / "CARD.md"
    text = card.read_text() if card.is_file() else ""
    found = re.search(r"^- Command: `([^`]*)`", text, re.M)
    how = f", which `{found.group(1)}` trained" if found else ""
    earlier = re.search(r"^- Started from (.*?)\n(?=- |\n|\Z)", text, re.M | re.S)
    if earlier:  # the lineage goes on: that drafter's own start, its lines joined
        how += "; that drafter started from " + " ".join(earlier.group(1).split()).rstrip(".")
    return f"- Started from the weights of the drafter then at `{args.init}`{how}.\n"


def resume_training(work: Path, args, params, optimizer):
    """-> (manager, {"params", "opt_state", "step"}): a fresh state for `params`, or the
    run's latest saved one (said on the console)."""
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    manager, state, resumed = resume(work, args, state)
    if resumed:
        print(f"resumed from step {int(state['step'])}")
    return manager, state


def save(manager, step: int, state, last: bool) -> None:
    """Save if `step` is on the manager's interval (orbax decides), and always the last one:
    a finished run reruns without training again."""
    manager.save(step, args=ocp.args.StandardSave(state), force=last)


def command_flags(args) -> str:
    """The training flags as a command line for a drafter card (paths left out; a boolean
    flag appears when set)."""
    return " ".join(
        f"--{k.replace('_', '-')}" + ("" if isinstance(v, bool) else f" {v}")
        for k, v in vars(args).items()
        if v is not None and v is not False and k not in ("model", "out", "overwrite", "work_dir")
    )
