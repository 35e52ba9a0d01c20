"""The regional shift of the counterfactual output: the copy-number-like part of a cell's shift, kept.

Regional shift (correction.regional_shift, default keep). The shift the output removes from a cell, delta_c =
decoded_ref(z_c) - decoded_b(z_c), depends on the cell's state, so a state seen in one batch only (a patient's
malignant clone) has part of its own biology taken for batch effect. With `keep`, the output's decoder term
decoded_ref(z_c) - k_b decoded_b(z_c) (delta_c on the output's scale) is split into its batch's mean (per gene, over
the batch's cells in the input: a gene-by-gene technical effect, as ComBat removes) and the cell's deviation from
it; the deviation's running mean over `regional_window` neighbouring modelled genes of its chromosome (genomic
order) is the regional, copy-number-like part, and it is not removed; the rest of delta_c is. `apply` removes the
whole of delta_c. `keep_input` splits the whole change the output makes to the cell (floored output - input: the
decoder term, the location, the scale k_b and the floor together) and takes its deviation from the mean change over
all the input's cells: a cell keeps its input's regional profile up to what the correction changes in every cell, so
a batch's regional shift survives even where its location or spread differs from the others'. The floor is part of
that change: where it raises some of a region's values (a lost segment, mostly zeros, scaled by a batch's k_b > 1),
the regional part of that rise is taken back from the region's other values, so the region's mean keeps its depth
(the output is floored again after). The log output's rule that an input zero stays zero is part of it too: the
regional part leaves through the region's nonzero values alone, each carrying its window's share
(`counterfactual.without_regional_change`); on the corrected counts it splits the log-mean shift against its mean
over all the input's cells. `reference_cells` splits as `keep` does and takes each batch's regional part from its
normal cells (`reference_cells`). ablation.regional_order=shuffled runs the same smoothing over a random gene order
(the ablation: neighbours are then unrelated genes). Unplaced genes have no neighbours: their whole shift is
removed. A batch with fewer than MIN_UNSEEN_CELLS cells in the input has no estimated mean shift: its cells get the
whole shift removed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class GenomeSmoother:
    """Running mean of per-gene values along each chromosome: the regional part of a (cells, genes) tensor.

    chromosome: per modelled gene in the model's (genomic) order, None for unplaced genes (their regional part
    is 0). Each gene's value is the mean over the `window` genes centred on it, cut at its chromosome's ends.
    order: positions are filled by genes[order] before smoothing (a permutation for the shuffled ablation);
    None = the genomic order.
    """

    def __init__(self, chromosome: list, window: int, order: np.ndarray | None = None):
        names = np.array(["" if c is None else str(c) for c in chromosome], dtype=object)
        n = len(names)
        self.order = torch.as_tensor(np.arange(n) if order is None else np.asarray(order), dtype=torch.long)
        run_start = np.zeros(n, dtype=np.int64)
        run_end = np.full(n, n, dtype=np.int64)
        boundaries = np.flatnonzero(names[1:] != names[:-1]) + 1
        for first, stop in zip(np.r_[0, boundaries], np.r_[boundaries, n]):
            run_start[first:stop], run_end[first:stop] = first, stop
        half = window // 2
        position = np.arange(n)
        self.low = torch.as_tensor(np.maximum(position - half, run_start))
        self.high = torch.as_tensor(np.minimum(position - half + window, run_end))
        self.placed = torch.as_tensor(names != "", dtype=torch.float64)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        ordered = values.double()[:, self.order]  # (B, G): position i holds gene order[i]
        cumulative = torch.nn.functional.pad(ordered.cumsum(dim=1), (1, 0))  # (B, G + 1)
        smooth = (cumulative[:, self.high] - cumulative[:, self.low]) / (self.high - self.low) * self.placed
        regional = torch.empty_like(smooth)
        regional[:, self.order] = smooth
        return regional.to(values.dtype)

    def mean_variance(self, variance: torch.Tensor) -> torch.Tensor:
        """(B, G): the variance of each gene's running mean, for independent values with these (B, G) variances."""
        width = torch.empty(len(self.order), dtype=torch.float64)
        width[self.order] = (self.high - self.low).double()  # genes in each gene's window, in gene order
        return self(variance.double()) / width


def genome_smoother(chromosome: list, order: str, window: int, seed: int) -> GenomeSmoother:
    """The smoother of ablation.regional_order=genome, or =shuffled (a random gene order drawn with `seed`)."""
    order = np.random.default_rng(seed).permutation(len(chromosome)) if order == "shuffled" else None
    return GenomeSmoother(chromosome, window, order)


@dataclass
class RegionalShift:
    """What correction.regional_shift=keep|keep_input|reference_cells needs: the smoother and each batch code's mean
    shift.

    mean_shift: (codes, G) mean of the decoder term (`output_terms`) over the batch's input cells (keep,
    reference_cells), or of the whole change over every input cell (keep_input; on the corrected counts, of the
    log-mean shift over every input cell); estimated: (codes,)
    1.0, or 0.0 for a batch with fewer than MIN_UNSEEN_CELLS cells (its cells keep no regional part); whole: the
    shift split is the output's whole change to the cell (keep_input), not its decoder term. offset: (codes, G)
    with reference cells (regional_shift=reference_cells): the regional part of every cell's shift (the counts' log-mean
    shift, the log output's whole change) is replaced by its batch's, taken from its normal cells
    (`reference_cells.ReferenceCellSums`, `reference_cells.LogReferenceCellSums`).
    """

    smoother: GenomeSmoother
    mean_shift: torch.Tensor
    estimated: torch.Tensor
    whole: bool = False
    offset: torch.Tensor | None = None
