"""The front door: a `Generator` turns a loaded model and a method into text.

    model = jaxspec.load_model()
    gen = jaxspec.Generator(model, method="firp")
    out = gen.generate("Explain KV caches.", max_new_tokens=64)

A prompt is text (the chat template applied, as the CLI does; `chat=False` to encode it
as is) or a list of token ids (used as given); a list of prompts is a batch. Sampling
settings are per call; each distinct setting compiles its programs once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

from jaxspec.drafters import registry
from jaxspec.errors import JaxspecError, given_path, is_whole, option
from jaxspec.generate import GenerationResult, cache_len, checked_new_tokens
from jaxspec.methods import build_generator, chosen_drafter_folder
from jaxspec.models import LoadedModel
from jaxspec.sampling import Sampling, check_seed
from jaxspec.text import TextStream, encode_prompt
from jaxspec.tree import DynamicTree, TreeSpec

Prompt = str | list[int]


class Generator:
    """Speculative (or plain, method="ar") generation with one method's drafter.

    drafter: a drafter folder (None: the one shipped for the model); tree: a tree preset or
    one the drafter ships, by name, or a TreeSpec (DynamicTree) built by hand (None: the
    method's default for this backend); max_len: the most positions a prompt and its
    answer may take (None: the model's context); products: how
    bfloat16 weights multiply, "exact", "plain-prefill" or "plain" (jaxspec.decode.PRODUCTS;
    None: the backend's default, plain-prefill on a GPU, else exact). ppd_k / ppd_layer,
    firp_chains, sdsat_loop and retrieval (medusa, firp, chimera and eagle with a dynamic tree:
    that many of lookup's continuations join its candidates, scored by the higher of their
    own confidence and the drafter's) are those methods' options
    (see `jaxspec-generate --help`). PPD pipelines over ppd_k + 1 devices; with fewer (a CPU
    process has one unless XLA_FLAGS=--xla_force_host_platform_device_count=4 is set before
    jax starts; `import jaxspec` does not start it) its sub-processes share them: the same
    tokens, without the parallel speedup, and a warning says so. A PPD step is one token:
    its tokens per step are always 1. Threads may share one Generator (a server's workers):
    each setting's programs are compiled once, by the first thread that needs them."""

    def __init__(
        self,
        model: LoadedModel,
        method: str = "ar",
        *,
        drafter: str | Path | None = None,
        tree: str | TreeSpec | DynamicTree | None = None,
        max_len: int | None = None,
        products: str | None = None,
        chat: bool = True,
        ppd_k: int | None = None,
        ppd_layer: int | None = None,
        firp_chains: int | None = None,
        sdsat_loop: str | None = None,
        retrieval: int | None = None,
    ):
        _checked_model(model)
        registry.method(method)
        if not isinstance(chat, bool):
            raise JaxspecError(f"chat must be True or False, got {chat!r}")
        self.model, self.method, self.chat = model, method, chat
        self._options = dict(
            drafter_dir=drafter, tree=tree,
            max_len=max_len, products=products, ppd_k=ppd_k, ppd_layer=ppd_layer,
            firp_chains=firp_chains, sdsat_loop=sdsat_loop, retrieval=retrieval,
        )  # fmt: skip
        self._built: dict[Sampling, object] = {}
        self._building = threading.Lock()  # one decoder per setting, whichever thread asks
        self._decoder(Sampling())  # a bad drafter, tree or option fails here, not later

    def _decoder(self, sampling: Sampling):
        if sampling.typical and self.method == "ar":  # (a bench's ar row samples plainly)
            raise JaxspecError(
                f"{option('typical')} accepts drafted tokens, and method 'ar' drafts none: pick a "
                "method that drafts, or drop it"
            )
        with self._building:
            if sampling not in self._built:
                self._built[sampling] = build_generator(
                    self.model, self.method, sampling=sampling, **self._options
                )
            return self._built[sampling]

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text through the tokenizer (and chat template), ids as given."""
        if isinstance(prompt, str):
            if self.model.tokenizer is None:
                raise JaxspecError(
                    f"the model at {self.model.path} has no tokenizer: pass token ids"
                )
            return encode_prompt(self.model.tokenizer, prompt, chat=self.chat)
        if not isinstance(prompt, (list, tuple)):
            raise JaxspecError(
                f"a prompt is a str or a list of token ids, got {type(prompt).__name__}"
            )
        odd = [t for t in prompt if not is_whole(t)]
        if odd:
            raise JaxspecError(
                f"a prompt's token ids are integers, got {odd[0]!r} ({type(odd[0]).__name__}); "
                "pass ints (an array's .tolist() gives them)"
            )
        bad = [t for t in prompt if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise JaxspecError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.model.cfg.vocab_size - 1})"
            )
        return [int(t) for t in prompt]

    def _decode_text(self, ids: list[int]) -> str:
        if self.model.tokenizer is None:
            return ""
        return self.model.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        typical: bool = False,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt -> its result; a list of prompts -> one result each, decoded together
        as a batch (greedy results equal one-at-a-time ones). typical: Medusa's typical
        acceptance, NOT lossless (see `Sampling`)."""
        batch = _is_batch(prompts)
        ids = [self.encode(p) for p in (prompts if batch else [prompts])]
        decoder = self._decoder(Sampling(temperature, top_k, top_p, typical))
        max_new_tokens = checked_new_tokens(max_new_tokens)
        results = [
            dataclasses.replace(r, text=self._decode_text(r.token_ids))
            for r in decoder.generate_batch(ids, max_new_tokens, seed)
        ]
        return results if batch else results[0]

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        typical: bool = False,
    ) -> Stream:
        """The generated text, piece by piece as the steps accept tokens; the stream's
        `result` holds the whole GenerationResult once it is exhausted."""
        if _is_batch(prompt):
            raise JaxspecError("stream takes one prompt; use generate for a batch")
        if self.model.tokenizer is None:
            raise JaxspecError(
                f"stream yields text and the model at {self.model.path} has no tokenizer; use "
                "generate (its token_ids), or a model folder with one"
            )
        ids = self.encode(prompt)
        decoder = self._decoder(Sampling(temperature, top_k, top_p, typical))
        max_new_tokens = checked_new_tokens(max_new_tokens)
        cache_len(len(ids), max_new_tokens, 0, decoder.max_len)  # checked before the thread starts
        return Stream(self, decoder, ids, max_new_tokens, check_seed(seed))


class Stream:
    """An iterator over text pieces while a background thread decodes; `result` is the
    GenerationResult (None until the last piece, and after a stop). Leaving early stops
    the decoding at its next step: `close()` (from any thread: one iterating the stream
    then gets no more pieces), the end of a `with` block, or dropping the stream (a
    `break` out of `for piece in gen.stream(...)`)."""

    def __init__(self, owner: Generator, decoder, ids: list[int], max_new_tokens: int, seed: int):
        self._shared = _Shared()
        self._pieces = _stream_pieces(owner, decoder, (ids, max_new_tokens, seed), self._shared)

    @property
    def result(self) -> GenerationResult | None:
        return self._shared.result

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stops the decoding (if it still runs); from the thread that iterates the stream
        (or none), also waits for the decoding thread to end."""
        self._shared.stop.set()
        with contextlib.suppress(ValueError):  # another thread is inside next(): it ends
            self._pieces.close()  # after the decoding's next step

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass
class _Shared:
    """What a Stream and its pieces share. The pieces hold it, not the Stream, so that a
    dropped Stream is freed at once and its decoding stopped."""

    result: GenerationResult | None = None
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)


class _Stopped(Exception):
    """Raised inside the decoding thread when its stream was closed."""


def _stream_pieces(owner: Generator, decoder, args: tuple, shared: _Shared) -> Iterator[str]:
    tokenizer = owner.model.tokenizer
    text = TextStream(tokenizer) if tokenizer is not None else None
    pieces: queue.Queue = queue.Queue()  # token id lists, then a result, an error or None

    def on_tokens(ids: list[int]) -> None:  # called by the decoding loop after each step
        if shared.stop.is_set():
            raise _Stopped
        pieces.put(ids)

    def run():
        try:
            pieces.put(decoder.generate(*args, on_tokens))
        except _Stopped:
            pieces.put(None)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            pieces.put(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while isinstance(item := pieces.get(), list):  # token ids as they are accepted
            piece = text.push(item) if text is not None else ""
            if piece:
                yield piece
    finally:  # the end, an error, or close(): the decoding stops before this returns
        shared.stop.set()
        thread.join()
    if isinstance(item, BaseException):
        raise item
    if item is not None:
        shared.result = dataclasses.replace(item, text=owner._decode_text(item.token_ids))


def _is_batch(prompts) -> bool:
    return isinstance(prompts, (list, tuple)) and any(
        isinstance(p, (str, list, tuple)) for p in prompts
    )


def load_drafter(model: LoadedModel, method: str, path: str | Path | None = None):
    """A drafter folder (None: the one shipped for the model) checked against the model:
    its settings, weights and data arrays (`jaxspec.drafters.store.StoredDrafter`)."""
    from jaxspec.drafters.store import load_drafter as load

    _checked_model(model)
    if not registry.method(method).drafter_folder:
        raise JaxspecError(f"method {method!r} has no drafter")
    folder = chosen_drafter_folder(model, method, given_path(path, "the drafter's path"))
    return load(folder, method, model.cfg)


def _checked_model(model) -> None:
    if not isinstance(model, LoadedModel):
        raise JaxspecError(
            f"expected a loaded model (model = jaxspec.load_model(PATH)), got "
            f"{type(model).__name__}"
        )
