"""Calibration of path-independent guesses (Medusa heads) for dynamic trees.

A dynamic tree keeps the nodes whose path probability is highest; that is the expected
number of accepted tokens only if each factor estimates P(guess right | its parent right).
A head that guesses without seeing the path before it is far from that: on held-out answers
its top guesses at probability ~0.9 are right 28% of the time at depth 2 and 7% at depth 4,
so raw products send the tree too deep. Per depth d we fit (slope, shift) so that
q = exp(min(0, slope * log p + shift)) (topology.calibrated) is the probability that a
guess of probability p is the model's greedy token, over the positions where every earlier
depth's greedy token is among its head's top-`width` guesses (where the guess can have a
parent in a tree). Maximum likelihood of the Bernoulli outcomes, on a grid.
"""

from __future__ import annotations

import numpy as np

SLOPES = np.linspace(0.05, 1.5, 30)
SHIFTS = np.linspace(-5.0, 1.0, 61)
EPS = 1e-6


def fit_depth(lp: np.ndarray, hit: np.ndarray) -> tuple[float, float]:
    """Guess log probabilities lp [M] and whether each was right hit [M] -> the (slope,
    shift) of highest Bernoulli likelihood; (1, 0), q = p, when M is 0."""
    lp, hit = np.asarray(lp, np.float64), np.asarray(hit, bool)
    if not lp.size:  # no evidence (a depth never reached): the head's own probabilities
        return 1.0, 0.0
    best, arg = np.inf, None
    for slope in SLOPES:
        log_q = np.minimum(0.0, slope * lp[:, None] + SHIFTS[None])  # [M,S]
        q = np.clip(np.exp(log_q), EPS, 1 - EPS)
        nll = -np.where(hit[:, None], np.log(q), np.log1p(-q)).sum(0)  # [S]
        i = int(np.argmin(nll))
        if nll[i] < best:
            best, arg = nll[i], (float(slope), float(SHIFTS[i]))
    return round(arg[0], 4), round(arg[1], 4)


def fit_calibration(lp: np.ndarray, hit: np.ndarray) -> tuple[tuple[float, float], ...]:
    """Top-w guesses at N positions: log probabilities lp [N,K,w] and hit [N,K,w] (the guess
    is the greedy token at depth k) -> (slope, shift) per depth, depth k fitted on the
    positions whose greedy tokens at depths < k are all among their top-w guesses."""
    found = hit.any(-1)  # [N,K]
    reachable = np.cumprod(np.concatenate([np.ones_like(found[:, :1]), found[:, :-1]], 1), 1)
    return tuple(
        fit_depth(lp[reachable[:, k] > 0, k].ravel(), hit[reachable[:, k] > 0, k].ravel())
        for k in range(lp.shape[1])
    )
