"""The output layers of one chunk of cells, as CSR rows of the input's full width.

- counts: the corrected counts in the corrected genes' columns, every other gene's count as in the input.
- log: for the counts, normalize_total over all genes (to LIBRARY_SIZE per cell) + log1p of those counts, so it
  sits beside the user's own normalised X; for the denoised and the log-scale outputs, their values in the
  modelled genes' columns (every modelled gene stored in every cell, other genes hold no entries).
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from batchfix.data.normalize import log_cp10k

# What a layer holds, for uns[key]['layers'] (the keys are OutputKeys' names of the layers)
LOG_TRANSFORM = "normalize_total(target_sum=1e4) over all genes, then log1p"


def count_layers(chunk, corrected: np.ndarray, columns: np.ndarray, corrected_mask: np.ndarray) -> dict:
    """{'counts', 'log'} CSR (cells, genes) float32: the chunk's counts with the `columns` (sorted) replaced by
    `corrected` (cells, len(columns)), and their log layer."""
    raw = sp.csr_matrix(chunk, dtype=np.float32)
    raw.sum_duplicates()  # canonical: sorted columns, so the sum below keeps them sorted
    counts = dense_rows(np.asarray(corrected, dtype=np.float32), columns, raw.shape[1])
    kept = ~corrected_mask[raw.indices]  # (nnz,) the other genes' counts, kept as they are
    if kept.any():
        counts = sp.csr_matrix(rows_where(raw, kept) + counts, dtype=np.float32)
        counts.eliminate_zeros()
        counts.sort_indices()
    log = sp.csr_matrix(log_cp10k(counts), dtype=np.float32)
    return {"counts": counts, "log": log}


def dense_rows(values: np.ndarray, columns: np.ndarray, n_vars: int) -> sp.csr_matrix:
    """(cells, n_vars) canonical CSR of the nonzero entries of `values` (cells, len(columns)), placed in the sorted
    `columns`: row by row, columns ascending, as scipy's sum of two canonical matrices gives them."""
    n_cells, width = values.shape
    flat = np.flatnonzero(values)  # (nnz,) positions in the row-major values
    indptr = np.searchsorted(flat, np.arange(n_cells + 1) * width)  # (cells + 1,) entries before each row
    return sp.csr_matrix((values.ravel()[flat], columns[flat % width], indptr), shape=(n_cells, n_vars))


def rows_where(matrix: sp.csr_matrix, keep: np.ndarray) -> sp.csr_matrix:
    """`matrix` with only its entries where `keep` (nnz,) bool is True, every row in place."""
    positions = np.flatnonzero(keep)
    rows = np.searchsorted(matrix.indptr, positions, side="right") - 1  # each kept entry's row
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=matrix.shape[0]))])
    return sp.csr_matrix((matrix.data[positions], matrix.indices[positions], indptr), shape=matrix.shape)


def modelled_layer(values: np.ndarray, columns: np.ndarray, n_vars: int) -> sp.csr_matrix:
    """(cells, n_vars) CSR holding `values` (cells, len(columns)) in the sorted `columns` of every row."""
    n_cells = values.shape[0]
    return sp.csr_matrix((values.ravel(), np.tile(columns, n_cells), np.arange(n_cells + 1) * len(columns)),
                         shape=(n_cells, n_vars), copy=False)
