"""The reference cells' regional correction (regional_shift=reference_cells): each batch's regional level read off its
reference cells in the estimate pass, shrunk by its sampling noise (`regional_offset`), so that the batch's other
cells lose the batch's technical regional profile and keep their own.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from batchfix.correction import count_output, counterfactual
from batchfix.correction.regional import genome_smoother

MIN_NORMAL_CELLS = 20  # reference cells a batch needs for its own regional correction (regional_shift=reference_cells)
PRIOR_WINDOWS = 5  # windows around a gene over which a reference level's signal is estimated (regional_offset)

log = logging.getLogger(__name__)


class ReferenceCellSums:
    """Per batch code, over its reference cells (regional_shift=reference_cells; corrected counts): their modelled
    genes' counts with the non-regional part of the correction applied (count x exp(shift - its running mean along the
    genome)), their squares and their libraries, from which `offset` gives each batch's regional correction."""

    SUMMED = ("sums", "squares", "library", "n_cells")  # batchfix.correction.reduction adds these

    def __init__(self, bound, first, n_codes: int):
        self.bound, self.first = bound, first
        self.tables = first.count_tables[0] if first.count_tables else None  # the counts' modelled genes
        settings = bound.settings
        chromosome = list(bound.trained.module.hparams.chromosome)
        self.smoother = genome_smoother(chromosome, settings.regional_order, settings.regional_window,
                                        settings.regional_seed)
        self.prior_smoother = genome_smoother(chromosome, settings.regional_order,
                                              settings.regional_window * PRIOR_WINDOWS, settings.regional_seed)
        self.sums = np.zeros((n_codes, len(bound.trained.genes)))  # per code: counts (log output: levels)
        self.squares = np.zeros_like(self.sums)
        self.library = np.zeros(n_codes)
        self.n_cells = np.zeros(n_codes, dtype=np.int64)

    def add(self, x: torch.Tensor, shift: torch.Tensor, codes: np.ndarray, first_cell: int) -> None:
        """One forward batch: its input `x` (B, G), decoder shift (B, G) and codes, its first cell's row."""
        normal = self.bound.normal[first_cell:first_cell + len(codes)] & (codes >= 0)
        if not normal.any():
            return
        code_tensor = torch.from_numpy(codes[normal])
        total = count_output.total_log_shift(self.tables, shift[normal], code_tensor)
        corrected = x[normal].double() * torch.exp(total - self.smoother(total))  # (normal cells, G)
        for code in np.unique(codes[normal]):
            chosen = torch.from_numpy(codes[normal] == code)
            self.sums[code] += corrected[chosen].sum(0).numpy()
            self.squares[code] += corrected[chosen].square().sum(0).numpy()
            self.library[code] += float(x[normal][chosen].sum())
            self.n_cells[code] += int(chosen.sum())

    def offset(self) -> torch.Tensor:
        """(codes, G): `regional_offset` of each batch's reference cells' log level (counts per library); its
        sampling variance by the delta method from the cells' own spread (n s^2 / S^2, at least Poisson's 1 / S)."""
        enough = self.enough_cells()
        total, n = self.sums[enough], self.n_cells[enough][:, None]
        level = np.log(total + 0.5) - np.log(np.maximum(self.library[enough], 1.0))[:, None]
        spread = np.maximum(self.squares[enough] - total**2 / n, 0.0) / np.maximum(n - 1, 1)  # per cell
        variance = np.maximum(n * spread / (total + 0.5) ** 2, 1.0 / (total + 0.5))
        return regional_offset(self.smoother, self.prior_smoother, level, variance, enough)

    def enough_cells(self) -> np.ndarray:
        """(codes,) bool: batches with MIN_NORMAL_CELLS reference cells; the counts logged, those without named."""
        enough = self.n_cells >= MIN_NORMAL_CELLS
        names = [self.bound.batch_name(c) for c in range(len(self.n_cells))]
        settings = self.bound.settings
        log.info("Reference cells (%s of obs column %s) per batch: %s", list(settings.normal_values),
                 settings.normal_key, ", ".join(f"{names[c]} {self.n_cells[c]}" for c in range(len(names))))
        in_input = np.isin(np.arange(len(names)), self.bound.batches.codes)
        fallback = [names[c] for c in np.flatnonzero(~enough & in_input)]
        if fallback:
            log.warning("Batches with fewer than %d reference cells: %s; their cells keep their whole regional "
                        "(copy-number-like) profile, technical or not.", MIN_NORMAL_CELLS, fallback)
        return enough


class LogReferenceCellSums(ReferenceCellSums):
    """`ReferenceCellSums` for the log output (a log-scale model): per batch code, the sum (and the sum of squares)
    over its reference cells of their output with the regional part of its change taken out (value - running mean
    of value - input, `counterfactual.without_regional_change`), whose mean is the batch's regional level on the
    output's own scale."""

    def add(self, x: torch.Tensor, mu: torch.Tensor, codes: np.ndarray, first_cell: int) -> None:
        """One forward batch: its input `x` (B, G), latents `mu` (B, latent) and codes, its first cell's row."""
        normal = self.bound.normal[first_cell:first_cell + len(codes)] & (codes >= 0)
        if not normal.any():
            return
        bound = self.bound
        values, _, observed, _ = counterfactual.output_terms(
            bound.net, x[normal], mu[normal], torch.from_numpy(codes[normal]), bound.reference,
            self.first.statistics, bound.present)
        zero = x[normal].eq(0)
        values = values.masked_fill(zero, 0.0)
        level = counterfactual.without_regional_change(values, values - observed, zero,
                                                       self.smoother).double().numpy()  # (normal cells, G)
        for code in np.unique(codes[normal]):
            chosen = codes[normal] == code
            self.sums[code] += level[chosen].sum(axis=0)
            self.squares[code] += np.square(level[chosen]).sum(axis=0)
            self.n_cells[code] += int(chosen.sum())

    def offset(self) -> torch.Tensor:
        """(codes, G): `regional_offset` of the mean level of each batch's reference cells, whose sampling variance
        is their spread over their number."""
        enough = self.enough_cells()
        n = self.n_cells[enough][:, None]
        level = self.sums[enough] / n
        variance = np.maximum(self.squares[enough] / n - level**2, 0.0) / np.maximum(n - 1, 1)
        return regional_offset(self.smoother, self.prior_smoother, level, variance, enough)


def regional_offset(smoother, prior_smoother, level: np.ndarray, variance: np.ndarray,
                    enough: np.ndarray) -> torch.Tensor:
    """(codes, G): minus each batch's regional level (rows of `level`: the batches of `enough`), 0 for the others
    (they keep their cells' whole regional profile, as keep_input does).

    A batch's regional level is the running mean along the genome of its level less the mean over the batches,
    shrunk toward 0 by its sampling noise (local empirical Bayes): times signal / (signal + noise), where noise is
    the running mean's variance from `variance` (each gene's level's, batches independent) and signal the running
    mean over `prior_smoother`'s wider window of its square less that noise, at least 0. A level read off a few
    reference cells is mostly noise and is shrunk toward keeping the cells' own profile; a regional artefact well
    above the noise is removed whole."""
    offset = torch.zeros(len(enough), level.shape[1], dtype=torch.float64)
    if enough.any():
        k = len(level)
        centred_variance = variance * (1.0 - 2.0 / k) + variance.sum(axis=0) / k**2  # of a level less the mean
        estimate = smoother(torch.from_numpy(level - level.mean(axis=0)))  # (batches of enough, G)
        noise = smoother.mean_variance(torch.from_numpy(centred_variance))
        signal = prior_smoother(estimate.square() - noise).clamp_min(0.0)
        offset[torch.from_numpy(enough)] = -estimate * signal / (signal + noise).clamp_min(np.finfo(float).tiny)
    return offset
