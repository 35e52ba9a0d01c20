"""Each batch's mean shift over its input cells: what the state shrink (correction.state_dependence < 1) draws a
cell's shift toward, by batch or by (batch, state group), and what the regional shift splits against.

The sums are gathered in the estimate pass (batchfix.correction.estimates) and reduced over processes
(batchfix.correction.reduction); `mean_shift` and `group_shrink` turn them into the frozen terms the correction reads.
"""
from __future__ import annotations

import dataclasses
import logging
from functools import partial

import numpy as np
import torch

from batchfix.correction import calibration, counterfactual
from batchfix.correction.regional import RegionalShift, genome_smoother
from batchfix.correction.state_groups import StateGroups

log = logging.getLogger(__name__)
# The regional modes that split a cell's shift against its batch's mean (the others: against the mean over all cells)
BATCH_MEAN_MODES = ("keep", "reference_cells")


class MeanShiftSums:
    """Per batch code, over its cells: the sums of the term whose means the state shrink and the regional shift
    split against, of the whole change (keep_input on the log output), and the cell counts."""

    SUMMED = ("terms", "changes", "n_cells")  # batchfix.correction.reduction adds these

    def __init__(self, n_codes: int, n_genes: int, whole: bool):
        self.terms = np.zeros((n_codes, n_genes))
        self.changes = np.zeros_like(self.terms) if whole else None
        self.n_cells = np.zeros(n_codes, dtype=np.int64)

    def add(self, codes: np.ndarray, term: np.ndarray, change: np.ndarray | None) -> None:
        for code in np.unique(codes[codes >= 0]):
            self.terms[code] += term[codes == code].sum(axis=0)
            if change is not None:
                self.changes[code] += change[codes == code].sum(axis=0)
            self.n_cells[code] += int((codes == code).sum())


def mean_shift(bound, sums: MeanShiftSums, mode: str,
               regional: bool) -> tuple[counterfactual.StateShrink | None, RegionalShift | None]:
    """The state shrink and the regional shift from the per-code sums (`estimate_mean_shift`)."""
    settings, n_cells = bound.settings, sums.n_cells
    n_codes = len(n_cells)
    estimated = n_cells >= calibration.MIN_UNSEEN_CELLS
    small = [bound.batch_name(c) for c in np.flatnonzero(~estimated & (n_cells > 0))]
    unmet = [what for what, needed in (
        (f"keep no regional part of their shift (regional_shift={mode})", mode in BATCH_MEAN_MODES),
        ("get all of its state dependence (state_dependence < 1)", settings.state_dependence < 1)) if needed]
    if small and unmet:
        log.warning("Batches with fewer than %d cells in the input have no mean shift of their own; their cells "
                    "%s: %s", calibration.MIN_UNSEEN_CELLS, " and ".join(unmet), small)
    batch_mean = sums.terms / np.maximum(n_cells, 1)[:, None]  # (codes, G)
    as_tensor = partial(torch.as_tensor, dtype=torch.float32)
    state = None
    if settings.state_dependence < 1:
        state = counterfactual.StateShrink(float(settings.state_dependence), as_tensor(batch_mean),
                                           as_tensor(estimated))
    if not regional:
        return state, None
    if mode in BATCH_MEAN_MODES:
        shift = batch_mean
    else:  # one mean over every cell, for every batch
        split_sums = sums.terms if sums.changes is None else sums.changes
        shift = np.repeat(split_sums.sum(axis=0, keepdims=True) / max(n_cells.sum(), 1), n_codes, axis=0)
        estimated = np.full(n_codes, n_cells.sum() >= calibration.MIN_UNSEEN_CELLS)
    smoother = genome_smoother(list(bound.trained.module.hparams.chromosome), settings.regional_order,
                               settings.regional_window, settings.regional_seed)
    return state, RegionalShift(smoother, as_tensor(shift), as_tensor(estimated),
                                whole=mode == "keep_input" and not bound.counts_output)


def group_shrink(state: counterfactual.StateShrink, sums: MeanShiftSums, group_sums: MeanShiftSums,
                 groups: StateGroups) -> counterfactual.StateShrink:
    """The state shrink toward each batch's mean over its cells of the cell's state group (its batch's mean for a
    group without cells of the batch, which no cell then reads)."""
    n_groups = len(groups.centroids)
    batch_mean = np.repeat(sums.terms / np.maximum(sums.n_cells, 1)[:, None], n_groups, axis=0)  # (codes * K, G)
    group_mean = group_sums.terms / np.maximum(group_sums.n_cells, 1)[:, None]
    mean = np.where(group_sums.n_cells[:, None] > 0, group_mean, batch_mean)
    return dataclasses.replace(state, mean=torch.as_tensor(mean, dtype=torch.float32), groups=groups)
