"""Detection calibration, false DE and PIT histograms (batchfix.eval.detection) on real and NB-simulated counts."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from scipy import stats

from batchfix.eval.detection import (
    batch_spread,
    calibrated_within,
    detection_calibration,
    false_de,
    nb_nonzero_probability,
    nonzero_shares,
    pit_histograms,
    pit_uniformity,
    randomized_pit,
    zeros_raised,
)


def nb_simulation(seed: int = 0, n_cells: int = 600, n_genes: int = 40):
    """NB counts of 2 labels x 3 batches (library sizes vary), with their means and a per-gene theta."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(["a", "b"], n_cells // 2)
    batches = np.tile(["x", "y", "z"], n_cells // 3)
    rates = rng.gamma(0.5, 2.0, (2, n_genes))  # per label
    library = rng.uniform(0.5, 2.0, (n_cells, 1))
    mean = library * rates[(labels == "b").astype(int)]
    theta = rng.uniform(0.5, 5.0, n_genes)
    counts = rng.negative_binomial(theta, theta / (theta + mean))
    return counts.astype(np.float32), mean, theta, labels, batches


def test_nb_nonzero_probability_matches_scipy():
    mean, theta = np.array([0.1, 1.0, 30.0]), np.array([0.5, 2.0, 10.0])
    expected = 1 - stats.nbinom.pmf(0, theta, theta / (theta + mean))
    np.testing.assert_allclose(nb_nonzero_probability(mean, theta), expected, rtol=1e-12)


def test_counts_from_the_model_are_calibrated_and_raising_zeros_is_seen():
    counts, mean, theta, labels, batches = nb_simulation()
    expected = nb_nonzero_probability(mean, theta)
    summary, frame = detection_calibration(sp.csr_matrix(counts), counts, expected, labels, batches)
    assert summary["groups"] == 40 * 6 and set(frame["n_cells"]) == {100}
    assert summary["within_tolerance"] > 0.8 and summary["zeros_raised"] == 0.0
    # a log-space shift that fills every zero: no group is calibrated, every zero is raised
    filled = np.log1p(counts) + 0.05
    bad, _ = detection_calibration(filled, counts, expected, labels, batches)
    assert bad["zeros_raised"] == 1.0 and bad["within_tolerance"] < summary["within_tolerance"]


def test_the_calibrated_share_is_what_counts_drawn_from_the_model_reach():
    """Groups of 100 cells: sampling alone puts some shares beyond 0.05 of their expectation; counts drawn from the
    model reach the calibrated share (up to the draw), and certain detection (p 0 or 1) reaches 1."""
    counts, mean, theta, labels, batches = nb_simulation()
    expected = nb_nonzero_probability(mean, theta)
    summary, _ = detection_calibration(sp.csr_matrix(counts), counts, expected, labels, batches)
    assert 0.7 < summary["calibrated_within"] < 1.0
    assert abs(summary["within_tolerance"] - summary["calibrated_within"]) < 0.05
    assert calibrated_within(expected, labels, batches, seed=1) == pytest.approx(summary["calibrated_within"], abs=0.05)
    certain = (expected > 0.5).astype(float)
    assert calibrated_within(certain, labels, batches) == 1.0
    assert summary["within_sampling"] > 0.9  # within 0.05 or 1.96 sampling sds: about 0.95 when calibrated
    filled, _ = detection_calibration(np.log1p(counts) + 0.05, counts, expected, labels, batches)
    assert filled["within_sampling"] < 0.5


def test_groups_below_the_cell_minimum_are_left_out_and_spread_is_over_batches(subset):
    counts = np.asarray(subset.X)
    labels = subset.obs["cell_type"].astype(str).to_numpy()
    batches = subset.obs["batch"].astype(str).to_numpy()
    shares = nonzero_shares(counts, labels, batches, min_cells=5)
    assert (shares["n_cells"] >= 5).all() and shares["share"].between(0, 1).all()
    one = shares[(shares["gene"] == 0)].iloc[0]
    cells = (labels == one["label"]) & (batches == one["batch"])
    assert one["share"] == pytest.approx((counts[cells, 0] > 0).mean())
    # the same shares in every batch: no spread; the real shares differ between batches
    same = shares.assign(share=shares.groupby(["gene", "label"])["share"].transform("mean"))
    assert batch_spread(same) == pytest.approx(0.0, abs=1e-12)
    assert batch_spread(shares) > 0


def test_zeros_raised_counts_only_the_raw_zeros():
    raw = sp.csr_matrix(np.array([[0, 2, 0], [1, 0, 0]], dtype=np.float32))
    corrected = np.array([[1, 3, 0], [0, 0, 0]], dtype=np.float32)  # one of four zeros raised, a nonzero dropped
    assert zeros_raised(raw, corrected) == pytest.approx(0.25)


def test_false_de_calls_genes_silent_in_raw_counts_on_a_filled_layer(subset):
    raw = np.asarray(subset.X)
    labels = subset.obs["cell_type"].astype(str).to_numpy()
    batches = subset.obs["batch"].astype(str).to_numpy()
    log = np.log1p(raw / raw.sum(axis=1, keepdims=True) * 1e4)
    null = np.zeros(raw.shape[1], dtype=bool)
    null[::2] = True
    sound = false_de(log, raw, labels, batches, null_genes=null, min_cells=5)
    assert len(sound) > 0 and (sound["called_zero_raw"] == 0).all()
    assert sound["null_rate"].between(0, 1).all()
    # the defect: a layer that fills one batch's silent genes with small values
    first = sound.iloc[0]
    filled = log.copy()
    silent = (raw[(labels == first["label"]) & np.isin(batches, [first["batch_1"], first["batch_2"]])] == 0).all(0)
    filled[np.ix_((labels == first["label"]) & (batches == first["batch_1"]), silent)] = 0.1
    bad = false_de(filled, raw, labels, batches, min_cells=5)
    assert bad.iloc[0]["called_zero_raw"] > 0


def test_pit_is_uniform_under_the_true_model_and_fails_under_a_wrong_theta():
    counts, mean, theta, labels, batches = nb_simulation(n_cells=3000, n_genes=10)
    u = randomized_pit(counts, mean, theta, np.random.default_rng(0))
    assert u.min() >= 0 and u.max() <= 1 and stats.kstest(u.ravel(), "uniform").pvalue > 1e-3
    good = pit_histograms(counts, mean, theta, batches)
    assert len(good) == 30 and good["fails"].mean() < 0.1 and (good["hist"].map(sum) == 1000).all()
    bad = pit_histograms(counts, mean, theta * 20, batches)  # too little dispersion: a U-shaped PIT
    assert bad["fails"].mean() >= 0.4  # seen where the mean is large enough for theta to matter


def test_the_models_own_pit_is_scipys_randomised_pit_and_uniform_where_the_model_fits():
    """CountDistributions.own_pit (what evaluate scores under a batchfix model) against scipy's NB cdf."""
    from batchfix.correction.count_output import CountDistributions

    counts, mean, theta, _, batches = nb_simulation()
    theta = np.broadcast_to(theta, mean.shape)
    nb = CountDistributions(counts.astype(np.float64), mean, mean, theta, theta)
    draws = np.random.default_rng(3).random(mean.shape)
    p = theta / (theta + mean)
    expected = stats.nbinom.cdf(counts - 1, theta, p) + draws * stats.nbinom.pmf(counts, theta, p)
    np.testing.assert_allclose(nb.own_pit(draws), expected, rtol=1e-9, atol=1e-12)
    assert pit_uniformity(nb.own_pit(draws), batches)["fails"].mean() < 0.05
    misfit = CountDistributions(counts.astype(np.float64), mean * 3, mean, theta, theta)  # the mean is wrong
    assert pit_uniformity(misfit.own_pit(draws), batches)["fails"].mean() > 0.5
