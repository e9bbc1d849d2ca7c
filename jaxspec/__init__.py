"""jaxspec: lossless speculative decoding of Llama-family models in JAX.

    import jaxspec
    model = jaxspec.load_model()                    # the default model, or a path
    gen = jaxspec.Generator(model, method="firp")   # its shipped drafter and tree
    print(gen.generate("Explain KV caches.", max_new_tokens=64).text)

Names are imported on first use, so `import jaxspec` stays light.
"""

from __future__ import annotations

import importlib

from jaxspec.drafters.registry import METHODS

# public name -> module that defines it
_EXPORTS = {
    "load_model": "jaxspec.models",
    "LoadedModel": "jaxspec.models",
    "load_drafter": "jaxspec.api",
    "Generator": "jaxspec.api",
    "GenerationResult": "jaxspec.generate",
    "TreeSpec": "jaxspec.tree",
    "DynamicTree": "jaxspec.tree",
    "Sampling": "jaxspec.sampling",
    "JaxspecError": "jaxspec.errors",
}

__all__ = ["METHODS", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
