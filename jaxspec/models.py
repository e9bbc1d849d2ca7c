"""Loading a model to decode with: the default one (converted on first use), a jaxspec
checkpoint, an HF folder or a .gguf file, with its tokenizer, in the dtype asked for."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    default_dtype,
    is_checkpoint,
    load_checkpoint,
    load_params_sharded,
)
from jaxspec.config import LlamaConfig
from jaxspec.errors import JaxspecError, given_path
from jaxspec.llama import compute_params
from jaxspec.mesh import as_mesh, shard_params

DTYPES = ("float32", "bfloat16")


def checked_dtype(dtype: str | None):
    """A name of DTYPES as its numpy dtype (None stays None); else a one-line error."""
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise JaxspecError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return jnp.dtype(dtype)


@dataclasses.dataclass
class LoadedModel:
    path: Path
    cfg: LlamaConfig
    params: dict
    tokenizer: object
    mesh: object = None  # the jax.sharding.Mesh the params are split over; None: one device

    @functools.cached_property
    def fingerprint(self) -> str:
        """Which weights these are (jaxspec.fingerprint), computed once: the weights as
        loaded (assigning other params leaves it stale)."""
        from jaxspec.fingerprint import fingerprint

        return fingerprint(self)

    @property
    def weight_dtype(self):
        """What drafter weights are cast to, so that they multiply like the model's."""
        return jax.tree.leaves(self.params)[0].dtype

    def bytes_per_device(self) -> int:
        """Bytes of the weights one device holds (the first device's shards)."""
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.params))


def load_model(src: str | Path | None = None, dtype: str | None = None, mesh=None) -> LoadedModel:
    """src: a jaxspec checkpoint folder, an HF folder (safetensors), a .gguf file, or None
    for the default model (converted into $JAXSPEC_HOME on first use). dtype: "float32" or
    "bfloat16" weights read in that dtype (None: float32 on CPU, bfloat16 on accelerators).
    mesh: "data=D,model=M" or a jax.sharding.Mesh to split the weights over
    (tensor-parallel, jaxspec.mesh); None: one device."""
    from jaxspec.convert import load_any
    from jaxspec.convert.default_model import ensure_default_model
    from jaxspec.convert.hf import load_tokenizer

    host_dtype = checked_dtype(dtype)
    path = given_path(src, "the model's path") or ensure_default_model()
    if not path.exists():
        raise JaxspecError(
            f"no model at {path}: pass a jaxspec checkpoint folder (`jaxspec-convert SRC --out "
            "DIR` makes one), an HF model folder or a .gguf file"
        )
    if (path / CONFIG_FILE).is_file() and not (path / WEIGHTS_FILE).is_file():
        raise JaxspecError(
            f"{path} holds a jaxspec {CONFIG_FILE} but no {WEIGHTS_FILE} (removed, or a copy "
            "cut short); run jaxspec-convert again"
        )
    mesh = as_mesh(mesh)
    if is_checkpoint(path) and mesh is not None:  # each process reads only its shards
        cfg = LlamaConfig.load(path / CONFIG_FILE)
        params = load_params_sharded(path, cfg, mesh, host_dtype)
        tokenizer = load_tokenizer(path)
    elif is_checkpoint(path):
        cfg, params = load_checkpoint(path, host_dtype)
        tokenizer = load_tokenizer(path)
    else:  # an HF folder or GGUF file: read into host memory in the dtype asked for, placed
        cfg, params, tokenizer = load_any(path, host_dtype or default_dtype())
        if mesh is None:
            params = jax.tree.map(jnp.asarray, params)
        else:  # host arrays straight to their shards: never the whole model on one device
            params = shard_params(params, cfg, mesh)
    # read in the dtype asked for (None: the backend's default), then laid out for products
    return LoadedModel(path, cfg, compute_params(params, dtype), tokenizer, mesh)
