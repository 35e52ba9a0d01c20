"""Negative binomial tails in log space: the quantile map of counts whose tail probabilities underflow float64.

A count far above its batch's mean (1,000 in a gene whose mean is 0.05) has an upper tail S(y) = P(X > y) far
below float64's smallest number: the quantile map's target S_b(y) + (1 - u) P_b(y) rounds to 0, and the inverse of
0 is infinite. Here every probability is a logarithm, so no count is out of reach:

- log P(k) = -log B(theta, k + 1) - log(k + theta) + theta log p + k log q (scipy's betaln, exact for a large
  count beside a small theta, where a difference of gammaln values loses its digits).
- log S(k) = log I_q(k + 1, theta) and log F(k) = log I_p(theta, k + 1): the log of scipy's betainc where that is
  above SMALLEST_LINEAR, else the incomplete beta function's continued fraction in log form,
  log I_x(a, b) = a log x + b log(1 - x) - log B(a, b) - log a + log CF (Numerical Recipes' betacf, modified
  Lentz). A tail that small lies far beyond the mean, where x < (a + 1) / (a + b + 2) and the fraction converges
  in a few terms; its relative error (~1e-13, betaln's ~1e-9 at a ~1e6) is far below a count's step in log S.
- The target combines them by log-sum-exp: log T = log(S_b(y) + (1 - u) P_b(y)) (the survival form) or
  log(F_b(y - 1) + u P_b(y)) (the lower tail's, where F_b(y - 1) is the smaller side).
- The inverse is the smallest k with log S_ref(k) <= log T (log F_ref(k) >= log T): from the tail's own
  asymptote, k ~ y log q_b / log q_ref (S(k) falls by a factor ~q per count far out), steps doubling away from it
  until the answer is bracketed, then bisection on the integers. Exact to the integer except where log T lies
  within the tails' error of a quantile's boundary.

A corrected count above MAX_COUNT (float32's largest, the output layers' type) is MAX_COUNT: the search stops
there.
"""
from __future__ import annotations

import numpy as np
from scipy import special

MAX_COUNT = float(np.finfo(np.float32).max)  # the largest count the float32 output layers hold
SMALLEST_LINEAR = 1e-290  # betainc's values below this are recomputed in log form (near underflow)
FRACTION_TERMS = 2000  # at most, of the continued fraction (a far tail needs a few)
FRACTION_TOLERANCE = 1e-13  # a term's change of the fraction below this: converged (rounding leaves ~1e-15)
FRACTION_FLOOR = 1e-300  # Lentz's guard against a zero denominator


def beta_fraction(a: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The continued fraction of I_x(a, b) = x^a (1 - x)^b / (a B(a, b)) x CF, by the modified Lentz method
    (Numerical Recipes' betacf); converges fast for x < (a + 1) / (a + b + 2)."""

    def guarded(v):
        return np.where(np.abs(v) < FRACTION_FLOOR, FRACTION_FLOOR, v)

    c = np.ones_like(x)
    d = 1.0 / guarded(1.0 - (a + b) * x / (a + 1.0))
    fraction = d.copy()
    for m in range(1, FRACTION_TERMS + 1):
        even = m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m))
        for term in (even, odd):
            d = 1.0 / guarded(1.0 + term * d)
            c = guarded(1.0 + term / c)
            fraction = fraction * d * c
        if np.all(np.abs(d * c - 1.0) < FRACTION_TOLERANCE):
            break
    return fraction


def log_betainc(a: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """log I_x(a, b) (y = 1 - x, passed exactly) by the continued fraction: for x < (a + 1) / (a + b + 2)."""
    return (special.xlogy(a, x) + special.xlogy(b, y) - special.betaln(a, b) - np.log(a)
            + np.log(beta_fraction(a, b, x)))


def log_tail(k: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray, survival: np.ndarray) -> np.ndarray:
    """log S(k) = log P(X > k) where `survival`, else log F(k) = log P(X <= k), of NB(theta, p) (q = 1 - p);
    finite for any count (below k = 0: S = 1, F = 0)."""
    kk = np.maximum(k, 0.0) + 1.0
    a, b = np.where(survival, kk, theta), np.where(survival, theta, kk)
    x, y = np.where(survival, q, p), np.where(survival, p, q)
    linear = special.betainc(a, b, x)
    with np.errstate(divide="ignore"):
        result = np.log(linear)
    far = np.flatnonzero(linear < SMALLEST_LINEAR)
    if len(far):
        result[far] = log_betainc(a[far], b[far], x[far], y[far])
    return np.where(k >= 0, result, np.where(survival, 0.0, -np.inf))


def log_probability(k: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """log P(X = k) of NB(theta, p) (q = 1 - p) at counts k >= 0, with betaln (exact where k >> theta)."""
    return -special.betaln(theta, k + 1.0) - np.log(k + theta) + theta * np.log(p) + special.xlogy(k, q)


def log_quantile(log_target: np.ndarray, guess: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray,
                 survival: np.ndarray) -> np.ndarray:
    """The smallest k in [0, MAX_COUNT] with log S(k) <= log_target (`survival`) or log F(k) >= log_target under
    NB(theta, p) (q = 1 - p), MAX_COUNT if none is: steps doubling from `guess` until bracketed, then bisection."""

    def reached(k, rows):
        values = log_tail(k, theta[rows], p[rows], q[rows], survival[rows])
        return np.where(survival[rows], values <= log_target[rows], values >= log_target[rows])

    start = np.clip(np.round(np.nan_to_num(guess, nan=0.0, posinf=MAX_COUNT)), 0.0, MAX_COUNT)
    rows = np.arange(len(log_target))
    hit = reached(start, rows)
    below = np.where(hit, -1.0, start)  # the largest k known not to reach (-1: no count)
    above = np.where(hit, start, MAX_COUNT)  # the smallest known to reach (MAX_COUNT: reached, or the clip)
    step = 1.0
    while len(rows):  # away from the start, steps doubling: down while reached, up while not
        down = hit[rows]
        probe = np.where(down, start[rows] - step, start[rows] + step)
        inside = np.where(down, probe >= 0.0, probe < MAX_COUNT)
        rows, probe, down = rows[inside], probe[inside], down[inside]
        now = reached(probe, rows)
        above[rows[now]], below[rows[~now]] = probe[now], probe[~now]
        rows = rows[now == down]
        step *= 2.0
    rows = np.arange(len(log_target))
    while len(rows):  # bisection on the integers between the bracket's ends
        middle = np.floor((below[rows] + above[rows]) / 2.0)
        inside = (middle > below[rows]) & (middle < above[rows])
        rows, middle = rows[inside], middle[inside]
        now = reached(middle, rows)
        above[rows[now]], below[rows[~now]] = middle[now], middle[~now]
    return above


def log_quantile_map(y: np.ndarray, own_mean: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray,
                     ref_mean: np.ndarray, ref_theta: np.ndarray, ref_p: np.ndarray, ref_q: np.ndarray,
                     u: np.ndarray, survival: np.ndarray) -> np.ndarray:
    """Counts y moved from NB(theta, p) (mean own_mean, q = 1 - p) to the same randomised quantile of
    NB(ref_theta, ref_p) (mean ref_mean), all in log space; `survival`: where the target is the upper tail's
    S_b(y) + (1 - u) P_b(y), else the lower tail's F_b(y - 1) + u P_b(y). Finite, 0 to MAX_COUNT."""
    log_mass = log_probability(y, theta, p, q)
    with np.errstate(divide="ignore"):
        log_share = np.where(survival, np.log1p(-u), np.log(u))
    log_target = np.logaddexp(log_tail(np.where(survival, y, y - 1.0), theta, p, q, survival), log_share + log_mass)
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.where(survival, y * np.log(q) / np.log(ref_q), y * ref_mean / own_mean)
    return log_quantile(log_target, guess, ref_theta, ref_p, ref_q, survival)
