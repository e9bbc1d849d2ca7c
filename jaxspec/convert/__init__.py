"""Load a model from any supported source and write it in jaxspec's or HF's format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxspec.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint
from jaxspec.convert.gguf import load_gguf
from jaxspec.convert.hf import load_hf_folder, load_tokenizer, save_hf_folder
from jaxspec.errors import JaxspecError
from jaxspec.models import checked_dtype
from jaxspec.outputs import check_output_dir


def load_any(src: Path, dtype=None):
    """(config, params as host arrays, tokenizer | None) from a .gguf, an HF folder or a
    jaxspec checkpoint; floating weights in `dtype`, each cast as it is read (None: as
    stored, a GGUF's dequantised to float32)."""
    src = Path(src)
    if not src.exists():
        raise JaxspecError(f"no such file or folder: {src}")
    if src.is_file():
        if src.suffix != ".gguf":
            raise JaxspecError(f"{src} is not a .gguf file; pass a .gguf or an HF model folder")
        return load_gguf(src, dtype or np.float32)
    if is_checkpoint(src):
        cfg, params = load_checkpoint(src, dtype, on_host=True)
        return cfg, params, load_tokenizer(src)
    return load_hf_folder(src, dtype)


def convert(
    src: Path, out: Path, to: str = "jaxspec", name: str | None = None, dtype: str | None = None
) -> None:
    """Convert src into out; `name` overrides the model name recorded in the config, `dtype`
    ("float32", "bfloat16"; None: as stored) the weights'. `out` may hold other files (the
    CLI asks for --overwrite then) but never src."""
    host_dtype = checked_dtype(dtype)
    check_output_dir(out, [src], overwrite=True)
    cfg, params, tokenizer = load_any(src, host_dtype)
    if name:
        cfg = dataclasses.replace(cfg, name=name)
    if to == "jaxspec":
        save_checkpoint(Path(out), cfg, params, tokenizer)
    elif to == "hf":
        save_hf_folder(Path(out), cfg, params, tokenizer)
    else:
        raise JaxspecError(f"unknown output format {to!r}; use 'jaxspec' or 'hf'")
