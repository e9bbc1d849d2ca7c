"""Hugging Face folders (config.json + safetensors, sharded or not) in and out."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxspec.checkpoint import flatten_params
from jaxspec.config import LlamaConfig, plain_name
from jaxspec.convert.keys import params_from_hf, params_to_hf
from jaxspec.errors import JaxspecError


def read_hf_config(folder: Path) -> LlamaConfig:
    """config.json, with the end-of-sequence ids of generation_config.json added (Llama 3.x
    instruct models stop at several: <|eot_id|> and <|eom_id|> as well as the config's)."""
    file = folder / "config.json"
    if not file.is_file():
        raise JaxspecError(f"{folder} has no config.json; pass an HF model folder or a .gguf file")
    try:
        raw = json.loads(file.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
        cfg = LlamaConfig.from_hf_config(raw)
    except (ValueError, KeyError) as e:
        raise JaxspecError(
            f"cannot read {file} ({type(e).__name__}: {e}); fix it or download it again"
        ) from None
    if cfg.name == cfg.family:  # config.json names no model: the folder does
        cfg = dataclasses.replace(cfg, name=folder_model_name(folder) or cfg.family)
    generation = folder / "generation_config.json"
    if not generation.is_file():
        return cfg
    try:
        settings = json.loads(generation.read_text())
        eos = settings.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        extra = tuple(int(i) for i in eos if i not in cfg.eos_token_ids)
    except (ValueError, TypeError, AttributeError) as e:
        raise JaxspecError(
            f"cannot read {generation}: {e!r}; fix or remove it (it adds stop tokens)"
        ) from None
    return dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + extra)


def folder_model_name(folder: Path) -> str:
    """The model name an HF folder's path gives: the folder's name, or for a Hub cache
    snapshot (models--ORG--NAME/snapshots/REVISION) NAME."""
    folder = folder.resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return plain_name(folder.parent.parent.name.split("--")[-1])
    return plain_name(folder.name)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise JaxspecError(
                f"{folder} is missing shards listed in its index: {', '.join(absent)}"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise JaxspecError(
            f"{folder} has no *.safetensors weights (PyTorch .bin files are not supported; "
            "re-save the model with safe_serialization=True)"
        )
    return files


def read_safetensors(files: list[Path], dtype=None) -> dict[str, np.ndarray]:
    """Every tensor of `files` as a host array, cast to `dtype` as it is read (None: as
    stored)."""
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:  # host arrays, no device
                for key in f.keys():  # noqa: SIM118 (not a dict)
                    tensors[key] = np.asarray(f.get_tensor(key), dtype)
        except (SafetensorError, OSError) as e:
            raise JaxspecError(f"corrupt safetensors file {file}: {e}; download it again") from None
    return tensors


def load_hf_folder(folder: Path, dtype=None) -> tuple[LlamaConfig, dict, object]:
    cfg = read_hf_config(folder)
    tensors = read_safetensors(safetensors_files(folder), dtype)
    params = params_from_hf(tensors, cfg, str(folder))
    return cfg, params, load_tokenizer(folder)


# Tokenizer classes that are tokenizer.json as it is: AutoTokenizer would substitute the
# model type's own class (Qwen2Tokenizer for a qwen2 folder), which rebuilds it otherwise.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: Path):
    """The folder's tokenizer (with its chat template), or None when it has none; one that
    cannot be read is a one-line error naming the folder."""
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        settings = folder / "tokenizer_config.json"
        named = (
            json.loads(settings.read_text()).get("tokenizer_class") if settings.is_file() else None
        )
        if named in _GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        return AutoTokenizer.from_pretrained(str(folder))
    except (ImportError, MemoryError):
        raise
    except Exception as e:  # the tokenizers library raises plain Exceptions for bad files
        why = (str(e).splitlines() or [""])[0][:200]
        raise JaxspecError(
            f"cannot read the tokenizer in {folder} ({type(e).__name__}: {why}); if its files "
            "are damaged, download or convert the model again"
        ) from e


def save_hf_folder(out: Path, cfg: LlamaConfig, params: dict, tokenizer=None) -> None:
    """Write config.json + model.safetensors that transformers loads (the family's class)."""
    out.mkdir(parents=True, exist_ok=True)
    flat = {k: np.asarray(v) for k, v in flatten_params(params).items()}
    save_file(params_to_hf(flat, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
