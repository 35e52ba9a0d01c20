"""Each batch's sequencing depth brought to the reference's (correction.depth=reference, corrected counts).

The decoder's means are fractions of a cell's library, so every other shift of the corrected counts keeps each
cell's depth: a plate sequenced at half the depth keeps half the counts, fewer detected genes and lumpier log
values, and that batch-wide, technical difference stays in every picture of the corrected layer (on the three
CEL-seq2 plates of the bundled data, whose median libraries differ twofold, k-means split a cell line by plate).
With depth=reference each batch's typical library is moved to the reference's, one term added to every gene's
log-mean shift:

    m_bk      = the mean log library (all of a cell's counts) of batch b's input cells in state group k
    R_k       = the reference's level in group k: the mean of m_jk over the training batches with cells there (the
                average reference), or the reference batch's m_rk
    d_b       = sum_k n_bk (R_k - m_bk) / sum_k n_bk, over the groups where the reference has cells: cells of one
                state are compared with cells of the same state, so a batch rich in cells of a larger type is not
                taken for a deeper one; a group only the batch itself holds adds nothing
    var(d_b)  = its sampling variance, each m_jk's s_jk^2 / n_jk with its covariance with the reference counted

d_b is one number per batch, measured with noise that every gene shares, so it is weighed on its own
(evidence.depth_weights), not by the genes' weights (whose prior takes genes as independent: on a random split of
one batch, a depth difference of 1.5 sds passed through them and changed 2.6 % of the counts). A gene a batch
lacks in every cell (evidence.absent_from_batches) is not given to it by its depth.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class LibrarySums:
    """Per (batch code, state group) code, over its input cells with counts: the sums of the log library and of its
    square, and the cells counted."""

    SUMMED = ("log_library", "log_library_squares", "n_cells")  # batchfix.correction.reduction adds these

    def __init__(self, n_codes: int):
        self.log_library = np.zeros(n_codes)
        self.log_library_squares = np.zeros(n_codes)
        self.n_cells = np.zeros(n_codes, dtype=np.int64)

    def add(self, codes: np.ndarray, rows) -> None:
        """One forward batch: (batch, group) codes (B,), its input rows (B, every column), sparse or dense."""
        library = np.asarray(rows.sum(axis=1), dtype=np.float64).ravel()  # (B,)
        counted = (codes >= 0) & (library > 0)
        log_library = np.log(library, where=counted, out=np.zeros_like(library))
        for code in np.unique(codes[counted]):
            chosen = counted & (codes == code)
            self.log_library[code] += log_library[chosen].sum()
            self.log_library_squares[code] += np.square(log_library[chosen]).sum()
            self.n_cells[code] += int(chosen.sum())


@dataclass(frozen=True)
class LibraryShift:
    """(codes,) each batch code's log depth shift d_b to the reference, its sampling variance (float64), the cells
    it was measured on and the share of it applied (evidence.depth_weights; 1 until weighed)."""

    shift: np.ndarray
    variance: np.ndarray
    cells: np.ndarray
    weight: np.ndarray | None = None

    def applied(self, codes: np.ndarray) -> np.ndarray:
        """(B, 1) float64 each cell's applied depth shift (0 for cells without a batch)."""
        share = np.ones_like(self.shift) if self.weight is None else self.weight
        return np.where(codes >= 0, (self.shift * share)[np.maximum(codes, 0)], 0.0)[:, None]


def library_shift(sums: LibrarySums, n_groups: int, n_training: int, reference: int | None) -> LibraryShift:
    """Each batch code's depth shift from the sums kept by (code * n_groups + group) code (module docstring)."""
    n = sums.n_cells.reshape(-1, n_groups).astype(np.float64)  # (codes, groups)
    safe = np.maximum(n, 1.0)
    level = sums.log_library.reshape(n.shape) / safe
    spread = np.maximum(sums.log_library_squares.reshape(n.shape) / safe - np.square(level), 0.0)
    level_variance = np.where(n > 1, spread / np.maximum(n - 1.0, 1.0), 0.0)  # var(m_bk), the unbiased s^2 / n
    share = np.zeros_like(n)  # each batch's weight in the reference level of each group
    if reference is None:
        members = n[:n_training] > 0
        share[:n_training] = members / np.maximum(members.sum(axis=0), 1)
    else:
        share[reference] = n[reference] > 0
    held = share.sum(axis=0) > 0  # (groups,) the reference has cells there
    reference_level = (share * level).sum(axis=0)
    difference = np.where(held, reference_level - level, 0.0)  # (codes, groups)
    variance = level_variance * (1.0 - 2.0 * share) + (np.square(share) * level_variance).sum(axis=0)
    weight = n * held  # cells compared in each group
    total = np.maximum(weight.sum(axis=1), 1.0)
    return LibraryShift((weight * difference).sum(axis=1) / total,
                        (np.square(weight) * variance).sum(axis=1) / np.square(total), n.sum(axis=1).astype(np.int64))
