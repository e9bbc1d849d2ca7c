"""Compiled programs kept on disk (jax's persistent compilation cache), for the device
campaign and for training where compiles are slow (`compiles_are_slow`).

On a GPU a program takes tens of seconds to compile. Within one process jax already
reuses a program it has compiled (AR's, in every group of the end-to-end part); the cache
keeps them for the next process: a later call on the same machine (a warm device machine
keeps its disk between calls) loads them instead of compiling again (a resumed training
run: its step and its evaluation's decoding programs)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import jax

from jaxspec.checkpoint import jaxspec_home

REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
HITS = "/jax/compilation_cache/cache_hits"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"
SETTINGS = {  # every program is kept, however quick its compile
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


def compiles_are_slow() -> bool:
    """Whether programs compile slowly on this backend (an accelerator, against a CPU): work
    over prompts of many lengths then pads them to one program shape instead of compiling
    one per bucket, and training keeps its compiled programs on disk."""
    return jax.default_backend() != "cpu"


def default_dir() -> Path:
    return jaxspec_home() / "xla-cache"


@contextlib.contextmanager
def compile_cache(folder: Path | None) -> Iterator[dict]:
    """Compile through a cache in `folder` (None: none) for the block -> yields
    {"dir", "requests", "hits", "saved_s"}, counted as the block compiles (hits: programs
    loaded instead of compiled). jax decides once per process whether it uses a cache, at
    its first compile: enter this before anything compiles (the device campaign's command
    does; where a compile came first, requests stay 0)."""
    stats = {"dir": None if folder is None else str(folder), "requests": 0, "hits": 0,
             "saved_s": 0.0}  # fmt: skip
    if folder is None:
        yield stats
        return
    folder.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()  # rows compile side by side in threads

    def on_event(event: str, **kwargs) -> None:
        key = {REQUESTS: "requests", HITS: "hits"}.get(event)
        if key:
            with lock:
                stats[key] += 1

    def on_duration(event: str, seconds: float, **kwargs) -> None:
        if event == SAVED:
            with lock:
                stats["saved_s"] = round(stats["saved_s"] + seconds, 2)

    names = ("jax_compilation_cache_dir", *SETTINGS)
    before = {name: getattr(jax.config, name) for name in names}
    for name, value in {"jax_compilation_cache_dir": str(folder), **SETTINGS}.items():
        jax.config.update(name, value)
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield stats
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)
        for name, value in before.items():
            jax.config.update(name, value)
