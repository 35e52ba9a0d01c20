"""The counterfactual output: each cell's own expression with only what its batch explains removed.

For a cell c of batch b and a modelled gene g, on the log1p(counts per 10k) scale (the input's
scale for data.scale=log):

    r(c, g)   = observed(c, g) - decoded_b(z_c, g)
    corrected = max(0, decoded_ref(z_c, g) + location_ref(g) + k_b * (r(c, g) - location_b(g)))
    k_b       = spread_ref / spread_b

- decoded_b(z_c, g): the decoder's expected expression for the cell's latent z_c in its own batch;
  decoded_ref: the same as the reference (a training batch, or the average over the training
  batches, which is the denoised output). Their difference is the batch effect the model learned
  for that cell's state, so the residual r, which holds what is the cell's own, is carried over.
- location_b(g): the mean residual of gene g over the training cells of batch b. The decoder
  models the mean count, and log1p of a mean is not the mean of log1p: the gap depends on the
  batch's depth and noise, so it is a batch effect the decoder's mean leaves behind.
- spread_b: one number per batch, the root-mean-square over genes of the residual's within-batch
  standard deviation: noisier (shallower) batches would otherwise stay apart from the others.
  One scale per batch, not one per gene, so no gene gains or loses weight against another within
  a batch; the location and scale alone change no comparison made within a batch.
- For the average reference, location_ref is the mean of the training batches' locations and
  spread_ref the root-mean-square of their spreads; for a named reference, that batch's own.
- correction.spread=gene: k_{b,g} = spread_ref(g) / spread_b(g), a spread per gene and batch shrunk
  toward the batch's level (`shrunk_variances`), as ComBat's scale: a gene whose batch holds few cells
  keeps about the batch-wide ratio, one estimated on many cells its own.
- Values that would go below 0 (the floor of the log1p scale) are set to 0 and counted.

State dependence (correction.state_dependence, default 1). With w < 1 the decoder term decoded_ref(z_c) -
k_b decoded_b(z_c) is replaced by its mean over the batch's cells in the input plus w times the cell's deviation
from that mean: w = 0 gives one shift per gene and batch, as ComBat's, which moves within-batch comparisons (DE
ranks, markers) least and mixes least; the regional shift below then splits what is left.

Residual weight (correction.residual_weight, default 1). k_b is multiplied by a weight a in [0, 1], so the
output keeps the share a of each cell's residual: a = 0 gives decoded_ref(z_c) + location_ref (the denoised
output and the reference's location), and between the two the cell's own deviations, noise included, are
shrunk toward what the decoder expects for its state. The decoder term below is then decoded_ref - a k_b decoded_b.

Regional shift (correction.regional_shift, default keep). The shift the output removes from a cell,
delta_c = decoded_ref(z_c) - decoded_b(z_c), depends on the cell's state, so a state seen in one batch
only (a patient's malignant clone) has part of its own biology taken for batch effect. With `keep`, the
output's decoder term decoded_ref(z_c) - k_b decoded_b(z_c) (delta_c on the output's scale) is split
into its batch's mean (per gene, over the batch's cells in the input: a gene-by-gene technical effect,
as ComBat removes) and the cell's deviation from it; the deviation's running mean over `regional_window`
neighbouring modelled genes of its chromosome (genomic order) is the regional, copy-number-like part, and
it is not removed; the rest of delta_c is. `apply` removes the whole of delta_c. `keep_all` takes the
deviation from the mean over all the input's cells instead, so the regional part of a batch's own mean shift is
kept as well (a patient whose cells all carry one CNV). `keep_input` splits the whole change the output makes to
the cell (floored output - input: the decoder term, the location, the scale k_b and the floor together) and takes
its deviation from the mean change over all the input's cells: a cell keeps its input's regional profile up to
what the correction changes in every cell, so a batch's regional shift survives even where its location or
spread differs from the others'. The floor is part of that change: where it raises some of a region's values
(a lost segment, mostly zeros, scaled by a batch's k_b > 1), the regional part of that rise is taken back from
the region's other values, so the region's mean keeps its depth (the output is floored again after).
correction.regional_order=shuffled runs the same smoothing over a random gene order (the ablation: neighbours
are then unrelated genes). Unplaced genes have no neighbours: their whole shift is removed. A batch with fewer
than MIN_UNSEEN_CELLS cells in the input has no estimated mean shift: its cells get the whole shift removed.

Training batches are calibrated once after the fit (`calibrate`), on the training cells (at most
CALIBRATION_CELLS_PER_BATCH per batch), and the statistics travel in the checkpoint
(BatchfixNet.residual_location / residual_spread, and residual_gene_spread / residual_cells for the
per-gene form). A batch the model never saw has no decoder of its
own: the average decoder stands in for decoded_b, and its location and spread are estimated from its
own cells in the input (`ResidualSums`); an unseen batch with fewer than `MIN_UNSEEN_CELLS` cells is
given the denoised output instead.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batchfix.data.prepare import PreparedData, in_order
from batchfix.errors import CheckpointError
from batchfix.nn.attention import fused_attention
from batchfix.nn.network import BatchfixNet
from batchfix.training.module import BatchfixModel, load_trained

log = logging.getLogger(__name__)

MIN_UNSEEN_CELLS = 10  # cells a batch the model never saw needs for its own location and spread
CALIBRATION_BATCH_SIZE = 256  # cells per forward pass while calibrating
# Training cells per batch whose residuals give its location and spread: every cell of a smaller batch, else
# this many drawn at random (the per-gene location's standard error, about sd / 100, is then far below what
# the output can show, and a 1,000,000-cell file calibrates in seconds rather than minutes).
CALIBRATION_CELLS_PER_BATCH = 10_000


class ResidualSums:
    """Per-gene sums of residuals and their squares, for one group of cells (float64)."""

    def __init__(self, n_genes: int):
        self.n_cells = 0
        self.sum = np.zeros(n_genes)
        self.sum_sq = np.zeros(n_genes)

    def add(self, residual: np.ndarray) -> None:
        residual = residual.astype(np.float64, copy=False)
        self.n_cells += residual.shape[0]
        self.sum += residual.sum(axis=0)
        self.sum_sq += np.square(residual).sum(axis=0)

    def location(self) -> np.ndarray:
        return self.sum / max(self.n_cells, 1)

    def variance(self) -> np.ndarray:
        """Per-gene variance (genes,) around the location (maximum likelihood; 0.0 below two cells)."""
        if self.n_cells < 2:
            return np.zeros_like(self.sum)
        return np.clip(self.sum_sq / self.n_cells - np.square(self.location()), 0.0, None)

    def spread(self, genes: np.ndarray | None = None) -> float:
        """Root-mean-square over genes (those of the `genes` mask) of the per-gene standard deviation (0.0
        below two cells)."""
        variance = self.variance()
        return float(np.sqrt(variance.mean() if genes is None else variance[genes].mean()))


@torch.no_grad()
def residual(net: BatchfixNet, x: torch.Tensor, own: torch.Tensor | None,
             present: torch.Tensor | None = None) -> torch.Tensor:
    """observed - decoded in each cell's own batch ((B,) codes), or in the average batch if own is None."""
    mu, _ = net.encode(x)
    return net.log_expression(x) - net.decoded(mu, own, present)


def calibration_cells(batch_index: np.ndarray, n_batches: int, per_batch: int, seed: int = 0) -> np.ndarray:
    """Sorted positions of the cells calibrated: all of a batch with up to `per_batch` cells, else `per_batch`
    of them drawn at random (seeded: the same cells every time)."""
    rng = np.random.default_rng(seed)
    kept = []
    for b in range(n_batches):
        rows = np.flatnonzero(batch_index == b)
        kept.append(rows if len(rows) <= per_batch else rng.choice(rows, per_batch, replace=False))
    return np.sort(np.concatenate(kept))


def calibrated_model(checkpoint: Path, prepared: PreparedData) -> BatchfixModel:
    """A fit's best checkpoint, with its training batches' residual statistics (`calibrate`)."""
    model = load_trained(checkpoint)
    calibrate(model.net, prepared)
    return model


@torch.no_grad()
def calibrate(net: BatchfixNet, prepared: PreparedData) -> None:
    """Store each training batch's residual location and spread in the net (its checkpoint carries them).

    An inference pass over the training cells (at most CALIBRATION_CELLS_PER_BATCH per batch): like correction
    it runs the fused attention kernel (the same values up to float rounding, faster on CPU).
    """
    n_batches = len(prepared.batch_categories)
    sums = [ResidualSums(net.n_genes) for _ in range(n_batches)]
    cells = calibration_cells(prepared.batch_index, n_batches, CALIBRATION_CELLS_PER_BATCH)
    was_training = net.training
    net.eval()
    with fused_attention(net):
        for x, codes in in_order(prepared, CALIBRATION_BATCH_SIZE, cells):  # (B, G), (B,)
            r = residual(net, x, torch.from_numpy(codes)).numpy()
            for b in np.unique(codes):
                sums[b].add(r[codes == b])
    net.train(was_training)
    spreads = np.array([s.spread() for s in sums])
    fallback = np.sqrt(np.mean(np.square(spreads[spreads > 0]))) if (spreads > 0).any() else 1.0
    spreads[spreads <= 0] = fallback  # a batch of one training cell: its residuals keep their scale
    gene_spreads = np.stack([np.sqrt(s.variance()) if s.n_cells >= 2 else np.full(net.n_genes, fallback)
                             for s in sums])  # (batches, G)
    net.residual_gene_spread.copy_(torch.as_tensor(gene_spreads, dtype=torch.float32))
    net.residual_cells.copy_(torch.as_tensor([s.n_cells for s in sums], dtype=torch.float32))
    net.residual_location.copy_(torch.as_tensor(np.stack([s.location() for s in sums]), dtype=torch.float32))
    net.residual_spread.copy_(torch.as_tensor(spreads, dtype=torch.float32))
    log.info("Calibrated the counterfactual output on %d of %d cells (at most %d per batch): residual spread per "
             "batch %s.", len(cells), prepared.n_cells, CALIBRATION_CELLS_PER_BATCH,
             dict(zip(prepared.batch_categories, np.round(spreads, 3).tolist())))


def training_statistics(net: BatchfixNet) -> tuple[np.ndarray, np.ndarray]:
    """(location (batches, genes), spread (batches,)) stored by `calibrate`; refuses an uncalibrated net."""
    spread = net.residual_spread.numpy().astype(np.float64)
    if not (spread > 0).all():
        raise CheckpointError("This checkpoint has no residual calibration, which output_mode=counterfactual "
                              "needs: use the run folder's model.ckpt (or a model from batchfix.train), or "
                              "output_mode=denoised.")
    return net.residual_location.numpy().astype(np.float64), spread


def reference_statistics(location: np.ndarray, spread: np.ndarray, reference: int | None) -> tuple[np.ndarray, float]:
    """The reference's (location, spread): a training batch's own, or the mean location and the
    root-mean-square spread over the training batches for the average reference."""
    if reference is not None:
        return location[reference], float(spread[reference])
    return location.mean(axis=0), float(np.sqrt(np.mean(np.square(spread))))


def inverse_gamma_posterior(ratio: np.ndarray, dof: float, genes: np.ndarray | None = None) -> np.ndarray:
    """Posterior mean of each gene's variance ratio (genes,) estimated with `dof` degrees of freedom, under an
    inverse-gamma prior fitted across genes (those of the `genes` mask) by moments: ComBat's scale estimator.

    With prior mean m and variance s2 over genes, shape a = 2 + m^2 / s2 and rate b = m (a - 1), so the
    posterior mean (b + dof * ratio / 2) / (a - 1 + dof / 2) moves from m (few cells) to the gene's own ratio
    (many cells). No spread across genes, or no degrees of freedom, leaves m for every gene.
    """
    fitted = ratio if genes is None else ratio[genes]
    prior_mean, prior_var = float(fitted.mean()), float(fitted.var())
    if prior_var <= 0 or dof <= 0:
        return np.full_like(ratio, prior_mean)
    shape = 2.0 + prior_mean ** 2 / prior_var
    return (prior_mean * (shape - 1.0) + dof * ratio / 2.0) / (shape - 1.0 + dof / 2.0)


def shrunk_variances(variance: np.ndarray, cells: np.ndarray, n_training: int,
                     genes: np.ndarray | None = None) -> np.ndarray:
    """Each batch's per-gene residual variance (codes, G), estimated on `cells` (codes,), shrunk toward its
    batch's level (`inverse_gamma_posterior`, n - 1 degrees of freedom).

    As ComBat does, a batch's gene variances are first divided by the gene's own level (here the mean over
    the training batches): the prior is on the ratio of a batch's variance to the gene's, which is about
    the same for every gene of a batch, not on raw variances, which differ by orders of magnitude between
    genes. Fully shrunk, every gene of a batch keeps the same ratio: the batch-wide form of k.
    """
    gene_level = np.maximum(variance[:n_training].mean(axis=0), np.finfo(np.float32).tiny)  # (G,)
    ratio = variance / gene_level  # (codes, G)
    shrunk = np.stack([inverse_gamma_posterior(row, n - 1, genes) for row, n in zip(ratio, cells)])
    return shrunk * gene_level


def gene_scales(net: BatchfixNet, reference: int | None, unseen: list[ResidualSums],
                present: np.ndarray | None = None) -> np.ndarray:
    """k_{b,g} = spread_ref(g) / spread_b(g) (codes, G) from the shrunk per-gene spreads (`shrunk_variances`);
    the average reference's spread is the root-mean-square over the training batches, as for one per batch."""
    variance = np.square(net.residual_gene_spread.numpy().astype(np.float64))  # (batches, G)
    cells = net.residual_cells.numpy().astype(np.float64)
    if unseen:  # prior fitted on the genes the input holds: a missing gene's residual means nothing
        variance = np.vstack([variance, [s.variance() for s in unseen]])
        cells = np.concatenate([cells, [s.n_cells for s in unseen]])
    shrunk = shrunk_variances(variance, cells, net.n_batches, present)
    reference_variance = shrunk[:net.n_batches].mean(axis=0) if reference is None else shrunk[reference]
    return np.sqrt(reference_variance / np.maximum(shrunk, np.finfo(np.float32).tiny))


@dataclass
class BatchCodes:
    """Each cell's batch as the counterfactual output treats it.

    codes: (cells,) int32: the training batch's index; n_training + j for the j-th batch of `unseen`
    (a batch the model never saw, whose location and spread are estimated from its cells); -1 for
    the cells of `denoised` (unseen batches with fewer than MIN_UNSEEN_CELLS cells: denoised output).
    """

    codes: np.ndarray
    n_training: int
    unseen: list[str]
    denoised: list[str]


def batch_codes(batch: np.ndarray, training: list[str]) -> BatchCodes:
    """Codes for the cells' batch names (strings), given the model's training batches."""
    names, inverse, counts = np.unique(batch, return_inverse=True, return_counts=True)
    position = {name: i for i, name in enumerate(training)}
    unseen = [n for n, c in zip(names, counts) if n not in position and c >= MIN_UNSEEN_CELLS]
    denoised = [n for n, c in zip(names, counts) if n not in position and c < MIN_UNSEEN_CELLS]
    position.update({name: len(training) + j for j, name in enumerate(unseen)})
    position.update({name: -1 for name in denoised})
    by_name = np.array([position[n] for n in names], dtype=np.int32)
    return BatchCodes(by_name[inverse.ravel()], len(training), [str(n) for n in unseen], [str(n) for n in denoised])


class Statistics:
    """Location (per gene) and scale factor k = residual_weight * spread_ref / spread of every batch code (one per
    batch, or one per gene for spread_by="gene"), and the reference's location."""

    def __init__(self, net: BatchfixNet, reference: int | None, unseen: list[ResidualSums],
                 present: np.ndarray | None = None, spread_by: str = "batch", residual_weight: float = 1.0):
        location, spread = training_statistics(net)
        reference_location, reference_spread = reference_statistics(location, spread, reference)
        if unseen:  # their spread over the genes the input holds: a missing gene's residual means nothing
            location = np.vstack([location, [s.location() for s in unseen]])
            spread = np.concatenate([spread, [s.spread(present) or reference_spread for s in unseen]])
        self.location = torch.as_tensor(location, dtype=torch.float32)  # (codes, G)
        if spread_by == "gene":
            scale = gene_scales(net, reference, unseen, present)  # (codes, G)
        else:
            scale = (reference_spread / spread)[:, None]  # (codes, 1)
        self.scale = torch.as_tensor(residual_weight * scale, dtype=torch.float32)
        self.ref_location = torch.as_tensor(reference_location, dtype=torch.float32)  # (G,)


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


def genome_smoother(chromosome: list, order: str, window: int, seed: int) -> GenomeSmoother:
    """The smoother of correction.regional_order=genome, or =shuffled (a random gene order drawn with `seed`)."""
    order = np.random.default_rng(seed).permutation(len(chromosome)) if order == "shuffled" else None
    return GenomeSmoother(chromosome, window, order)


@dataclass
class RegionalShift:
    """What correction.regional_shift=keep|keep_all|keep_input needs: the smoother and each batch code's mean
    shift.

    mean_shift: (codes, G) mean of the decoder term (`output_terms`) over the batch's input cells (keep) or over
    every input cell (keep_all), or of the whole change over every input cell (keep_input); estimated: (codes,)
    1.0, or 0.0 for a batch with fewer than MIN_UNSEEN_CELLS cells (its cells keep no regional part); whole: the
    shift split is the output's whole change to the cell (keep_input), not its decoder term.
    """

    smoother: GenomeSmoother
    mean_shift: torch.Tensor
    estimated: torch.Tensor
    whole: bool = False


@dataclass
class StateShrink:
    """What correction.state_dependence < 1 needs: the weight w and each batch code's mean decoder term.

    batch_mean: (codes, G) mean of decoded_ref(z) - k_b decoded_b(z) over the batch's input cells; estimated:
    (codes,) 1.0, or 0.0 for a batch with fewer than MIN_UNSEEN_CELLS cells (its cells keep the whole term).
    The decoder term applied is batch_mean + w * (cell's term - batch_mean).
    """

    weight: float
    batch_mean: torch.Tensor
    estimated: torch.Tensor


@torch.no_grad()
def decoded_pair(net: BatchfixNet, mu: torch.Tensor, codes: torch.Tensor, reference: int | None,
                 present: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded as the reference, decoded as each cell's own batch) for latents `mu`; the average decoder stands
    in for batches the model never saw."""
    reference_values = net.decoded(mu, reference, present)
    seen = (codes >= 0) & (codes < net.n_batches)
    own = reference_values if reference is None else net.decoded(mu, None, present)  # unseen: the average
    if seen.any():
        own = own.clone()
        own[seen] = net.decoded(mu[seen], codes[seen].long(), present)
    return reference_values, own


@torch.no_grad()
def output_terms(net: BatchfixNet, x: torch.Tensor, mu: torch.Tensor, codes: torch.Tensor, reference: int | None,
                 stats: Statistics, present: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(values before the floor and the regional shift, decoder term decoded_ref(z) - k_b decoded_b(z), the input
    on the output's scale, decoded as the reference), each (B, G), for cells `x` with latents `mu`."""
    reference_values, own = decoded_pair(net, mu, codes, reference, present)
    known = codes.clamp_min(0).long()
    observed = net.log_expression(x)
    residual = observed - own - stats.location[known]  # (B, G)
    values = reference_values + stats.ref_location + stats.scale[known] * residual
    return values, decoder_term(reference_values, own, stats.scale[known]), observed, reference_values


def decoder_term(reference_values: torch.Tensor, own: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(B, G) decoded_ref(z) - k_b decoded_b(z), with `scale` each cell's k ((B, 1) or (B, G))."""
    return reference_values - scale * own


@torch.no_grad()
def corrected(net: BatchfixNet, x: torch.Tensor, codes: torch.Tensor, reference: int | None, stats: Statistics,
              present: torch.Tensor | None = None, regional: RegionalShift | None = None,
              state: StateShrink | None = None,
              mu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(latent mean, counterfactual values (B, G), how many were raised to 0) for cells with batch `codes`;
    with `state`, only the share `state.weight` of each cell's decoder term's deviation from its batch's mean is
    applied; with `regional`, the regional part of each cell's deviation from the mean shift is left in. `mu`: the
    cells' latent means if already encoded (the encoder, the costly part, then does not run again)."""
    if mu is None:
        mu, _ = net.encode(x)
    values, decoder, observed, reference_values = output_terms(net, x, mu, codes, reference, stats, present)
    known = codes.clamp_min(0).long()
    if state is not None:
        unapplied = (1.0 - state.weight) * (decoder - state.batch_mean[known]) * state.estimated[known, None]
        values, decoder = values - unapplied, decoder - unapplied
    floored = torch.zeros_like(values, dtype=torch.bool)  # raised to 0 before the regional split (keep_input)
    if regional is not None:
        if regional.whole:  # the floor is part of the whole change: its regional part is not applied either
            floored = values.lt(0) & (codes >= 0)[:, None]
            values = values.clamp_min(0.0)
        shift = values - observed if regional.whole else decoder
        deviation = (shift - regional.mean_shift[known]) * regional.estimated[known, None]
        values = values - regional.smoother(deviation)
    values = torch.where((codes < 0)[:, None], reference_values, values)  # too few cells: denoised
    below = values.lt(0) | floored
    n_clipped = int((below if present is None else below[:, present]).sum())
    return mu, values.clamp_min(0.0), n_clipped
