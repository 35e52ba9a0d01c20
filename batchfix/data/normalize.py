"""The one normalisation batchfix uses everywhere: log1p(counts per 10k).

The encoder's input, the standardisation statistics, the corrected layer's scale and the
uncorrected reference the evaluation compares with are all this transform of raw counts, for
numpy arrays, scipy sparse matrices and torch tensors alike. A cell with no counts stays zero.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp
import torch

LIBRARY_SIZE = 1e4  # counts per cell of the normalised (and of the corrected) expression


def log_cp10k(counts):
    """log1p(counts / the cell's total * 1e4) of a cells x genes matrix (numpy, scipy sparse -> CSR, or torch)."""
    if isinstance(counts, torch.Tensor):
        return torch.log1p(counts / counts.sum(-1, keepdim=True).clamp_min(1.0) * LIBRARY_SIZE)
    library = np.asarray(counts.sum(axis=1)).ravel().clip(min=1.0)
    if sp.issparse(counts):
        counts = sp.csr_matrix(counts)
        if not counts.has_canonical_format:  # duplicates summed, on a copy: the caller's matrix is left as it is
            counts = counts.copy()
            counts.sum_duplicates()
        result = sp.csr_matrix((sparse_log_values(counts, LIBRARY_SIZE / library), counts.indices.copy(),
                                counts.indptr.copy()), shape=counts.shape)
        result.eliminate_zeros()
        return result
    return np.log1p(np.asarray(counts) * (LIBRARY_SIZE / library)[:, None])


PARALLEL_ENTRIES = 1 << 20  # a CSR with fewer stored entries is transformed in one thread


def sparse_log_values(counts: sp.csr_matrix, factor: np.ndarray) -> np.ndarray:
    """(nnz,) log1p(each stored count x its row's `factor`) of a canonical CSR, in ranges of rows over torch's
    threads (numpy's ufuncs release the GIL): the same values, in the same dtype, as in one thread."""
    indptr = counts.indptr
    values = np.empty(counts.nnz, dtype=np.result_type(counts.data, factor))
    parts = max(1, min(torch.get_num_threads(), counts.nnz // PARALLEL_ENTRIES))
    bounds = np.linspace(0, counts.shape[0], parts + 1).astype(np.int64)  # each part's first row, and the end

    def transform(part: int) -> None:
        first, stop = bounds[part], bounds[part + 1]
        held = slice(indptr[first], indptr[stop])
        np.multiply(counts.data[held], np.repeat(factor[first:stop], np.diff(indptr[first:stop + 1])),
                    out=values[held])  # each entry times its row's factor
        np.log1p(values[held], out=values[held])

    if parts == 1:
        transform(0)
    else:
        with ThreadPoolExecutor(parts) as pool:
            list(pool.map(transform, range(parts)))
    return values
