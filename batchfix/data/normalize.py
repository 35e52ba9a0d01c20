"""The one normalisation batchfix uses everywhere: log1p(counts per 10k).

The encoder's input, the standardisation statistics, the corrected layer's scale and the
uncorrected reference the evaluation compares with are all this transform of raw counts, for
numpy arrays, scipy sparse matrices and torch tensors alike. A cell with no counts stays zero.
"""
from __future__ import annotations

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
        scale = np.repeat(LIBRARY_SIZE / library, np.diff(counts.indptr))  # (nnz,) each entry's row's factor
        result = sp.csr_matrix((np.log1p(counts.data * scale), counts.indices.copy(), counts.indptr.copy()),
                               shape=counts.shape)
        result.eliminate_zeros()
        return result
    return np.log1p(np.asarray(counts) * (LIBRARY_SIZE / library)[:, None])
