"""Lowering jaxspec's programs for an accelerator from any host (jax.export): proof, on a
CPU-only machine, that each compiled program of decoding and training is one that CUDA and
TPU builds of XLA accept, with nothing on it that only a CPU host runs."""

from __future__ import annotations

import re
from collections.abc import Callable

import jax

ACCELERATORS = ("cuda", "tpu")

# What a program for an accelerator must not hold: calls back into the Python host, and
# float64 (x64 is off in jaxspec; a float64 value would mean a host-side constant leaked).
HOST_ONLY = {
    "a host callback": re.compile(r"custom_call @\w*callback", re.IGNORECASE),
    "float64": re.compile(r"\bf64\b"),
}
SOURCE_LOCATIONS = re.compile(r"^#loc.*$|loc\([^\n]*\)", re.MULTILINE)  # names, not code


class NotPortable(Exception):
    """A program holds something only a CPU host runs (its message names it)."""


def export(program: Callable, args: tuple, static: dict, platform: str) -> jax.export.Exported:
    """`program` (a jax.jit function) lowered for `platform` with `args` (arrays or
    ShapeDtypeStructs) and its static keywords -> the exported program; NotPortable if it
    cannot be exported there or holds a host-only construct."""
    try:
        exported = jax.export.export(program, platforms=[platform])(*args, **static)
    except ValueError as e:  # e.g. custom calls (host callbacks) with no stable target
        raise NotPortable(f"cannot export for {platform}: {str(e).splitlines()[0]}") from None
    text = SOURCE_LOCATIONS.sub("", exported.mlir_module())
    for what, pattern in HOST_ONLY.items():
        if pattern.search(text):
            raise NotPortable(f"the {platform} program holds {what}")
    return exported


def export_all(programs: dict[str, tuple], platforms=ACCELERATORS) -> dict[str, dict]:
    """name: (program, args, static) -> name: platform: its exported program."""
    return {
        name: {p: export(program, args, static, p) for p in platforms}
        for name, (program, args, static) in programs.items()
    }
