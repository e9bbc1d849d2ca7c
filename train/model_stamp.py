"""A model's training folder: where it is, and which model its cached data belongs to.

The answers, states and features that trainers cache are the model's own; a folder is found
by the model's name, and two models can share a name (a fine-tune's config.json often keeps
its base's). So the folder holds a stamp, model.json: the model's fingerprint, written on
first use and checked on every later one."""

from __future__ import annotations

import json
from pathlib import Path

from jaxspec.checkpoint import jaxspec_home
from jaxspec.errors import JaxspecError
from jaxspec.models import LoadedModel
from jaxspec.outputs import write_text

STAMP = "model.json"


def training_folder(cfg) -> Path:
    """$JAXSPEC_HOME/train/<model>/: the answers, states and runs of a model (LlamaConfig)."""
    return jaxspec_home() / "train" / cfg.folder_name


def claimed_folder(model) -> Path:
    """The model's training folder (training_folder), claimed for it."""
    folder = training_folder(model.cfg)
    claim(folder, model)
    return folder


def claim(folder: Path, model: LoadedModel) -> None:
    """Stamps `folder` with the model's fingerprint, or checks the stamp already there: a
    folder stamped by other weights is a one-line error (before any of its data is read)."""
    folder = Path(folder)
    stamp = folder / STAMP
    mine = {"fingerprint": model.fingerprint, "model": model.cfg.name, "source": str(model.path)}
    if stamp.is_file():
        try:
            theirs = json.loads(stamp.read_text())
        except ValueError:
            theirs = {}
        if theirs.get("fingerprint") == mine["fingerprint"]:
            return
        if theirs.get("fingerprint"):
            raise JaxspecError(
                f"{folder} holds training data of another model ({theirs.get('model')!r} from "
                f"{theirs.get('source')}), not of {model.path}: pass --work-dir DIR to keep "
                "this model's apart"
            )
    write_text(stamp, json.dumps(mine, indent=2) + "\n")
