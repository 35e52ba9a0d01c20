"""scripts/lab/residual_forms.py's residual forms, on the real 200-cell subset's log values (per-batch centred)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import rankdata

from batchfix.data.normalize import log_cp10k
from scripts.lab import residual_forms

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def centred(subset):
    """(values (cells, G) centred per batch, batch codes (cells,), labels as codes (cells,))."""
    values = np.asarray(log_cp10k(subset.X), dtype=np.float64)
    codes = subset.obs["batch"].cat.codes.to_numpy()
    for b in np.unique(codes):
        values[codes == b] -= values[codes == b].mean(axis=0)
    return values, codes, subset.obs["cell_type"].cat.codes.to_numpy()


def test_quantile_matching_keeps_each_genes_order_and_gives_every_batch_one_distribution(centred):
    values, codes, _ = centred
    matched = residual_forms.quantile_match(values, codes, levels=40)
    for b in np.unique(codes):
        rows = codes == b
        ranks, new_ranks = rankdata(values[rows], axis=0), rankdata(matched[rows], axis=0)
        varied = values[rows].std(axis=0) > 0
        order_kept = [np.corrcoef(ranks[:, g], new_ranks[:, g])[0, 1] for g in np.flatnonzero(varied)[:100]]
        assert min(order_kept) > 0.99  # monotone per gene (ties may be split by the interpolation)
    spreads = np.array([matched[codes == b].std(axis=0) for b in np.unique(codes)])  # (batches, G)
    before = np.array([values[codes == b].std(axis=0) for b in np.unique(codes)])
    assert np.median(spreads.std(axis=0)) < 0.5 * np.median(before.std(axis=0))


def test_cluster_swap_gives_a_clusters_groups_one_mean_and_keeps_differences_within_them(centred):
    values, codes, labels = centred
    swapped = residual_forms.cluster_swap(values, codes, labels)
    for label in np.unique(labels):
        groups = [(labels == label) & (codes == b) for b in np.unique(codes)]
        big = [rows for rows in groups if rows.sum() >= residual_forms.MIN_GROUP]
        if len(big) >= 2:
            means = np.array([swapped[rows].mean(axis=0) for rows in big])
            assert np.abs(means - means.mean(axis=0)).max() < 1e-9
            for rows in big:  # a constant shift per group
                np.testing.assert_allclose(np.ptp(swapped[rows] - values[rows], axis=0), 0.0, atol=1e-9)


def test_linear_swap_removes_a_batchs_own_slope_on_the_latent(centred):
    values, codes, _ = centred
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((len(values), 4))
    slope = np.zeros((4, values.shape[1]))
    slope[0, :10] = 3.0
    tilted = values + np.where((codes == 0)[:, None], latent @ slope, 0.0)  # batch 0 alone depends on the latent
    swapped = residual_forms.linear_swap(tilted, codes, latent)
    rows = codes == 0
    fit = np.linalg.lstsq(latent[rows] - latent[rows].mean(axis=0), swapped[rows, :10], rcond=None)[0]
    others = np.linalg.lstsq(latent[~rows], swapped[~rows, :10], rcond=None)[0]
    assert np.abs(fit[0] - others[0]).max() < 0.2  # the batch's slope is the batches' mean slope now
    assert np.abs(np.linalg.lstsq(latent[rows], tilted[rows, :10], rcond=None)[0][0] - 3.0).max() < 0.5
