"""The matrix-score registry (batchfix.eval.matrix_scores) on the real bundled counts."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from batchfix.data.normalize import log_cp10k
from batchfix.eval import matrix_scores
from batchfix.eval.matrix_scores import MatrixInput, score_matrix


@pytest.fixture(scope="module")
def bundled_genes(bundled_adata):
    """All 1,021 cells; the 300 most-detected genes and the 100 least-detected ones (zero in many groups)."""
    counts = sp.csr_matrix(bundled_adata.X)
    detected = np.asarray((counts > 0).sum(axis=0)).ravel()
    order = np.argsort(-detected, kind="stable")
    genes = np.sort(np.concatenate([order[:300], order[-100:]]))
    raw = counts[:, genes].toarray().astype(np.float32)
    return (raw, bundled_adata.obs["cell_type"].astype(str).to_numpy(),
            bundled_adata.obs["batch"].astype(str).to_numpy())


def test_every_registered_score_has_a_function_and_what_it_applies_to():
    names = [name for name, _, _ in matrix_scores.SCORES]
    assert len(set(names)) == len(names)
    for _, function, applies in matrix_scores.SCORES:
        assert callable(function) and applies in (matrix_scores.ANY, matrix_scores.LABELLED, matrix_scores.MODELLED)


def test_the_uncorrected_log_matrix_raises_no_zero_and_invents_no_call(bundled_genes):
    raw, labels, batches = bundled_genes
    scores = score_matrix(MatrixInput(sp.csr_matrix(log_cp10k(raw)), raw, labels, batches))
    assert set(scores) == set(matrix_scores.COLUMNS) and np.isnan(scores[matrix_scores.PIT_FAILS])  # no model
    assert scores[matrix_scores.ZEROS_RAISED] == 0.0 and scores[matrix_scores.FALSE_DE_ZERO_RAW] == 0.0
    assert scores[matrix_scores.DETECTION_SPREAD] == pytest.approx(scores[matrix_scores.DETECTION_SPREAD_RAW])
    assert 0.5 < scores[matrix_scores.DETECTION_WITHIN] <= 1.0
    assert scores[matrix_scores.BATCH_DE_CALLS] > 0  # the batches differ: the raw data has calls between them


def test_a_shift_that_fills_one_batchs_zeros_is_seen(bundled_genes):
    """The defect of issue 40: a log-space shift that gives every zero of one batch a small value."""
    raw, labels, batches = bundled_genes
    values = log_cp10k(raw)
    one = batches == "sc_dropseq"
    values[one] += np.random.default_rng(0).uniform(0.05, 0.18, (one.sum(), values.shape[1]))
    honest = score_matrix(MatrixInput(log_cp10k(raw), raw, labels, batches))
    filled = score_matrix(MatrixInput(values, raw, labels, batches))
    zeros = sp.csr_matrix(raw)
    share = one.sum() * raw.shape[1] - zeros[one].nnz
    assert filled[matrix_scores.ZEROS_RAISED] == pytest.approx(share / (np.prod(raw.shape) - zeros.nnz))
    assert filled[matrix_scores.FALSE_DE_ZERO_RAW] > 0
    assert filled[matrix_scores.DETECTION_WITHIN] < honest[matrix_scores.DETECTION_WITHIN]
    assert filled[matrix_scores.DETECTION_SPREAD] > honest[matrix_scores.DETECTION_SPREAD_RAW]


def test_without_labels_only_the_label_free_scores_are_computed(bundled_genes):
    raw, _, batches = bundled_genes
    scores = score_matrix(MatrixInput(log_cp10k(raw), raw, None, batches))
    assert scores[matrix_scores.ZEROS_RAISED] == 0.0
    label_scores = [matrix_scores.DETECTION_WITHIN, matrix_scores.FALSE_DE_ZERO_RAW, matrix_scores.BATCH_DE_CALLS]
    assert all(np.isnan(scores[name]) for name in label_scores)
