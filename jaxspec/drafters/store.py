"""Drafter folders: drafter.safetensors (weights) + drafter.json (method, typed settings,
base model: its sizes, name and weights' fingerprint) + CARD.md, and
drafter_data.safetensors when training measured or derived data arrays (the settings
class's `DATA`). Loading checks the sizes against the base model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from jaxspec.config import LlamaConfig
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.errors import JaxspecError, option

WEIGHTS, META, DATA = "drafter.safetensors", "drafter.json", "drafter_data.safetensors"


class StoredDrafter(NamedTuple):
    """A drafter folder read back: its settings, weights, and data arrays by name."""

    settings: DrafterSettings
    params: dict
    data: dict[str, np.ndarray]


def base_model_sizes(cfg: LlamaConfig) -> dict:
    return {
        "vocab_size": cfg.vocab_size,
        "dim": cfg.dim,
        "n_layers": cfg.n_layers,
        "name": cfg.name,
    }


def _stored(leaf) -> np.ndarray:
    """float16 stays float16 (drafters stored half size); the rest as float32."""
    array = np.asarray(leaf)
    return array if array.dtype == np.float16 else array.astype(np.float32)


def flatten(tree, prefix="", leaf=_stored) -> dict:
    """Nested dicts and lists -> {"a.0.b": leaf(x)}: the names drafter files store."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix[:-1]: leaf(tree)}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}{k}.", leaf))
    return out


def unflatten(flat: dict[str, np.ndarray]):
    """flatten's inverse; ValueError where a list's indices are not 0..n-1."""
    root: dict = {}
    for key, value in flat.items():
        node, parts = root, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value

    def listify(node):
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            if set(node) != {str(i) for i in range(len(node))}:
                raise ValueError(f"list indices {sorted(node, key=int)} are not 0..{len(node) - 1}")
            return [listify(node[str(i)]) for i in range(len(node))]
        return {k: listify(v) for k, v in node.items()}

    return listify(root)


def save_drafter(
    out: Path,
    method: str,
    settings: DrafterSettings,
    params,
    base: LlamaConfig,
    card: str,
    data: dict[str, np.ndarray] | None = None,
    base_weights: str | None = None,
):
    """Writes the folder; `data`: arrays named by the settings class's DATA; base_weights:
    the base model's fingerprint (jaxspec.fingerprint)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(data or {}) - set(settings.DATA)
    if unknown:
        raise ValueError(f"{type(settings).__name__} carries no data named {sorted(unknown)}")
    save_file(flatten(params), str(out / WEIGHTS))
    if data:
        save_file({k: np.ascontiguousarray(v) for k, v in data.items()}, str(out / DATA))
    else:
        (out / DATA).unlink(missing_ok=True)
    base_model = base_model_sizes(base) | ({"weights": base_weights} if base_weights else {})
    meta = {"method": method, "settings": settings.to_json(), "base_model": base_model}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    (out / "CARD.md").write_text(card)


def read_meta(file: Path) -> dict:
    """drafter.json as a dict with a `settings` dict; else a one-line error naming the file."""
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise JaxspecError(f"{file} is not valid JSON ({e}); retrain the drafter") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("settings"), dict):
        raise JaxspecError(
            f'{file} has no "settings" object; it is not a jaxspec drafter: retrain it'
        )
    return meta


def read_settings(path: Path, method: str) -> tuple[DrafterSettings, dict[str, np.ndarray]]:
    """A folder's settings as `method`'s settings class, with the data arrays its
    drafter.json still holds inline (folders written before data files) -> (settings, data)."""
    return _settings(read_meta(Path(path) / META), path, method)


def _settings(meta: dict, path: Path, method: str):
    """read_settings on a drafter.json already read."""
    from jaxspec.drafters.registry import method as method_named

    if meta.get("method") != method:
        raise JaxspecError(
            f"{path} holds a {meta.get('method')!r} drafter, not {method!r}; pass a {method} "
            "drafter folder"
        )
    cls = method_named(method).settings_class()
    raw = dict(meta["settings"])
    inline = {name: np.asarray(raw.pop(name)) for name in cls.DATA if name in raw}
    return cls.from_json(raw, str(Path(path) / META)), inline


def check_weights(drafter, base_params, params, path: Path) -> None:
    """The stored tensors are exactly those `drafter.init` makes, in its shapes; else one
    error listing what is missing, unexpected or misshapen."""
    from jaxspec.checkpoint import flatten_params, shape_problems, unflatten_params

    def init(params):  # from the model's weights in stored [in,out] layout, as training saw
        n_layers = len(params["layers"])
        return drafter.init(unflatten_params(flatten_params(params), n_layers), jax.random.key(0))

    problems = shape_problems(_shapes(jax.eval_shape(init, base_params)), _shapes(params), 6)
    if problems:
        raise JaxspecError(
            f"drafter weights {path / WEIGHTS} do not fit its settings and this model: "
            f"{problems}; retrain the drafter"
        )


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape (of arrays or abstract ShapeDtypeStructs)."""
    return flatten(tree, leaf=lambda x: tuple(x.shape))


def check_drafter(path: Path, method: str, base: LlamaConfig, fix: str = ""):
    """A drafter folder's drafter.json, read and checked to hold a `method` drafter for a
    model of `base`'s shapes (before its weights are read) -> (meta, settings, inline data);
    fix: what the error for another model's drafter tells to do."""
    meta = read_meta(Path(path) / META)
    settings, data = _settings(meta, path, method)
    have = meta.get("base_model", {})
    want, shape_keys = base_model_sizes(base), ("vocab_size", "dim", "n_layers")
    if any(want[k] != have.get(k) for k in shape_keys):
        raise JaxspecError(
            f"drafter {path} was trained for {have.get('name')!r} "
            f"({', '.join(f'{k}={have.get(k)}' for k in shape_keys)}), not for {base.name!r}; "
            + (fix or f"train one for this model with `jaxspec-train {method} --model ...`")
        )
    return meta, settings, data


def load_drafter(path: Path, method: str, base: LlamaConfig, dtype=jnp.float32) -> StoredDrafter:
    """Clear errors for missing, corrupt or mismatched drafters."""
    path = Path(path)
    if not (path / META).is_file() or not (path / WEIGHTS).is_file():
        raise JaxspecError(
            f"no drafter at {path} (needs {META} and {WEIGHTS}); train one with "
            f"`jaxspec-train {method}` or pass a drafter folder as {option('drafter')}"
        )
    meta, settings, data = check_drafter(path, method, base)
    flat = {k: jnp.asarray(v, dtype) for k, v in _read(path / WEIGHTS, "weights").items()}
    try:
        params = unflatten(flat)
    except ValueError as e:
        raise JaxspecError(
            f"corrupt drafter weights {path / WEIGHTS} ({e}); retrain the drafter"
        ) from None
    if (path / DATA).is_file():
        data.update(_read(path / DATA, "data"))
    return StoredDrafter(settings, params, data)


def base_weights(path: Path) -> str | None:
    """The fingerprint (jaxspec.fingerprint) of the weights the drafter at `path` was
    trained for; None where its drafter.json predates it."""
    weights = read_meta(Path(path) / META).get("base_model", {}).get("weights")
    return weights if isinstance(weights, str) else None


def _read(file: Path, what: str) -> dict[str, np.ndarray]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise JaxspecError(f"corrupt drafter {what} {file} ({e}); retrain the drafter") from None
