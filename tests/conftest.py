"""Shared fixtures for the input-side tests (io, genome).

The bundled dataset is read once per session; tests that need a file on disk get a small real
subset (200 cells x 600 genes, all 5 batches) written to their own tmp_path, and tests that need
a bad file make it themselves from these. `counts_nearly_equal` compares corrected counts of one input.
"""
from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

from batchfix.data.normalize import log_cp10k

TESTS_DIR = Path(__file__).resolve().parent
BUNDLED_H5AD = TESTS_DIR / ".." / "data" / "cellbench5.h5ad"

N_SUBSET_CELLS = 200
N_SUBSET_GENES = 600
N_BATCHES = 5


@pytest.fixture(scope="session")
def bundled_h5ad() -> Path:
    """Path of the bundled real dataset, resolved relative to the tests folder."""
    path = BUNDLED_H5AD.resolve()
    assert path.is_file(), f"bundled dataset missing: {path}"
    return path


@pytest.fixture(scope="session")
def bundled_adata(bundled_h5ad) -> ad.AnnData:
    """The bundled dataset in memory (read once). Do not modify: take a .copy()."""
    return ad.read_h5ad(bundled_h5ad)


@pytest.fixture(scope="session")
def _subset_index(bundled_adata):
    """Cells (40 per batch) and genes (600 detected in those cells, placed and unplaced)."""
    rng = np.random.default_rng(0)
    batch = bundled_adata.obs["batch"].astype(str).to_numpy()
    batches = sorted(set(batch))
    assert len(batches) == N_BATCHES
    per_batch = N_SUBSET_CELLS // N_BATCHES
    cells = np.sort(np.concatenate([
        rng.choice(np.flatnonzero(batch == b), size=per_batch, replace=False) for b in batches
    ]))
    X = np.asarray(bundled_adata.X[cells])
    detected = np.flatnonzero((X > 0).sum(axis=0) >= 3)
    genes = np.sort(rng.choice(detected, size=N_SUBSET_GENES, replace=False))
    assert (X[:, genes] > 0).any(axis=1).all(), "subset has an empty cell"
    return cells, genes


@pytest.fixture(scope="session")
def subset(bundled_adata, _subset_index) -> ad.AnnData:
    """The real 200 x 600 subset (5 batches of 40 cells), dense float32 raw counts in X. Shared: do not modify."""
    cells, genes = _subset_index
    adata = bundled_adata[cells][:, genes].copy()
    adata.X = np.asarray(adata.X, dtype=np.float32)
    return adata


@pytest.fixture(scope="session")
def log_scale_subset(bundled_adata, _subset_index) -> ad.AnnData:
    """The real subset on a log scale, 1 + log1p(counts per 10k), for a model of log-scale input (whose output is
    the log-scale counterfactual formula). No value is 0, so the rule that an input zero stays zero (tested on
    its own) leaves every value to the formula. Shared: do not modify."""
    cells, genes = _subset_index
    adata = bundled_adata[cells][:, genes].copy()
    adata.X = 1.0 + np.asarray(log_cp10k(np.asarray(adata.X, dtype=np.float32)), dtype=np.float32)
    return adata


@pytest.fixture(scope="session")
def subset_h5ad(tmp_path_factory, subset) -> Path:
    """The real 200-cell x 600-gene subset (5 batches) written once, for tests that train on a file."""
    path = tmp_path_factory.mktemp("data") / "small.h5ad"
    subset.write_h5ad(path)
    return path


@pytest.fixture
def small_adata(subset) -> ad.AnnData:
    """A fresh in-memory copy of the real 200 x 600 subset (dense float32 raw counts in X)."""
    return subset.copy()


@pytest.fixture
def write_h5ad(tmp_path):
    """Write an AnnData to tmp_path/<name> and return the path."""

    def _write(adata: ad.AnnData, name: str = "input.h5ad") -> Path:
        path = tmp_path / name
        adata.write_h5ad(path)
        return path

    return _write


@pytest.fixture
def small_h5ad(small_adata, write_h5ad) -> Path:
    """The real 200 x 600 subset written to tmp_path/small.h5ad."""
    return write_h5ad(small_adata, "small.h5ad")


@pytest.fixture(scope="session")
def counts_nearly_equal():
    """Check two corrected-count matrices of one input: a tiny change of the model's means (float noise, int8, a
    reloaded checkpoint) moves a count on a quantile boundary by one, so a share of entries below `max_share` may
    differ, by 1 at most. Returns the share that differs."""

    def check(actual, expected, max_share: float = 0.01) -> float:
        difference = sp.csr_matrix(actual) - sp.csr_matrix(expected)
        difference.eliminate_zeros()
        share = difference.nnz / np.prod(difference.shape)
        assert np.abs(difference.data).max(initial=0) <= 1, "a count moved by more than 1"
        assert share < max_share, f"{share:.2%} of the counts differ"
        return share

    return check
