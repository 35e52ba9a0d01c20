"""Corrected counts: each observed count moved from its batch's negative binomial to the reference's.

For a cell c of batch b and a gene g, the model gives the count's distribution in the cell's own batch,
NB(m_b, theta_b) with m_b = the decoder's mean fraction x the cell's library, and the applied log-mean shift s
(the decoder's log(mean_ref / mean_b) after every correction option), so the reference's distribution at the same
library is NB(m_b * exp(s), theta_ref). The observed count y is mapped to the same quantile of the reference's
distribution (ComBat-seq's mapping, here with the model's means):

    u  ~ U(F_b(y - 1), F_b(y))         a randomised probability integral transform (PIT)
    y' = F_ref^-1(u)

- The draw u comes from a counter-based generator keyed by (seed, cell, gene): hashes of the cell's and the
  gene's names (`name_keys`), so streamed, in-memory and repeated runs give the same counts, and so does a file
  with its cells or genes reordered or subset (two cells of one name share their draws).
- The cell's library is kept: a cell without counts keeps none, and a count's scale is its own cell's depth.
- Where y's lower tail probability F_b(y - 1) passes one half, the survival functions are used instead (float64):
  a large count's quantile is not lost to rounding 1 - F near 1.
- Where even the survival function underflows (a count of 1,000 in a gene whose mean is 0.05: S_b(y) ~ 1e-1000),
  the target is 0 or subnormal and its inverse infinite: those counts (and any whose inverse is not finite) are
  mapped with every probability in log space (batchfix.correction.log_tails: the continued fraction of the
  incomplete beta function, log-sum-exp, a bracketing search on the integers). Every other count takes the float64
  route above, unchanged. Far out the NB tail falls by a factor ~q = mean / (theta + mean) per count, so a large
  count goes to about y log q_b / log q_ref (y times the means' ratio only where mean >> theta).
- A distribution whose mean / theta passes float64's resolution of q = mean / (theta + mean) (q rounds to 1: a
  cell's library near 1e16 or more, a corrupt count) is its gamma limit, Gamma(theta, mean / theta) to within a
  relative p < 1e-16, whose quantiles scale with the mean: an upper-tail count there goes to y mean_ref / mean_b
  (exact for one theta, correction.spread=batch; the upper tail in q is lost to rounding, the lower one in p kept).
- A corrected count above float32's largest value (the output layers' type; log_tails.MAX_COUNT) is clipped to it.
- A zero in the cell's own batch becomes positive only where the reference expects the gene more often than the
  cell's batch does, and with the probability the two distributions give: P(y' > 0 | y = 0) =
  max(0, 1 - F_ref(0) / F_b(0)).

Each training batch's per-gene ratio r_b (observed over the decoder's mean) and dispersion theta_b are calibrated
after the fit (`CountSums`; the dispersion shrunk toward the model's shared theta_g): the own batch's mean is
r_b m_b, the reference's r_ref m_ref (r_ref the geometric mean of the training batches' ratios for the average
reference, its own for a named one), so the decoder's shift is completed by log(r_ref / r_b), the counts' analogue
of the log output's location. The reference's dispersion is theta_g for the average reference and the batch's own
for a named one. A batch the model never saw gets its ratio and dispersion from its own cells.
"""
from __future__ import annotations

import hashlib

import numpy as np
from scipy import special, stats

from batchfix.correction import log_tails

SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
# Prior weight of the model's shared dispersion in a batch's calibrated one, in cells (the counts analogue of
# the inverse-gamma shrinkage of correction.spread=gene: a batch of few cells keeps about theta_g).
DISPERSION_PRIOR_CELLS = 20.0
MIN_THETA, MAX_THETA = 1e-3, 1e4  # theta above MAX_THETA is Poisson for any count a cell holds
RATIO_PRIOR_COUNTS = 0.5  # pseudo-counts of a batch's observed / decoded mean ratio (CountSums.ratio)
SEARCH_STEPS = 8  # steps from the guess before the quantile search hands over to scipy's inverse
# The pmf walk (`walk_tails`, `walk_quantile`): counts up to WALK_STEPS, P(0) above exp(LOG_PMF_FLOOR) (no
# underflow on the way), and 1 - F_b(y) at least WALK_TAIL_FLOOR (its digits kept in the lower tail's arithmetic)
WALK_STEPS = 64
LOG_PMF_FLOOR = -600.0
WALK_TAIL_FLOOR = 1e-6


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def name_keys(names) -> np.ndarray:
    """(n,) uint64 keys of cell or gene names (the first 8 bytes of each name's BLAKE2b digest): the same name
    gets the same key in any file, whatever its row or column."""
    return np.array([int.from_bytes(hashlib.blake2b(str(name).encode(), digest_size=8).digest(), "little")
                     for name in names], dtype=np.uint64)


def counter_uniform(seed: int, cells: np.ndarray, genes: np.ndarray) -> np.ndarray:
    """(len(cells), len(genes)) uniforms in (0, 1), each a function of (seed, cell key, gene key) alone."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.uint64(seed) * SPLITMIX_GAMMA + np.asarray(cells, dtype=np.uint64) + SPLITMIX_GAMMA)
        mixed = _splitmix64(key[:, None] ^ (_splitmix64(np.asarray(genes, dtype=np.uint64) + SPLITMIX_GAMMA)[None, :]))
    return ((mixed >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def lower_tail(k: np.ndarray, theta: np.ndarray, p: np.ndarray) -> np.ndarray:
    """F(k) = P(X <= k) of NB(theta, p) (p = theta / (theta + mean)); 0 below k = 0."""
    return np.where(k >= 0, special.betainc(theta, np.maximum(k, 0) + 1.0, p), 0.0)


def upper_tail(k: np.ndarray, theta: np.ndarray, q: np.ndarray) -> np.ndarray:
    """S(k) = P(X > k) of NB(theta, p) = I_q(k + 1, theta), exact in the far upper tail where 1 - F(k) rounds;
    1 below k = 0. q = 1 - p = mean / (theta + mean), passed exactly."""
    return np.where(k >= 0, special.betainc(np.maximum(k, 0) + 1.0, theta, q), 1.0)


def probability(k: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(X = k) of NB(theta, p) (q = 1 - p, passed exactly); 0 below k = 0."""
    kk = np.maximum(k, 0.0)
    log_pmf = (special.gammaln(kk + theta) - special.gammaln(theta) - special.gammaln(kk + 1.0)
               + theta * np.log(p) + special.xlogy(kk, q))
    return np.where(k >= 0, np.exp(log_pmf), 0.0)


class Tail:
    """One tail of NB(theta, p) at counts k, moved one count at a time by adding or taking off P(X = k) (a few
    arithmetic operations where the incomplete beta function costs far more): F(k) (`survival` False) or S(k)."""

    CANCELLATION = 1e-6  # a difference below this share of the larger term is recomputed exactly

    def __init__(self, k: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray, survival: bool):
        self.k, self.theta, self.p, self.q, self.survival = k, theta, p, q, survival
        self.value = upper_tail(k, theta, q) if survival else lower_tail(k, theta, p)

    def exact(self, k: np.ndarray, rows: np.ndarray) -> np.ndarray:
        theta = self.theta[rows]
        return upper_tail(k, theta, self.q[rows]) if self.survival else lower_tail(k, theta, self.p[rows])

    def reached(self, target: np.ndarray, values: np.ndarray) -> np.ndarray:
        """F(k) >= target (S(k) <= target with `survival`): k is at or above the target's quantile."""
        return values <= target if self.survival else values >= target

    def at(self, k: np.ndarray, rows: np.ndarray, values: np.ndarray, step: float) -> np.ndarray:
        """The tail at k + step (step +1 or -1) of `rows`, from its `values` at k."""
        moved = k + step
        mass = probability(np.maximum(k, moved), self.theta[rows], self.p[rows], self.q[rows])
        grows = (step > 0) != self.survival  # F grows stepping up, S stepping down
        new = values + mass if grows else values - mass
        inexact = (not grows) & (new < self.CANCELLATION * values)
        if inexact.any():
            new[inexact] = self.exact(moved[inexact], rows[inexact])
        return new


def quantile_search(guess: np.ndarray, target: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray,
                    survival: bool) -> np.ndarray:
    """The smallest k >= 0 with F(k) >= target (or, with `survival`, S(k) <= target) under NB(theta, p) (q = 1 - p),
    stepping from `guess` (a count near the answer: a few steps each); entries still moving after SEARCH_STEPS
    steps take scipy's inverse."""
    k = np.maximum(guess, 0.0)
    tail = Tail(k, theta, p, q, survival)
    values = tail.value
    everyone = np.arange(len(k))
    up = ~tail.reached(target, values)  # too low: step up
    rows, current = everyone[up], values[up]
    for _ in range(SEARCH_STEPS):
        current = tail.at(k[rows], rows, current, +1.0)
        k[rows] += 1.0
        still = ~tail.reached(target[rows], current)
        rows, current = rows[still], current[still]
    unresolved = [rows]
    down = ~up & (k > 0)
    rows, current = everyone[down], values[down]
    for _ in range(SEARCH_STEPS + 1):  # while one lower still reaches: step down
        below = tail.at(k[rows], rows, current, -1.0)
        lower = tail.reached(target[rows], below)
        rows, current = rows[lower], below[lower]
        k[rows] -= 1.0
        keep = k[rows] > 0
        rows, current = rows[keep], current[keep]
    rows = np.concatenate([*unresolved, rows])
    if len(rows):  # far from the guess: the distribution's own inverse
        nb = stats.nbinom(theta[rows], p[rows])
        k[rows] = nb.isf(target[rows]) if survival else nb.ppf(target[rows])
    return k


def walk_tails(y: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(F(y - 1), P(y)) of NB(theta, p) (q = 1 - p) at counts y, by the pmf's recurrence from 0,
    P(k + 1) = P(k) q (k + theta) / (k + 1): a few arithmetic operations per count where the incomplete beta
    function costs far more. For counts up to WALK_STEPS and P(0) above LOG_PMF_FLOOR (callers check)."""
    below, mass = np.zeros_like(y), np.exp(theta * np.log(p))  # F(-1) = 0, P(0)
    rows = np.flatnonzero(y > 0)
    current, tail, theta_rows, q_rows = mass[rows], np.zeros(len(rows)), theta[rows], q[rows]
    k = 0
    while len(rows):
        tail = tail + current  # F(k)
        current = current * q_rows * (k + theta_rows) / (k + 1)  # P(k + 1)
        k += 1
        done = y[rows] == k
        if done.any():
            below[rows[done]], mass[rows[done]] = tail[done], current[done]
            keep = ~done
            rows, current, tail = rows[keep], current[keep], tail[keep]
            theta_rows, q_rows = theta_rows[keep], q_rows[keep]
    return below, mass


def walk_quantile(target: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The smallest k with F(k) >= target under NB(theta, p), by the recurrence of `walk_tails` (the same
    arithmetic, so a distribution mapped to itself gives every count back); NaN where that k is above WALK_STEPS."""
    result = np.full(len(target), np.nan)
    rows = np.arange(len(target))
    current = np.exp(theta * np.log(p))
    tail, theta_rows, q_rows, target_rows = np.zeros(len(rows)), theta, q, target
    for k in range(WALK_STEPS + 1):
        tail = tail + current  # F(k)
        done = tail >= target_rows
        result[rows[done]] = k
        keep = ~done
        rows, tail, target_rows = rows[keep], tail[keep], target_rows[keep]
        theta_rows, q_rows = theta_rows[keep], q_rows[keep]
        if not len(rows):
            break
        current = current[keep] * q_rows * (k + theta_rows) / (k + 1)  # P(k + 1)
    return result


def quantile_map(y: np.ndarray, own_mean: np.ndarray, ref_mean: np.ndarray, own_theta: np.ndarray,
                 ref_theta: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Counts y (flat float64) moved from NB(own_mean, own_theta) to the same randomised quantile of
    NB(ref_mean, ref_theta); u: the uniforms (flat). Entries that stay 0 are settled without the NB's inverse;
    small counts away from the far upper tail by walking the pmf (`walk_tails`, `walk_quantile`), the rest by
    the incomplete beta function and its survival form (`exact_quantile_map`)."""
    out = np.zeros_like(y)
    own_p, ref_p = own_theta / (own_theta + own_mean), ref_theta / (ref_theta + ref_mean)
    # A zero's PIT is u * F_b(0); it stays 0 where that is within F_ref(0).
    moved = np.flatnonzero((y > 0) | (u * np.power(own_p, own_theta) > np.power(ref_p, ref_theta)))
    if not len(moved):
        return out
    own_q = own_mean[moved] / (own_theta[moved] + own_mean[moved])  # 1 - p, exactly
    ref_q = ref_mean[moved] / (ref_theta[moved] + ref_mean[moved])
    yy, theta, p = y[moved], own_theta[moved], own_p[moved]
    walk = np.flatnonzero((yy <= WALK_STEPS) & (theta * np.log(p) > LOG_PMF_FLOOR)
                          & (ref_theta[moved] * np.log(ref_p[moved]) > LOG_PMF_FLOOR))
    below, mass = walk_tails(yy[walk], theta[walk], p[walk], own_q[walk])
    result = np.full(len(moved), np.nan)
    inner = 1.0 - (below + mass) >= WALK_TAIL_FLOOR  # away from the far upper tail, where 1 - F loses its digits
    walk = walk[inner]
    result[walk] = walk_quantile(below[inner] + u[moved][walk] * mass[inner], ref_theta[moved][walk],
                                 ref_p[moved][walk], ref_q[walk])
    exact = np.flatnonzero(np.isnan(result))
    if len(exact):
        index = moved[exact]
        result[exact] = exact_quantile_map(y[index], own_mean[index], own_theta[index], own_p[index], own_q[exact],
                                           ref_mean[index], ref_theta[index], ref_p[index], ref_q[exact], u[index])
    out[moved] = np.minimum(result, log_tails.MAX_COUNT)
    return out


def exact_quantile_map(y: np.ndarray, own_mean: np.ndarray, theta: np.ndarray, p: np.ndarray, q: np.ndarray,
                       ref_mean: np.ndarray, ref_theta: np.ndarray, ref_p: np.ndarray, ref_q: np.ndarray,
                       u: np.ndarray) -> np.ndarray:
    """`quantile_map` for entries to be moved, by the incomplete beta function; where F_b(y - 1) passes one half
    the survival functions are used instead (a large count's quantile is not lost to rounding 1 - F near 1). Where
    the target underflows (0 or subnormal) or its inverse is not a count, in log space (log_tails); an upper-tail
    count whose q rounds to 1 by the means' ratio (the gamma limit, see the module's docstring)."""
    mass = probability(y, theta, p, q)  # P_b(y)
    low = lower_tail(y - 1.0, theta, p)  # F_b(y - 1)
    survival = low > 0.5
    target = low + u * mass
    upper_rows = np.flatnonzero(survival)
    s_low = upper_tail(y[upper_rows], theta[upper_rows], q[upper_rows])  # S_b(y)
    target[upper_rows] = s_low + (1.0 - u[upper_rows]) * mass[upper_rows]  # 1 - the lower tail's target
    underflow = target < np.finfo(np.float64).tiny  # its digits lost: the log-space route
    beyond = survival & ((q >= 1.0) | (ref_q >= 1.0))  # q rounds to 1: the gamma limit (module docstring)
    guess = np.round(y * ref_mean / np.maximum(own_mean, 1e-300))
    result = np.full_like(y, np.nan)
    searched = ~underflow & ~beyond
    for rows, tail in ((np.flatnonzero(~survival & searched), False), (np.flatnonzero(survival & searched), True)):
        result[rows] = quantile_search(guess[rows], target[rows], ref_theta[rows], ref_p[rows], ref_q[rows], tail)
    result[beyond] = guess[beyond]
    far = np.flatnonzero(~beyond & (underflow | ~np.isfinite(result) | (result < 0)))
    if len(far):
        result[far] = log_tails.log_quantile_map(y[far], own_mean[far], theta[far], p[far], q[far], ref_mean[far],
                                                 ref_theta[far], ref_p[far], ref_q[far], u[far], survival[far])
    return result


class DispersionSums:
    """Per-gene sums for one batch's dispersion by moments against the model's means: Var(y) = m + m^2 / theta.

    excess = sum (y - m)^2 - m, and mean_sq = sum m^2 over the batch's cells; the calibrated 1 / theta is their
    ratio, shrunk toward the model's shared 1 / theta_g with DISPERSION_PRIOR_CELLS cells' weight (`theta`).
    """

    def __init__(self, n_genes: int):
        self.n_cells = 0
        self.excess = np.zeros(n_genes)
        self.mean_sq = np.zeros(n_genes)

    def add(self, counts: np.ndarray, mean: np.ndarray) -> None:
        counts, mean = counts.astype(np.float64, copy=False), mean.astype(np.float64, copy=False)
        self.n_cells += counts.shape[0]
        self.excess += (np.square(counts - mean) - mean).sum(axis=0)
        self.mean_sq += np.square(mean).sum(axis=0)

    def theta(self, shared_theta: np.ndarray) -> np.ndarray:
        """(genes,) this batch's theta, shrunk toward `shared_theta`; the shared one itself below two cells."""
        if self.n_cells < 2:
            return np.asarray(shared_theta, dtype=np.float64).copy()
        prior = DISPERSION_PRIOR_CELLS * self.mean_sq / self.n_cells  # the prior's weight on the mean_sq scale
        dispersion = (np.maximum(self.excess, 0.0) + prior / shared_theta) / np.maximum(self.mean_sq + prior, 1e-300)
        return np.clip(1.0 / np.maximum(dispersion, 1.0 / MAX_THETA), MIN_THETA, MAX_THETA)


class CountSums:
    """Per-gene sums over one batch's cells against the decoder's NB means m: the batch's per-gene ratio
    r = sum y / sum m (its mean is r m: what the decoder's batch term leaves of the batch's effect, the counts'
    analogue of the log output's location) and its dispersion around r m (`dispersion`)."""

    SUMMED = ("n_cells", "sums")  # batchfix.correction.reduction adds these

    def __init__(self, n_genes: int):
        self.n_cells = 0
        self.sums = {name: np.zeros(n_genes) for name in ("y", "y2", "ym", "m", "m2")}

    def add(self, counts: np.ndarray, mean: np.ndarray) -> None:
        counts, mean = counts.astype(np.float64, copy=False), mean.astype(np.float64, copy=False)
        self.n_cells += counts.shape[0]
        for name, values in (("y", counts), ("y2", counts * counts), ("ym", counts * mean), ("m", mean),
                             ("m2", mean * mean)):
            self.sums[name] += values.sum(axis=0)

    def ratio(self) -> np.ndarray:
        """(genes,) the batch's observed counts over the decoder's expected ones, with RATIO_PRIOR_COUNTS added to
        both (a gene the batch never shows gets a small ratio, not 0; a well-measured one its own)."""
        return (self.sums["y"] + RATIO_PRIOR_COUNTS) / (self.sums["m"] + RATIO_PRIOR_COUNTS)

    def dispersion(self) -> DispersionSums:
        """The moments around r m: sum (y - r m)^2 - r m and sum (r m)^2, expanded from the sums."""
        r, s = self.ratio(), self.sums
        sums = DispersionSums(len(r))
        sums.n_cells = self.n_cells
        sums.excess = s["y2"] - 2 * r * s["ym"] + r * r * s["m2"] - r * s["m"]
        sums.mean_sq = r * r * s["m2"]
        return sums
