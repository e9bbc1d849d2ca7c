"""Shared pieces of generation: shape buckets and the result record. The generation loop
itself is `jaxspec.decode.SpeculativeGenerator`; plain AR decoding is its empty tree."""

from __future__ import annotations

import dataclasses

MIN_PROMPT_BUCKET = 16
MIN_CACHE_LEN = 128


def bucket(n: int, minimum: int) -> int:
    """Smallest size >= max(n, minimum) on the ladder 16, 24, 32, 48, 64, 96, ... (2^k and
    1.5 * 2^k): at most a third of a bucket is padding, and few shapes ever compile."""
    n = max(n, minimum)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 and power >= 8 else power


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only, EOS included when reached
    steps: int  # forward passes that produced tokens (prefill included)
    prefill_s: float
    decode_s: float
    compile_s: float  # compilation done for this call (0 once warm)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)
