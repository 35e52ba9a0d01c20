"""log1p(counts per 10k) (batchfix.data.normalize): a sparse matrix's values, transformed in ranges of rows over
threads, are those of one thread and of the dense transform, in the input's dtype promotion."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from batchfix.data import normalize


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_sparse_values_in_threads_equal_one_thread(monkeypatch, dtype):
    rng = np.random.default_rng(0)
    dense = rng.poisson(rng.gamma(0.4, 3.0, (301, 57))).astype(dtype)
    dense[5] = 0  # a cell with no counts stays zero
    matrix = sp.csr_matrix(dense)
    monkeypatch.setattr(normalize, "PARALLEL_ENTRIES", 1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = normalize.log_cp10k(matrix)
        torch.set_num_threads(3)
        threaded = normalize.log_cp10k(matrix)
    finally:
        torch.set_num_threads(previous)
    assert threaded.dtype == alone.dtype == np.result_type(dtype, np.float32 if dtype == np.float32 else np.float64)
    np.testing.assert_array_equal(threaded.data, alone.data)
    np.testing.assert_array_equal(threaded.indices, alone.indices)
    np.testing.assert_array_equal(threaded.indptr, alone.indptr)
    np.testing.assert_allclose(threaded.toarray(), normalize.log_cp10k(dense), rtol=1e-6)
    assert threaded.getrow(5).nnz == 0
