"""The calibration of path-independent guesses for dynamic trees (train/calibration.py)."""

from __future__ import annotations

import numpy as np

from train.calibration import fit_calibration, fit_depth


def bernoulli(lp, slope, shift, rng):
    return rng.random(lp.shape) < np.exp(np.minimum(0.0, slope * lp + shift))


def test_fit_recovers_the_outcomes_law():
    rng = np.random.default_rng(0)
    lp = np.log(rng.uniform(0.01, 1.0, 40_000))
    slope, shift = fit_depth(lp, bernoulli(lp, 0.7, -0.5, rng))
    assert abs(slope - 0.7) <= 0.1 and abs(shift + 0.5) <= 0.15


def test_depth_is_fitted_where_its_parent_can_be_in_a_tree():
    """Depth 2's guesses are right only where depth 1's greedy token was among the guesses:
    the fit counts those positions, not the ones whose parent no tree holds."""
    rng = np.random.default_rng(1)
    N, w = 20_000, 4
    lp = np.log(rng.uniform(0.02, 1.0, (N, 2, w)))
    found = rng.random(N) < 0.5
    hit = np.zeros((N, 2, w), bool)
    hit[found, 0, 0] = True
    hit[found, 1] = bernoulli(lp[found, 1], 1.0, 0.0, rng)  # right with probability p
    (_, _), (slope, shift) = fit_calibration(lp, hit)
    assert abs(slope - 1.0) <= 0.1 and abs(shift) <= 0.15  # over all rows: shift ~ log 0.5


def test_a_depth_is_fitted_where_every_earlier_depth_was_found():
    """Depth 2's guess can be right only where depths 0 and 1 both were found; depth 1 is
    found on its own half the time: the fit counts the rows where both were, not those
    where depth 1 alone was (nor where depth 2 itself was found)."""
    rng = np.random.default_rng(2)
    N, w = 20_000, 2
    lp = np.log(rng.uniform(0.02, 1.0, (N, 3, w)))
    hit = np.zeros((N, 3, w), bool)
    hit[:, 0, 0] = rng.random(N) < 0.5
    hit[:, 1, 0] = rng.random(N) < 0.5  # whatever depth 0 did
    both = hit[:, 0, 0] & hit[:, 1, 0]
    hit[both, 2] = bernoulli(lp[both, 2], 1.0, 0.0, rng)  # right with probability p
    *_, (slope, shift) = fit_calibration(lp, hit)
    assert abs(slope - 1.0) <= 0.1 and abs(shift) <= 0.15


def test_a_depth_never_reached_keeps_the_heads_probabilities():
    """Depth 0 never finds the greedy token, so depth 1 has no evidence: q = p there."""
    lp = np.log(np.full((4, 2, 1), 0.5))
    hit = np.zeros((4, 2, 1), bool)
    assert fit_calibration(lp, hit)[1] == (1.0, 0.0)
    assert fit_depth(np.array([]), np.array([], bool)) == (1.0, 0.0)
