"""The stress set (scripts/stress_set.py): gene-wise batch effects of known size on real counts."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from scripts.stress_set import (
    Stress,
    contrast_truth_error,
    gene_factors,
    group_truth_error,
    relative_group_truth_error,
    stress_set,
    truth_error,
)


def test_stressed_counts_follow_the_recorded_factors_and_depths(subset):
    stress = Stress(sd=1.0, shared=0.5, depth_low=0.5, depth_high=1.0, seed=3)
    out = stress_set(subset, "batch", stress)
    truth, stressed = sp.csr_matrix(out.layers["truth"]), sp.csr_matrix(out.X)
    np.testing.assert_array_equal(truth.toarray(), sp.csr_matrix(subset.X).toarray())  # the truth is untouched
    assert list(out.obs_names) == list(subset.obs_names) and np.all(stressed.data == np.round(stressed.data))
    info = out.uns["stress"]
    assert info["sd"] == 1.0 and info["seed"] == 3 and info["depths"][0] == 0.5 and info["depths"][-1] == 1.0

    # The factors are drawn first from the seed: redraw them and check each batch's per-gene change.
    rng = np.random.default_rng(stress.seed)
    factors = gene_factors(np.asarray(truth.mean(0)).ravel(), len(info["batches"]), stress, rng)
    batch = subset.obs["batch"].astype(str).to_numpy()
    for i, name in enumerate(info["batches"]):
        rows = batch == name
        before = np.asarray(truth[rows].sum(0)).ravel()
        after = np.asarray(stressed[rows].sum(0)).ravel()
        expressed = before >= 200  # enough molecules for the ratio to be read off
        ratio = after[expressed] / before[expressed]
        expected = factors[i, expressed] * info["depths"][i]
        assert np.corrcoef(np.log(ratio), np.log(expected))[0, 1] > 0.95
        assert abs(np.median(np.log(ratio / expected))) < 0.05


def test_a_state_dependent_stress_gives_each_label_its_own_factors(subset):
    """state_share=0.75: each (label, batch) group's per-gene change follows a draw of its own, so two labels of one
    batch change differently (their log ratios correlate at about 1 - state_share, not 1)."""
    out = stress_set(subset, "batch", Stress(sd=1.0, depth_low=1.0, depth_high=1.0, state_share=0.75, seed=3))
    truth, stressed = sp.csr_matrix(out.layers["truth"]), sp.csr_matrix(out.X)
    rows = (subset.obs["batch"].astype(str) == out.uns["stress"]["batches"][0]).to_numpy()
    labels = subset.obs["cell_type"].astype(str).to_numpy()
    before = [np.asarray(truth[rows & (labels == t)].sum(0)).ravel() for t in sorted(set(labels[rows]))[:2]]
    after = [np.asarray(stressed[rows & (labels == t)].sum(0)).ravel() for t in sorted(set(labels[rows]))[:2]]
    expressed = (before[0] >= 100) & (before[1] >= 100)
    log_ratio = [np.log(a[expressed] / b[expressed]) for a, b in zip(after, before)]
    assert 0.0 < np.corrcoef(*log_ratio)[0, 1] < 0.5


def test_no_effect_leaves_the_counts_and_the_error_measures_the_difference(subset):
    out = stress_set(subset, "batch", Stress(sd=0.0, depth_low=1.0, depth_high=1.0))
    np.testing.assert_array_equal(sp.csr_matrix(out.X).toarray(), sp.csr_matrix(subset.X).toarray())
    values = np.log1p(sp.csr_matrix(subset.X).toarray())
    assert truth_error(values, values) == 0.0
    assert truth_error(values + 0.5, values) == pytest.approx(0.5)


def test_group_errors_average_out_cell_noise_and_the_relative_one_ignores_the_scale(subset):
    truth = np.log1p(sp.csr_matrix(subset.X).toarray())
    groups = (subset.obs["batch"].astype(str) + "/" + subset.obs["cell_type"].astype(str)).to_numpy()
    rng = np.random.default_rng(0)
    noisy = truth + rng.normal(0.0, 0.5, truth.shape)  # cell-to-cell noise only
    assert group_truth_error(noisy, truth, groups) < 0.5 * truth_error(noisy, truth)
    shifted = truth + 0.3  # an effect left in every group
    assert group_truth_error(shifted, truth, groups) == pytest.approx(0.3)
    # the same outputs on a tenth of the scale: the error shrinks tenfold, its relative form does not move
    relative = relative_group_truth_error(shifted, truth, groups)
    assert group_truth_error(shifted / 10, truth / 10, groups) == pytest.approx(0.03)
    assert relative_group_truth_error(shifted / 10, truth / 10, groups) == pytest.approx(relative)
    # 1.0: an error as large as the spread of the truth's group means around each gene's mean
    means = np.stack([truth[groups == g].mean(axis=0) for g in np.unique(groups)])
    spread = np.sqrt(np.mean((means - means.mean(axis=0)) ** 2))
    assert relative == pytest.approx(0.3 / spread)
    # the contrast error does not count an offset shared by every group, and counts one of a single batch
    assert contrast_truth_error(shifted, truth, groups) == pytest.approx(0.0, abs=1e-6)
    first = (subset.obs["batch"] == subset.obs["batch"].iloc[0]).to_numpy()
    share = len(np.unique(groups[first])) / len(np.unique(groups))  # of the groups, those of the first batch
    one_batch = truth + 0.3 * first[:, None]  # groups err by 0.3 (1 - share) there and by -0.3 share elsewhere
    contrast = contrast_truth_error(one_batch, truth, groups)
    assert contrast == pytest.approx(0.3 * np.sqrt(share * (1 - share)) / spread)
    assert 0 < contrast < relative_group_truth_error(one_batch, truth, groups)
