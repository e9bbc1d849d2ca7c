"""What the command-line tools share: loading a model (the default one on first use)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from checkpoints_convert.default_model import ensure_default_model
from checkpoints_convert.hf import load_tokenizer
from jaxspec.checkpoint import load_checkpoint
from jaxspec.config import LlamaConfig

METHODS = ("ar",)  # grows as drafters land: medusa, firp, chimera, sdsat, ppd


@dataclasses.dataclass
class LoadedModel:
    path: Path
    cfg: LlamaConfig
    params: dict
    tokenizer: object


def load_model(path: Path | None = None) -> LoadedModel:
    """A jaxspec checkpoint folder; None means the default model (converted on first use)."""
    path = Path(path) if path else ensure_default_model()
    cfg, params = load_checkpoint(path)
    return LoadedModel(path, cfg, params, load_tokenizer(path))


def check_method(method: str) -> None:
    from jaxspec.errors import JaxspecError

    if method not in METHODS:
        raise JaxspecError(
            f"unknown or not yet available method {method!r}; available: {', '.join(METHODS)}"
        )
