"""Shared pieces of generation: shape buckets and the result record. The generation loop
itself is `jaxspec.decode.SpeculativeGenerator`; plain AR decoding is its empty tree."""

from __future__ import annotations

import dataclasses

from jaxspec.errors import JaxspecError, is_whole, option

MIN_PROMPT_BUCKET = 16
MIN_CACHE_LEN = 128


def bucket(n: int, minimum: int) -> int:
    """Smallest size >= max(n, minimum) on the ladder 16, 24, 32, 48, 64, 96, ... (2^k and
    1.5 * 2^k): at most a third of a bucket is padding, and few shapes ever compile."""
    n = max(n, minimum)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 and power >= 8 else power


def checked_max_len(max_len: int | None, max_position: int) -> int:
    """The positions a prompt and its answer may take: `max_len`, else the model's context
    `max_position`; a limit past that context (positions the model was never trained on) is
    a clear error."""
    if max_len is None:
        return max_position
    if not is_whole(max_len) or not 1 <= max_len <= max_position:
        raise JaxspecError(
            f"{option('max_len')} must be an integer from 1 to the model's context of "
            f"{max_position} positions (or left out), got {max_len!r}"
        )
    return int(max_len)


def checked_new_tokens(max_new_tokens) -> int:
    """max_new_tokens as a Python int (numpy's taken), else a one-line error."""
    if not is_whole(max_new_tokens) or max_new_tokens < 1:
        raise JaxspecError(
            f"{option('max_new_tokens')} must be an integer >= 1, got {max_new_tokens!r}"
        )
    return int(max_new_tokens)


def cache_len(prompt_len: int, max_new_tokens: int, extra: int, max_len: int) -> int:
    """The cache length for a request whose steps may write `extra` slots past its last
    kept token; clear errors for empty prompts, no new tokens, and requests whose tokens do
    not fit in `max_len` positions. The slots written ahead hold no token that is kept, so
    they may lie past `max_len`: a request may use the model's whole context."""
    if prompt_len == 0:
        raise JaxspecError("empty prompt: pass some text (or token ids) to generate from")
    kept = prompt_len + checked_new_tokens(max_new_tokens)
    if kept > max_len:
        raise JaxspecError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens need {kept} positions, "
            f"which exceeds the limit of {max_len} positions; shorten the prompt, lower "
            f"{option('max_new_tokens')}, or raise a {option('max_len')} set below the model's "
            "context"
        )
    return min(bucket(kept + extra, MIN_CACHE_LEN), max_len + extra)


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only, EOS included when reached
    steps: int  # forward passes that produced tokens (prefill included)
    prefill_s: float
    decode_s: float
    compile_s: float  # compilation done for this call (0 once warm)
    text: str = ""  # the new tokens decoded (filled by jaxspec.Generator)
    # Per verify step (the prefill is none), how many drafted tokens it accepted: the step
    # emitted that many + 1, before EOS or max_new_tokens cut the last one. AR: all 0.
    accepted: list[int] = dataclasses.field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)
