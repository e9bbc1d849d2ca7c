"""PPD's latency/compute model (paper §4), in "time units" (one decoder layer's time).

Decoding ℓ tokens with d layers costs d·ℓ units. PPD predicts the next token's top-k at
layer d̄ (d̄ >= d/2) and starts k sub-processes on those candidates; when the final
prediction matches one (probability p, independently per token) the next token's first
d - d̄ layers are already done. Tokens come in runs of consecutive matches: a run of X
tokens takes T_X = d + (X - 1) d̄ units, k + 1 resources work during (d - d̄) X of them and
one during the rest. The number of runs is N = 1 + Bin(ℓ - 1, 1 - p).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxspec.errors import JaxspecError


def _check(d: int, d_bar: float) -> None:
    if not d / 2 <= d_bar <= d:
        raise JaxspecError(f"PPD's analysis needs d/2 <= d_bar <= d, got d={d}, d_bar={d_bar}")


def expected_latency(d: int, d_bar: float, ell: int, p: float) -> float:
    """Theorem 4.1: d ℓ - (d - d̄)(ℓ - 1) p time units for ℓ tokens."""
    _check(d, d_bar)
    return d * ell - (d - d_bar) * (ell - 1) * p


def expected_compute(d: int, d_bar: float, ell: int, p: float, k: int) -> float:
    """Theorem 4.1: d ℓ - (d - d̄)(ℓ - 1) p + k (d - d̄) ℓ resource-time units."""
    return expected_latency(d, d_bar, ell, p) + k * (d - d_bar) * ell


def latency_per_token(d: int, p: float) -> float:
    """Eq. 3 (d̄ = d/2, ℓ >> 1): d (1 - p/2)."""
    return d * (1 - p / 2)


def compute_per_time_unit(k: int, p: float) -> float:
    """Eq. 5 (d̄ = d/2, ℓ >> 1): resources busy on average, (k + 2 - p) / (2 - p)."""
    return (k + 2 - p) / (2 - p)


def compute_per_token(k: int, p: float) -> float:
    """Eq. 6 (d̄ = d/2): resource-time per token in units of one plain forward, (2+k-p)/2."""
    return (2 + k - p) / 2


def trace_cost(d: int, d_bar: float, matches: Sequence[bool], k: int) -> tuple[float, float]:
    """The time-unit simulation of one generation: matches[i] says whether token i+1's
    final prediction was among token i's early top-k (ℓ = len(matches) + 1 tokens) ->
    (latency, compute) in time units."""
    _check(d, d_bar)
    runs, run = [], 1
    for matched in matches:
        if matched:
            run += 1
        else:
            runs.append(run)
            run = 1
    runs.append(run)
    latency = sum(d + (x - 1) * d_bar for x in runs)
    compute = sum((d_bar + k * (d - d_bar)) * x + (d - d_bar) for x in runs)
    return float(latency), float(compute)


def simulate(d: int, d_bar: float, ell: int, p: float, k: int, n: int, seed: int = 0):
    """Monte-Carlo mean (latency, compute) over n generations with independent matches."""
    rng = np.random.default_rng(seed)
    costs = [trace_cost(d, d_bar, rng.random(ell - 1) < p, k) for _ in range(n)]
    return tuple(float(x) for x in np.mean(costs, axis=0))
