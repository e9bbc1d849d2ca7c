"""A model's training folder: where it is, and which model its cached data belongs to.

The answers, states and features that trainers cache are the model's own; a folder is found
by the model's name, and two models can share a name (a fine-tune's config.json often keeps
its base's). So the folder holds a stamp, model.json: the model's fingerprint, written on
first use and checked on every later one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoint import jaxspec_home
from jaxspec.errors import JaxspecError
from jaxspec.layers import OutIn, PlainProducts
from jaxspec.outputs import write_text

STAMP = "model.json"
SAMPLE = 32  # elements taken from each end of a weight
# the config's sizes (its constants differ by file format: a GGUF's float32 norm_eps, its
# RoPE frequency factors where HF names the llama3 scaling)
SHAPE = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim")


def training_folder(cfg) -> Path:
    """$JAXSPEC_HOME/train/<model>/: the answers, states and runs of a model (LlamaConfig)."""
    return jaxspec_home() / "train" / cfg.folder_name


def claimed_folder(model) -> Path:
    """The model's training folder (training_folder), claimed for it."""
    folder = training_folder(model.cfg)
    claim(folder, model)
    return folder


def fingerprint(model) -> str:
    """The model's sizes and the first and last SAMPLE elements of every weight as bfloat16
    bits: the same for one model in either dtype, from any file format, on any mesh;
    different for other weights."""
    shape = {k: getattr(model.cfg, k) for k in SHAPE}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    flat = jax.tree_util.tree_flatten_with_path(
        model.params, is_leaf=lambda x: isinstance(x, (OutIn, PlainProducts))
    )[0]
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    for path, sample in zip(paths, _samples([leaf for _, leaf in flat]), strict=True):
        digest.update(path.encode())
        digest.update(np.asarray(sample).view(np.uint16).tobytes())
    return digest.hexdigest()[:20]


@jax.jit
def _samples(leaves: list) -> list[jax.Array]:
    """Each weight's first SAMPLE and last SAMPLE elements in its [in,out] order, as
    bfloat16 [<= 2*SAMPLE] (an OutIn stores [out,in])."""
    out = []
    for leaf in leaves:
        while isinstance(leaf, PlainProducts):
            leaf = leaf.w
        if isinstance(leaf, OutIn):
            w = leaf.w  # [out,in]
            first, last = w[:SAMPLE, 0], w[-SAMPLE:, -1]
        elif leaf.ndim == 0:
            first = last = leaf[None]
        else:
            corner = (0,) * (leaf.ndim - 1)
            first, last = leaf[corner][:SAMPLE], leaf[tuple(-1 for _ in corner)][-SAMPLE:]
        out.append(jnp.concatenate([first, last]).astype(jnp.bfloat16))
    return out


def claim(folder: Path, model) -> None:
    """Stamps `folder` with the model's fingerprint, or checks the stamp already there: a
    folder stamped by other weights is a one-line error (before any of its data is read)."""
    folder = Path(folder)
    stamp = folder / STAMP
    mine = {"fingerprint": fingerprint(model), "model": model.cfg.name, "source": str(model.path)}
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
