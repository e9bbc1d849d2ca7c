"""jaxspec's checkpoint folder: jaxspec.json (config) + model.safetensors + tokenizer files.

Tensors are stored under flat names in jaxspec's layout (`jaxspec.param_table`; [in, out]
linear weights): top-level names as they are (`embed_tokens`, `norm`, ...), a layer's as
`layers.{i}.{name}` (`layers.0.q_proj`, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxspec.config import LlamaConfig
from jaxspec.errors import JaxspecError
from jaxspec.layers import OutIn
from jaxspec.param_table import param_shapes

CONFIG_FILE = "jaxspec.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def jaxspec_home() -> Path:
    """Root of jaxspec's user cache ($JAXSPEC_HOME, default ~/.cache/jaxspec)."""
    return Path(os.environ.get("JAXSPEC_HOME") or Path.home() / ".cache" / "jaxspec")


def default_model_dir() -> Path:
    return jaxspec_home() / "models" / DEFAULT_MODEL_NAME


def default_dtype():
    """Weights in float32 on CPU (its fastest AR step), bfloat16 on accelerators; products
    are float32-accurate either way (`layers.dense`; docs/design.md, Precision)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def flatten_params(params: dict) -> dict[str, Any]:
    """{"layers.{i}.{name}": w [in,out], other names: w}, whatever order compute_params
    gave the weights (leaves are arrays, or whatever a params-shaped tree holds)."""
    flat = {k: v for k, v in params.items() if k != "layers"}
    for i, layer in enumerate(params["layers"]):
        flat.update({f"layers.{i}.{name}": _in_out(w) for name, w in layer.items()})
    return flat


def _in_out(w):
    return w.w.T if isinstance(w, OutIn) else w


def unflatten_params(flat: dict[str, jax.Array], n_layers: int) -> dict:
    params: dict = {"layers": [{} for _ in range(n_layers)]}
    for key, w in flat.items():
        if key.startswith("layers."):
            _, i, name = key.split(".", 2)
            params["layers"][int(i)][name] = w
        else:
            params[key] = w
    return params


def save_checkpoint(out: Path, cfg: LlamaConfig, params: dict, tokenizer=None) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # on the host; contiguous, as safetensors' numpy writer stores a transposed view's buffer
    flat = {k: np.ascontiguousarray(v) for k, v in flatten_params(params).items()}
    tmp = out / (WEIGHTS_FILE + ".partial")
    save_file(flat, str(tmp), metadata={"format": "jaxspec"})
    tmp.replace(out / WEIGHTS_FILE)  # a crash mid-write never leaves a half checkpoint
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    cfg.save(out / CONFIG_FILE)  # written last: its presence marks a complete checkpoint


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file() and (Path(path) / WEIGHTS_FILE).is_file()


def load_params(path: Path, cfg: LlamaConfig, dtype=None, on_host: bool = False) -> dict:
    """The checkpoint's params on the default device in `dtype` (None: default_dtype()),
    or with on_host as host arrays (no device: for converting), as stored or in `dtype`."""
    file = Path(path) / WEIGHTS_FILE
    try:
        with safe_open(str(file), framework="numpy") as f:
            flat = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as e:
        raise JaxspecError(
            f"corrupt or unreadable weights {file} ({e}); delete the folder and convert again"
        ) from None
    stored = {int(k.split(".")[1]) for k in flat if k.startswith("layers.")}
    if stored != set(range(cfg.n_layers)):
        raise JaxspecError(
            f"{file} holds layers {_ranges(stored)} but {Path(path) / CONFIG_FILE} says "
            f"n_layers={cfg.n_layers}; fix n_layers or convert the model again"
        )
    if not on_host:
        flat = {k: jnp.asarray(v, dtype or default_dtype()) for k, v in flat.items()}
    elif dtype is not None:
        flat = {k: np.asarray(v, dtype) for k, v in flat.items()}
    params = unflatten_params(flat, cfg.n_layers)
    check_params(params, cfg)
    return params


def load_params_sharded(path: Path, cfg: LlamaConfig, mesh, dtype=None) -> dict:
    """The checkpoint's params placed on `mesh` (jaxspec.mesh's layout) straight from the
    file: each device's shard is read as a slice of its tensor, so a process reads only
    what its devices hold (a model larger than one device, or host, loads)."""
    from jaxspec.mesh import check_divides, param_specs

    check_divides(cfg, mesh)
    dtype = dtype or default_dtype()
    file = Path(path) / WEIGHTS_FILE
    specs = flatten_params(param_specs(cfg))
    try:
        with safe_open(str(file), framework="numpy") as f:
            have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
            problems = shape_problems(expected_shapes(cfg), have, 12)
            if problems:
                raise JaxspecError(f"weights in {file} do not match the {cfg.name} config: "
                                   f"{problems}")  # fmt: skip

            def read(name: str) -> jax.Array:
                stored, slices = (
                    f.get_slice(name),
                    {},
                )  # devices holding the same slice share a read

                def shard(index: tuple[slice, ...]) -> np.ndarray:
                    key = tuple((s.start, s.stop) for s in index)
                    if key not in slices:
                        slices[key] = np.asarray(stored[index], dtype)
                    return slices[key]

                return jax.make_array_from_callback(
                    have[name], NamedSharding(mesh, specs[name]), shard
                )

            flat = {name: read(name) for name in have}
    except (SafetensorError, OSError) as e:
        raise JaxspecError(
            f"corrupt or unreadable weights {file} ({e}); delete the folder and convert again"
        ) from None
    return unflatten_params(flat, cfg.n_layers)


def _ranges(indices: set[int]) -> str:
    return (
        f"0..{max(indices)}"
        if indices == set(range(len(indices))) and indices
        else str(sorted(indices))
    )


def load_checkpoint(path: Path, dtype=None, on_host: bool = False) -> tuple[LlamaConfig, dict]:
    path = Path(path)
    if not is_checkpoint(path):
        raise JaxspecError(
            f"no jaxspec checkpoint at {path} (needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
            "create one with `jaxspec-convert SRC --out DIR`"
        )
    cfg = LlamaConfig.load(path / CONFIG_FILE)
    return cfg, load_params(path, cfg, dtype, on_host)


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Flat name -> shape of every tensor a checkpoint of this config must hold (from
    `param_table`, flattened as params are for saving)."""
    return flatten_params(param_shapes(cfg))


def check_params(params: dict, cfg: LlamaConfig) -> None:
    """One error listing every missing, unexpected or misshapen tensor."""
    have = {k: tuple(np.shape(v)) for k, v in flatten_params(params).items()}
    problems = shape_problems(expected_shapes(cfg), have, 12)
    if problems:
        raise JaxspecError(f"weights do not match the {cfg.name} config: {problems}")


def shape_problems(want: dict, have: dict, shown: int) -> str:
    """The first `shown` missing, unexpected or misshapen names of `have` against `want`
    (name -> shape), "; "-joined; "" when they match."""
    problems = [f"missing {k}" for k in want if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want]
    problems += [
        f"{k} has shape {have[k]}, expected {want[k]}"
        for k in want
        if k in have and have[k] != want[k]
    ]
    more = f"; ... {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more
