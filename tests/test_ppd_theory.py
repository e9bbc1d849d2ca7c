"""PPD's latency/compute model against hand-computed cases and a Monte-Carlo simulation."""

from __future__ import annotations

import pytest

from jaxspec.errors import JaxspecError
from jaxspec.ppd_theory import (
    compute_per_time_unit,
    compute_per_token,
    expected_compute,
    expected_latency,
    latency_per_token,
    simulate,
    trace_cost,
)


def test_a_trace_by_hand():
    # d=4, d̄=2, k=1; matches T,T,F,T: runs of 3 and 2 tokens.
    # latency (4 + 2*2) + (4 + 1*2) = 14; compute per run (2 + 1*2) X + 2: 14 + 10 = 24.
    assert trace_cost(4, 2, [True, True, False, True], 1) == (14.0, 24.0)
    assert trace_cost(4, 3, [False, False], 2) == (12.0, 12.0 + 3 * 2 * 1)  # no match: AR time


def test_theorem_4_1_by_hand():
    assert expected_latency(40, 20, 101, 0.5) == 4040 - 20 * 100 * 0.5
    assert expected_compute(40, 30, 11, 0.2, 3) == 440 - 10 * 10 * 0.2 + 3 * 10 * 11
    assert expected_latency(40, 40, 11, 0.9) == 440  # predicting at the last layer saves nothing


@pytest.mark.parametrize("d, d_bar, p, k", [(30, 15, 0.6, 3), (30, 20, 0.3, 1), (8, 7, 0.9, 5)])
def test_monte_carlo_agrees_with_the_theorem(d, d_bar, p, k):
    latency, compute = simulate(d, d_bar, 64, p, k, n=4000, seed=1)
    assert latency == pytest.approx(expected_latency(d, d_bar, 64, p), rel=0.01)
    assert compute == pytest.approx(expected_compute(d, d_bar, 64, p, k), rel=0.01)


def test_the_large_ell_forms_follow_from_the_theorem():
    d, p, k, ell = 40, 0.7, 3, 10**6
    assert expected_latency(d, d / 2, ell, p) / ell == pytest.approx(latency_per_token(d, p))
    per_unit = expected_compute(d, d / 2, ell, p, k) / expected_latency(d, d / 2, ell, p)
    assert per_unit == pytest.approx(compute_per_time_unit(k, p), rel=1e-5)
    assert compute_per_token(k, p) == pytest.approx(latency_per_token(1, p) * per_unit, rel=1e-5)


def test_a_layer_below_half_the_depth_is_refused():
    with pytest.raises(JaxspecError, match="d/2 <= d_bar <= d"):
        expected_latency(30, 10, 5, 0.5)
    with pytest.raises(JaxspecError, match="d/2 <= d_bar <= d"):  # the simulation's too
        trace_cost(30, 10, [True, False], 1)
