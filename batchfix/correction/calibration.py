"""Calibration of the counterfactual output: each training batch's residual location and spread.

Training batches are calibrated once after the fit (`calibrate`), on the training cells (at most
CALIBRATION_CELLS_PER_BATCH per batch), and the statistics travel in the checkpoint
(the model's CalibrationTables, batchfix.training.tables: residual_location / residual_spread, and
residual_gene_spread / residual_cells for the per-gene form). A batch the model never saw has no decoder of its
own: the average decoder stands in for decoded_b, and its location and spread are estimated from its
own cells in the input (`ResidualSums`); an unseen batch with fewer than `MIN_UNSEEN_CELLS` cells is
given the denoised output instead.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from batchfix.correction import counts
from batchfix.correction.lacking_genes import member_mean
from batchfix.data.prepare import PreparedData, in_order
from batchfix.errors import CheckpointError
from batchfix.nn.attention import fused_attention
from batchfix.nn.network import BatchfixNet
from batchfix.training.tables import CalibrationTables
from batchfix.training.trained import BatchfixModel, load_trained

log = logging.getLogger(__name__)

MIN_UNSEEN_CELLS = 10  # cells a batch the model never saw needs for its own location and spread
CALIBRATION_BATCH_SIZE = 256  # cells per forward pass while calibrating
# Training cells per batch whose residuals give its location and spread: every cell of a smaller batch, else
# this many drawn at random (the per-gene location's standard error, about sd / 100, is then far below what
# the output can show, and a 1,000,000-cell file calibrates in seconds rather than minutes).
CALIBRATION_CELLS_PER_BATCH = 10_000


class ResidualSums:
    """Per-gene sums of residuals and their squares, for one group of cells (float64)."""

    SUMMED = ("n_cells", "sum", "sum_sq")  # batchfix.correction.reduction adds these

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
def residual(net: BatchfixNet, x: torch.Tensor, mu: torch.Tensor, own: torch.Tensor | None,
             present: torch.Tensor | None = None) -> torch.Tensor:
    """observed - decoded for cells `x` with latents `mu`, in each cell's own batch ((B,) codes), or in the average
    batch if own is None."""
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
    calibrate(model.net, model.tables, prepared)
    return model


@torch.no_grad()
def calibrate(net: BatchfixNet, tables: CalibrationTables, prepared: PreparedData) -> None:
    """Store each training batch's residual location and spread, dispersions and ratios in `tables` (the
    checkpoint carries them).

    An inference pass over the training cells (at most CALIBRATION_CELLS_PER_BATCH per batch): like correction
    it runs the fused attention kernel (the same values up to float rounding, faster on CPU).
    """
    n_batches = len(prepared.batch_categories)
    sums = [ResidualSums(net.n_genes) for _ in range(n_batches)]
    dispersions = [counts.CountSums(net.n_genes) for _ in range(n_batches)]
    cells = calibration_cells(prepared.batch_index, n_batches, CALIBRATION_CELLS_PER_BATCH)
    was_training = net.training
    net.eval()
    with fused_attention(net):
        for x, codes in in_order(prepared, CALIBRATION_BATCH_SIZE, cells):  # (B, G), (B,)
            mu, _ = net.encode(x)
            own = torch.from_numpy(codes)
            r = residual(net, x, mu, own).numpy()
            for b in np.unique(codes):
                sums[b].add(r[codes == b])
            if net.cfg.likelihood == "nb":
                mean = (net.mean_fractions(mu, own) * x.sum(-1, keepdim=True)).numpy()  # NB means (B, G)
                for b in np.unique(codes):
                    dispersions[b].add(x.numpy()[codes == b], mean[codes == b])
    net.train(was_training)
    if net.cfg.likelihood == "nb":
        shared = net.decoder.log_theta.detach().double().exp().numpy()
        store_count_tables(tables.count_theta, tables.count_ratio, dispersions, shared)
    spreads = np.array([s.spread() for s in sums])
    fallback = np.sqrt(np.mean(np.square(spreads[spreads > 0]))) if (spreads > 0).any() else 1.0
    spreads[spreads <= 0] = fallback  # a batch of one training cell: its residuals keep their scale
    gene_spreads = np.stack([np.sqrt(s.variance()) if s.n_cells >= 2 else np.full(net.n_genes, fallback)
                             for s in sums])  # (batches, G)
    tables.residual_gene_spread.copy_(torch.as_tensor(gene_spreads, dtype=torch.float32))
    tables.residual_cells.copy_(torch.as_tensor([s.n_cells for s in sums], dtype=torch.float32))
    tables.residual_location.copy_(torch.as_tensor(np.stack([s.location() for s in sums]), dtype=torch.float32))
    tables.residual_spread.copy_(torch.as_tensor(spreads, dtype=torch.float32))
    log.info("Calibrated the counterfactual output on %d of %d cells (at most %d per batch): residual spread per "
             "batch %s.", len(cells), prepared.n_cells, CALIBRATION_CELLS_PER_BATCH,
             dict(zip(prepared.batch_categories, np.round(spreads, 3).tolist())))


def store_count_tables(theta: torch.Tensor, ratio: torch.Tensor, sums: list, shared_theta: np.ndarray) -> None:
    """Each training batch's dispersion (shrunk toward `shared_theta`) and ratio into the buffers (batches, G)."""
    theta.copy_(torch.as_tensor(np.stack([s.dispersion().theta(shared_theta) for s in sums]), dtype=torch.float32))
    ratio.copy_(torch.as_tensor(np.stack([s.ratio() for s in sums]), dtype=torch.float32))


def training_statistics(tables: CalibrationTables) -> tuple[np.ndarray, np.ndarray]:
    """(location (batches, genes), spread (batches,)) stored by `calibrate`; refuses uncalibrated tables."""
    spread = tables.residual_spread.numpy().astype(np.float64)
    if not (spread > 0).all():
        raise CheckpointError("This checkpoint has no residual calibration, which output_mode=counterfactual "
                              "needs: use the run folder's model.ckpt (or a model from batchfix.train), or "
                              "output_mode=denoised.")
    return tables.residual_location.numpy().astype(np.float64), spread


def reference_statistics(location: np.ndarray, spread: np.ndarray, reference: int | None,
                         members: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """The reference's (location, spread): a training batch's own, or for the average reference the mean location
    (each gene's over its `members` (batches, G) bool: those that do not lack it; None: every batch) and the
    root-mean-square spread over the training batches."""
    if reference is not None:
        return location[reference], float(spread[reference])
    return member_mean(location, members), float(np.sqrt(np.mean(np.square(spread))))


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


def gene_scales(tables: CalibrationTables, reference: int | None, unseen: list[ResidualSums],
                present: np.ndarray | None = None, members: np.ndarray | None = None) -> np.ndarray:
    """k_{b,g} = spread_ref(g) / spread_b(g) (codes, G) from the shrunk per-gene spreads (`shrunk_variances`);
    the average reference's spread is the root-mean-square over the training batches (each gene's `members`, as
    `reference_statistics`), as for one per batch."""
    variance = np.square(tables.residual_gene_spread.numpy().astype(np.float64))  # (batches, G)
    cells = tables.residual_cells.numpy().astype(np.float64)
    if unseen:  # prior fitted on the genes the input holds: a missing gene's residual means nothing
        variance = np.vstack([variance, [s.variance() for s in unseen]])
        cells = np.concatenate([cells, [s.n_cells for s in unseen]])
    shrunk = shrunk_variances(variance, cells, tables.n_batches, present)
    reference_variance = shrunk[reference] if reference is not None else member_mean(shrunk[:tables.n_batches], members)
    return np.sqrt(reference_variance / np.maximum(shrunk, np.finfo(np.float32).tiny))


class Statistics:
    """Location (per gene) and scale factor k = residual_weight * spread_ref / spread of every batch code (one per
    batch, or one per gene for spread_by="gene"), and the reference's location; `members` (batches, G) bool, the
    batches each gene's average reference is taken over (None: every batch; batchfix.correction.lacking_genes)."""

    def __init__(self, tables: CalibrationTables, reference: int | None, unseen: list[ResidualSums],
                 present: np.ndarray | None = None, spread_by: str = "batch", residual_weight: float = 1.0,
                 members: np.ndarray | None = None):
        location, spread = training_statistics(tables)
        reference_location, reference_spread = reference_statistics(location, spread, reference, members)
        self.members = None if members is None else torch.as_tensor(members, dtype=torch.float32)  # (batches, G)
        if unseen:  # their spread over the genes the input holds: a missing gene's residual means nothing
            location = np.vstack([location, [s.location() for s in unseen]])
            spread = np.concatenate([spread, [s.spread(present) or reference_spread for s in unseen]])
        self.location = torch.as_tensor(location, dtype=torch.float32)  # (codes, G)
        if spread_by == "gene":
            scale = gene_scales(tables, reference, unseen, present, members)  # (codes, G)
        else:
            scale = (reference_spread / spread)[:, None]  # (codes, 1)
        self.scale = torch.as_tensor(residual_weight * scale, dtype=torch.float32)
        self.ref_location = torch.as_tensor(reference_location, dtype=torch.float32)  # (G,)
