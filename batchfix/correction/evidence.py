"""Evidence-weighted shifts of the corrected counts (correction.shrink=evidence, the default).

Every shift the counts receive is estimated from the data: the decoder's batch terms and the per-batch ratio
calibrated after the fit (an unseen batch's from its own cells). Applied in full, a shift estimated from a few
counts moves counts however little the data support it: on a random split of one batch (nothing to correct) the
corrected counts changed, and a gene absent from a whole batch (a donor's missing chrY) was given to its cells.

So each batch's shift of each gene is weighted by how well the input's cells of that batch measure it, as
ComBat shrinks its location by an empirical-Bayes prior across genes, here centred on no shift:

    s_bg      = the batch's mean total log-mean shift over its input cells (decoder shift + log(r_ref / r_b))
    v_bg      = its sampling variance: the delta method on the batch's total count of the gene,
                1 / (Y_bg + 1/2) + sum_c m_cg^2 / (theta_bg (M_bg + 1/2)^2)   (Poisson part + the NB's excess;
                Y the batch's counts, M = sum_c m_cg and m_cg the model's mean of the count in its own batch)
    tau_b^2   = max(0, mean_g s_bg^2 - mean_g v_bg): the spread of the batch's true shifts across its genes
    lambda_bg = tau_b^2 / (tau_b^2 + v_bg)

and each cell's whole shift of gene g (state-dependent part included) is multiplied by lambda_bg; with reference
cells (correction.normal_key) the regional part is then the batch's own, as its reference cells measured it (shrunk
by its own noise: estimates.regional_offset). A well-measured
shift (v << tau^2) passes unchanged; one within its own noise is not applied; where every shift of a batch is noise
(tau = 0) the batch's counts stay exactly as they were, since a count mapped to its own distribution is its own.
The weights come from the data alone: no tuned constant. Only the counts' shift is weighted (the log-scale model's
output is not).

With the average reference, a training batch that has no count of a gene in any of its cells in the input is left
out of that gene's reference ratio (`detected_reference`): a whole batch without a gene is biology (a female donor's
chrY, a knockout), not a technical effect, and its level would otherwise lower every other batch's counts of it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from batchfix.correction.count_output import CountTables

HALF_COUNT = 0.5  # the pseudo-count of a batch's total, as in its ratio (counts.RATIO_PRIOR_COUNTS)


class ShiftEvidenceSums:
    """Per batch code, over its input cells, for one gene set: the sums of the decoder's log-mean shift, of the
    counts, of the model's own-batch means and of their squares; and the cells counted."""

    def __init__(self, n_codes: int, n_genes: int):
        self.shift = np.zeros((n_codes, n_genes))
        self.counts = np.zeros_like(self.shift)
        self.means = np.zeros_like(self.shift)
        self.mean_squares = np.zeros_like(self.shift)
        self.n_cells = np.zeros(n_codes, dtype=np.int64)

    def add(self, codes: np.ndarray, shift: np.ndarray, counts: np.ndarray, means: np.ndarray) -> None:
        """One forward batch: codes (B,), decoder shift, counts and own-batch means, each (B, genes)."""
        for code in np.unique(codes[codes >= 0]):
            chosen = codes == code
            self.shift[code] += shift[chosen].sum(axis=0)
            self.counts[code] += counts[chosen].sum(axis=0)
            self.means[code] += means[chosen].sum(axis=0)
            self.mean_squares[code] += np.square(means[chosen]).sum(axis=0)
            self.n_cells[code] += int(chosen.sum())

    def detected_reference(self, tables: CountTables, n_training: int, min_cells: int) -> CountTables:
        """The tables with the average reference's ratio of each gene taken over the training batches that detect it
        in the input: a batch with no count of a gene in any of its (at least `min_cells`) cells lacks it as
        biology (a donor's missing chrY, a gene knocked out), which no technical effect makes, so its level does
        not pull down the other batches' reference."""
        absent = (self.counts[:n_training] == 0) & (self.n_cells[:n_training, None] >= min_cells)  # (batches, G)
        kept = ~absent & ~absent.all(axis=0)  # a gene no batch detects keeps every batch
        log_ratio = np.log(np.maximum(tables.ratio[:n_training], np.finfo(np.float64).tiny))
        reference = np.exp((log_ratio * kept).sum(axis=0) / np.maximum(kept.sum(axis=0), 1))
        return dataclasses.replace(tables, reference_ratio=np.where(absent.any(axis=0), reference,
                                                                    tables.reference_ratio))

    def weights(self, tables: CountTables, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """((codes, genes) lambda, (codes,) tau): each batch's weight of each gene's shift (1 for genes the input
        lacks and batches without cells) and its prior's sd over the input's genes."""
        n = np.maximum(self.n_cells, 1)[:, None]
        ratio_shift = np.log(tables.reference_ratio[None, :] / tables.ratio[:len(n)])
        mean_shift = self.shift / n + ratio_shift  # (codes, genes)
        variance = (1.0 / (self.counts + HALF_COUNT)
                    + self.mean_squares / (tables.theta[:len(n)] * np.square(self.means + HALF_COUNT)))
        tau2 = np.maximum(np.square(mean_shift[:, present]).mean(axis=1) - variance[:, present].mean(axis=1), 0.0)
        weight = tau2[:, None] / (tau2[:, None] + variance)
        weight[:, ~present] = 1.0
        weight[self.n_cells == 0] = 1.0
        return weight, np.sqrt(tau2)
