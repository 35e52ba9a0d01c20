"""The counts output's layers of a chunk (batchfix.correction.layers): built from the dense corrected columns and the
input's other genes, they are the canonical CSR scipy itself would give for the same matrix."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from batchfix.correction import layers
from batchfix.data.normalize import log_cp10k


def chunk_and_corrected(n_cells: int, n_genes: int, corrected_share: float, seed: int):
    """A sparse chunk of counts (an explicit zero and a duplicate entry included), the counts it holds (dense), the
    corrected genes' mask and their corrected counts (some rows all zero)."""
    rng = np.random.default_rng(seed)
    dense = rng.poisson(rng.gamma(0.3, 2.0, (n_cells, n_genes))).astype(np.float32)
    chunk = sp.csr_matrix(dense)
    chunk.data[0] = 0.0  # an explicit zero, kept by scipy until eliminated
    chunk = sp.csr_matrix((np.append(chunk.data, 2.0), np.append(chunk.indices, chunk.indices[-1]),
                           np.append(chunk.indptr[:-1], chunk.nnz + 1)), shape=chunk.shape)  # a duplicate entry
    held = np.zeros_like(dense)
    np.add.at(held, (np.repeat(np.arange(n_cells), np.diff(chunk.indptr)), chunk.indices), chunk.data)
    mask = rng.random(n_genes) < corrected_share
    columns = np.flatnonzero(mask)
    corrected = rng.poisson(dense[:, columns] + 0.2).astype(np.float32)
    corrected[::7] = 0.0
    return chunk, held, mask, columns, corrected


@pytest.mark.parametrize("share", [1.0, 0.7, 0.0])
def test_count_layers_hold_the_matrix_in_canonical_form(share):
    chunk, expected, mask, columns, corrected = chunk_and_corrected(60, 45, share, seed=int(share * 10))
    result = layers.count_layers(chunk, corrected, columns, mask)
    counts, log = result["counts"], result["log"]
    expected[:, columns] = corrected  # the corrected genes replaced, every other gene as the input holds it
    np.testing.assert_array_equal(counts.toarray(), expected)
    for layer in (counts, log):
        assert layer.dtype == np.float32 and layer.has_canonical_format
        assert np.all(layer.data != 0)  # no stored zeros
    reference = sp.csr_matrix(expected)  # scipy's own CSR of the same matrix: the same arrays
    np.testing.assert_array_equal(counts.indptr, reference.indptr)
    np.testing.assert_array_equal(counts.indices, reference.indices)
    np.testing.assert_array_equal(log.toarray(), sp.csr_matrix(log_cp10k(sp.csr_matrix(expected)),
                                                               dtype=np.float32).toarray())


def test_dense_rows_place_values_in_their_columns():
    values = np.array([[0, 3, 0], [0, 0, 0], [1, 0, 2]], dtype=np.float32)
    matrix = layers.dense_rows(values, np.array([1, 4, 6]), n_vars=8)
    assert matrix.shape == (3, 8)
    np.testing.assert_array_equal(matrix.indptr, [0, 1, 1, 3])
    np.testing.assert_array_equal(matrix.indices, [4, 1, 6])
    np.testing.assert_array_equal(matrix.data, [3, 1, 2])


def test_rows_where_keeps_each_row_its_own_entries():
    matrix = sp.csr_matrix(np.array([[1, 0, 2], [0, 0, 0], [3, 4, 5]], dtype=np.float32))
    kept = layers.rows_where(matrix, np.array([False, True, True, False, True]))
    np.testing.assert_array_equal(kept.toarray(), [[0, 0, 2], [0, 0, 0], [3, 0, 5]])
    none = layers.rows_where(matrix, np.zeros(matrix.nnz, dtype=bool))
    assert none.nnz == 0 and none.shape == matrix.shape
