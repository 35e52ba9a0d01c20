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
        return sp.csr_matrix(sp.diags(LIBRARY_SIZE / library) @ counts).log1p()
    return np.log1p(np.asarray(counts) * (LIBRARY_SIZE / library)[:, None])
