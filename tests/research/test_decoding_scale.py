"""The expected-log table of scripts/lab/decoding_scale.py against the negative binomial's exact expectation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import nbinom

from scripts.lab.decoding_scale import ExpectedLog

pytestmark = pytest.mark.lab


def exact_expected_log(m: float, theta: float, a: float) -> float:
    """E[log1p(a N)], N ~ NB(mean m, theta), summed over every count with mass (to 1 - 1e-10; the tail left out is below 1e-10 log1p(a N) per count)."""
    counts = np.arange(int(nbinom.ppf(1 - 1e-10, theta, theta / (theta + m))) + 1)
    return float(np.sum(nbinom.pmf(counts, theta, theta / (theta + m)) * np.log1p(a * counts)))


def test_the_table_matches_the_exact_expectation_over_dispersions_means_and_depths():
    theta = np.array([0.2, 1.0, 8.0, 200.0])
    table = ExpectedLog(theta, (0.05, 20.0))
    means = [3e-4, 0.02, 0.7, 6.0, 90.0, 4000.0]
    for a in (0.05, 0.9, 20.0):
        got = table(torch.tensor([means] * len(theta)).T.contiguous().expand(len(means), len(theta)).clone(),
                    torch.full((len(means), 1), a))  # (means, genes)
        for i, m in enumerate(means):
            for g, t in enumerate(theta):
                exact = exact_expected_log(m, t, a)
                assert abs(float(got[i, g]) - exact) <= max(2e-3 * exact, 1e-4), (m, t, a, float(got[i, g]), exact)


def test_the_expected_log_lies_below_the_log_of_the_mean_by_more_for_more_dispersed_genes():
    """Jensen's gap: E[log1p(a N)] < log1p(a m), wider for a smaller theta (more dispersion), closing as m grows
    for a Poisson-like gene."""
    theta = np.array([0.5, 1000.0])
    table = ExpectedLog(theta, (1.0, 1.0))
    m = torch.tensor([[2.0, 2.0], [2000.0, 2000.0]], dtype=torch.float64)
    gap = np.log1p(m.numpy()) - table(m, torch.ones(2, 1)).numpy()
    assert (gap > 0).all()
    assert gap[0, 0] > gap[0, 1] and gap[1, 0] > gap[1, 1]
    assert gap[1, 1] < gap[0, 1] / 10
