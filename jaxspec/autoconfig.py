"""The fastest lossless configuration of this machine: the weight dtype, method and tree that
decode the model fastest here, found by a short one-off measurement rather than from CPU
flags, and cached under $JAXSPEC_HOME/autoconfig, keyed by what makes it valid (the model,
jax, the backend and device, the CPU model, the shipped drafters' files).

    choice = best_configuration()        # measures once, then reads the cache
    choice.best.label, choice.speedup    # e.g. "bfloat16 firp@chain-1", over the fastest AR

Candidates: AR and each shipped drafter's method with its default tree, in float32 and
bfloat16 on CPU (bfloat16 only on accelerators). They decode the same fixed prompts
greedily, interleaved (round-robin over the prompts) so that drift in the machine's speed
hits all alike; a candidate counts only if its tokens equal AR's in its dtype.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import operator
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxspec.api import Generator
from jaxspec.checkpoint import CONFIG_FILE, is_checkpoint, jaxspec_home
from jaxspec.config import LlamaConfig
from jaxspec.drafters.registry import REGISTRY
from jaxspec.drafters.store import DATA, META, WEIGHTS, read_settings
from jaxspec.errors import JaxspecError, given_path
from jaxspec.generate import GenerationResult
from jaxspec.methods import DRAFTERS_DIR, default_tree
from jaxspec.models import load_model
from jaxspec.outputs import write_text

# The methods that verify a draft tree (PPD, pipelined over k + 1 devices, is left out).
METHODS = tuple(name for name, m in REGISTRY.items() if m.tree)
PROMPTS = (
    "Explain what a KV cache is.",
    "Write a Python function that reverses a string.",
    "List three facts about the Moon.",
)
NEW_TOKENS = 48
WARM_UP_TOKENS = 8  # compiles each candidate's programs before anything is timed


@dataclasses.dataclass(frozen=True)
class Row:
    """A candidate configuration and what it measured; error: why it could not run."""

    dtype: str
    method: str
    tree: str | None = None  # None for AR
    tokens_per_s: float = 0.0
    mean_accepted: float = 0.0
    lossless: bool = False  # its tokens equal AR's in its dtype on every prompt
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.dtype} {self.method}" + (f"@{self.tree}" if self.tree else "")


@dataclasses.dataclass(frozen=True)
class Choice:
    best: Row  # the fastest lossless configuration
    fastest_ar: Row  # the faster of AR in float32 and in bfloat16
    table: tuple[Row, ...]  # every candidate
    date: str  # when it was measured
    measured_s: float
    path: Path  # the cache file
    cached: bool  # read from the cache rather than measured now

    @property
    def speedup(self) -> float:
        return self.best.tokens_per_s / self.fastest_ar.tokens_per_s


def best_configuration(
    model_src: str | Path | None = None,
    remeasure: bool = False,
    progress: Callable[[str], None] = print,
    drafters: Path = DRAFTERS_DIR,
) -> Choice:
    """The fastest lossless configuration of a jaxspec checkpoint (None: the default model)
    on this machine, with the drafters in drafters/<model name>/<method>: from the cache,
    else (or with remeasure) measured now and cached."""
    from jaxspec.convert.default_model import ensure_default_model

    model_dir = given_path(model_src, "the model's path") or ensure_default_model()
    name = model_name(model_dir)
    folder = Path(drafters) / name
    key = cache_key(model_dir, name, folder)
    path = cache_path(key)
    if not remeasure and (choice := read_cache(path, key, progress)):
        return choice
    start = time.perf_counter()
    rows = candidates(folder)
    progress(f"measuring {len(rows)} configurations of {name} on this machine (once) ...")
    table = measure(rows, model_dir, folder, progress)
    best, _ = choose(table)
    record = {
        "key": key,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "measured_s": round(time.perf_counter() - start, 1),
        "choice": {"dtype": best.dtype, "method": best.method, "tree": best.tree},
        "candidates": [dataclasses.asdict(row) for row in table],
    }
    write_text(path, json.dumps(record, indent=2) + "\n")
    return from_record(record, path, cached=False)


def model_name(model_dir: Path) -> str:
    if not is_checkpoint(model_dir):
        raise JaxspecError(
            f"no jaxspec checkpoint at {model_dir}; the configuration is measured for one "
            "(`jaxspec-convert SRC --out DIR` makes one)"
        )
    return LlamaConfig.load(model_dir / CONFIG_FILE).folder_name


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as /proc/cpuinfo gives it, else as the platform reports it."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def drafter_identity(folder: Path) -> dict:
    """A drafter's files' sizes and mtimes, which retraining, editing or touching changes."""
    files = [folder / META, folder / WEIGHTS, folder / DATA]
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()}


def cache_key(model_dir: Path, name: str, drafters: Path) -> dict:
    """What a measured choice holds for: change any of it and it is measured again."""
    return {
        "model": name,
        "model_dir": str(Path(model_dir).resolve()),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "cpu": cpu_model(),
        "drafters": {m: drafter_identity(drafters / m) for m in METHODS if (drafters / m).is_dir()},
        "protocol": {"prompts": list(PROMPTS), "new_tokens": NEW_TOKENS},
    }


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^\w.-]", "_", key["model"])
    return jaxspec_home() / "autoconfig" / f"{name}-{digest}.json"


def read_cache(path: Path, key: dict, progress: Callable[[str], None]) -> Choice | None:
    """The cached choice for `key`; None when there is none or it is damaged."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if record["key"] == key:
            return from_record(record, path, cached=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, JaxspecError):
        progress(f"the cached configuration {path} is damaged; measuring again")
    return None


def from_record(record: dict, path: Path, cached: bool) -> Choice:
    table = tuple(Row(**row) for row in record["candidates"])
    best, fastest_ar = choose(table)
    return Choice(best, fastest_ar, table, record["date"], record["measured_s"], path, cached)


def choose(table: tuple[Row, ...] | list[Row]) -> tuple[Row, Row]:
    """(the fastest lossless row, the fastest AR row)."""
    lossless = [row for row in table if row.lossless]
    if not lossless:
        errors = "; ".join(f"{row.label}: {row.error}" for row in table if row.error)
        raise JaxspecError(f"no configuration could be measured here ({errors or 'none'})")
    ars = [row for row in lossless if row.method == "ar"]
    speed = operator.attrgetter("tokens_per_s")
    return max(lossless, key=speed), max(ars, key=speed)


def candidates(drafters: Path) -> list[Row]:
    """AR and each drafter's method with its default tree here, in each dtype worth trying:
    float32 and bfloat16 on CPU, bfloat16 on accelerators."""
    dtypes = ("float32", "bfloat16") if jax.default_backend() == "cpu" else ("bfloat16",)
    configs = [("ar", None)] + [
        (m, _default_tree(drafters / m, m)) for m in METHODS if (drafters / m / META).is_file()
    ]
    return [Row(dtype, method, tree) for method, tree in configs for dtype in dtypes]


def _default_tree(folder: Path, method: str) -> str | None:
    try:
        return default_tree(read_settings(folder, method)[0])
    except JaxspecError:  # building its Generator fails with the reason, recorded then
        return None


def measure(rows: list[Row], model_dir: Path, drafters: Path, progress) -> list[Row]:
    """Each row measured: compiled and warmed, then the prompts decoded round-robin."""
    generators, failed = _build(rows, model_dir, drafters)
    results = _round_robin(generators)
    reference = {row.dtype: _tokens(results[row]) for row in results if row.method == "ar"}
    table = [
        dataclasses.replace(row, error=failed[row])
        if row in failed
        else _score(row, results[row], reference.get(row.dtype))
        for row in rows
    ]
    for row in table:
        progress(_describe(row))
    return table


def _build(rows: list[Row], model_dir: Path, drafters: Path) -> tuple[dict, dict]:
    """({row: its warmed Generator}, {row: why it could not be built})."""
    dtypes = dict.fromkeys(row.dtype for row in rows)
    models = {dtype: load_model(model_dir, dtype=dtype) for dtype in dtypes}
    generators, failed = {}, {}
    for row in rows:
        try:
            generators[row] = _warm_generator(models[row.dtype], row, drafters)
        except Exception as e:  # noqa: BLE001 - a candidate that fails is reported, not fatal
            failed[row] = str(e) if isinstance(e, JaxspecError) else f"{type(e).__name__}: {e}"
    return generators, failed


def _round_robin(generators: dict) -> dict[Row, list[GenerationResult]]:
    """Every prompt through every generator in turn, the order reversed on every other
    prompt, so that drift in the machine's speed hits all alike."""
    results = {row: [] for row in generators}
    for i, prompt in enumerate(PROMPTS):
        for row in list(generators)[:: 1 if i % 2 == 0 else -1]:
            results[row].append(generators[row].generate(prompt, NEW_TOKENS))
    return results


def _warm_generator(model, row: Row, drafters: Path) -> Generator:
    drafter = drafters / row.method if row.method != "ar" else None
    generator = Generator(model, row.method, drafter=drafter, tree=row.tree)
    generator.generate(PROMPTS[0], WARM_UP_TOKENS)
    return generator


def _tokens(results: list[GenerationResult]) -> list[list[int]]:
    return [r.token_ids for r in results]


def _score(row: Row, results: list[GenerationResult], reference) -> Row:
    """Tokens per second over all prompts (compilation excluded), tokens per step, and
    whether its tokens equal AR's in its dtype."""
    tokens = sum(r.new_tokens for r in results)
    seconds = sum(r.prefill_s + r.decode_s for r in results)
    return dataclasses.replace(
        row,
        tokens_per_s=round(tokens / seconds, 2),
        mean_accepted=round(tokens / sum(r.steps for r in results), 3),
        lossless=_tokens(results) == reference,
    )


def _describe(row: Row) -> str:
    if row.error:
        error = row.error if len(row.error) <= 150 else row.error[:150] + " ..."
        return f"  {row.label}: could not run ({error})"
    excluded = "" if row.lossless else " (tokens differ from AR's: excluded)"
    return (
        f"  {row.label}: {row.tokens_per_s:.1f} tokens/s, "
        f"{row.mean_accepted:.2f} tokens/step{excluded}"
    )
