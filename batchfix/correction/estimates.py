"""What the counterfactual output estimates from the input's own cells before correcting them (`Corrector.prepare`).

- Batches the model never saw: their location and spread (the log output), or their per-gene ratio to the
  average decoder and their dispersion (the corrected counts), from one pass over their cells.
- Every batch's mean shift, for correction.state_dependence < 1 and the regional shift: the mean of the decoder
  term (log output) or of the log-mean shift (counts) over the batch's cells (keep) or over all cells (keep_all;
  keep_input, whose whole change is on the log output's scale, splits the counts' shift as keep_all does);
  with reference cells (correction.normal_key), each batch's regional correction from its normal cells instead
  (`ReferenceCellSums`).
"""
from __future__ import annotations

import logging
from functools import partial

import numpy as np
import torch

from batchfix.correction import calibration, count_output, counterfactual, counts
from batchfix.correction.regional import RegionalShift, genome_smoother

MIN_NORMAL_CELLS = 20  # reference cells a batch needs for its own regional correction (correction.normal_key)
PRIOR_WINDOWS = 5  # windows around a gene over which a reference level's signal is estimated (regional_offset)

log = logging.getLogger(__name__)


def unseen_cells(corrector, rows, n_obs: int):
    """(model input, the count gene sets' inputs, codes) of the cells of unseen batches, chunk by chunk, in
    batches of the forward pass."""
    n_training = corrector.batches.n_training
    for start in range(0, n_obs, corrector.settings.chunk_size):
        stop = min(start + corrector.settings.chunk_size, n_obs)
        codes = corrector.batches.codes[start:stop]
        picked = np.flatnonzero(codes >= n_training)
        if len(picked):
            chunk = rows.rows(start, stop)[picked]
            x = corrector.model_input(chunk, start)
            inputs = [x] + [genes.observed(chunk) for genes in corrector.gene_sets[1:]]
            for begin in range(0, len(picked), corrector.batch_size):
                part = slice(begin, begin + corrector.batch_size)
                yield x[part], [values[part] for values in inputs], codes[picked[part]]


@torch.no_grad()
def estimate_unseen(corrector, rows, n_obs: int) -> None:
    """Set the corrector's `statistics` (log output) and, for the counts, each gene set's unseen batches' ratios
    and the dispersion table of every batch code."""
    n_training, n_genes = corrector.batches.n_training, len(corrector.trained.genes)
    sums = [calibration.ResidualSums(n_genes) for _ in corrector.batches.unseen]
    count_sums = [[counts.CountSums(len(genes.present)) for _ in corrector.batches.unseen]
                  for genes in corrector.gene_sets]
    net, present = corrector.net, corrector.present
    for x, inputs, codes in unseen_cells(corrector, rows, n_obs) if sums else ():
        mu, _ = net.encode(x)
        r = calibration.residual(net, x, mu, None, present).numpy()
        for code in np.unique(codes):
            sums[code - n_training].add(r[codes == code])
        for genes, values, set_sums in zip(corrector.gene_sets, inputs, count_sums):
            mean = (net.mean_fractions(mu, None, genes.present, genes.extra)
                    * values[:, genes.present].sum(-1, keepdim=True)).numpy()
            for code in np.unique(codes):
                set_sums[code - n_training].add(values.numpy()[codes == code], mean[codes == code])
    settings = corrector.settings
    corrector.statistics = calibration.Statistics(corrector.trained.net, corrector.reference, sums, present.numpy(),
                                                  settings.spread, settings.residual_weight)
    for genes, set_sums in zip(corrector.gene_sets, count_sums):
        set_count_tables(corrector.trained.net, genes, set_sums, corrector.reference, settings.spread)


def set_count_tables(net, genes, count_sums: list[counts.CountSums], reference: int | None, spread: str) -> None:
    """The gene set's theta and ratio (codes, G: the training batches', then the unseen batches' from `count_sums`)
    and the reference's ratio (G,), float64; the reference's theta (G,) with spread=gene, None with spread=batch
    (each count keeps its own batch's dispersion: only the mean moves)."""
    decoder = net.extra_decoder if genes.extra else net.decoder
    shared = decoder.log_theta.detach().double().exp().numpy()
    trained_theta = (net.extra_count_theta if genes.extra else net.count_theta).double().numpy()
    trained_ratio = (net.extra_count_ratio if genes.extra else net.count_ratio).double().numpy()
    genes.theta = np.vstack([trained_theta, *[s.dispersion().theta(shared) for s in count_sums]])
    genes.ratio = np.vstack([trained_ratio, *[s.ratio() for s in count_sums]])
    tiny = np.finfo(np.float64).tiny
    if reference is None:  # the average reference: theta_g, and the geometric mean of the batches' ratios
        reference_theta = shared
        genes.reference_ratio = np.exp(np.log(np.maximum(trained_ratio, tiny)).mean(axis=0))
    else:
        reference_theta, genes.reference_ratio = trained_theta[reference], trained_ratio[reference]
    genes.reference_theta = None if spread == "batch" else reference_theta


def batch_terms(corrector, x: torch.Tensor, mu: torch.Tensor, codes: np.ndarray, whole: bool):
    """(the term whose batch means are estimated, the whole change or None) for one forward batch: the decoder
    term and, with `whole`, the floored output's change (log output); the log-mean shift (counts)."""
    code_tensor = torch.from_numpy(codes)
    if corrector.counts_output:
        shift, _ = counterfactual.log_mean_shift(corrector.net, mu, code_tensor, corrector.reference,
                                                 corrector.present)
        return shift.numpy(), None
    values, decoder, observed, _ = counterfactual.output_terms(
        corrector.net, x, mu, code_tensor, corrector.reference, corrector.statistics, corrector.present)
    return decoder.numpy(), (values.clamp_min(0.0).masked_fill(x.eq(0), 0.0) - observed).numpy() if whole else None


@torch.no_grad()
def estimate_mean_shift(corrector, rows, n_obs: int, regional: bool) -> None:
    """Each batch code's mean term over its cells (for state_dependence, counterfactual.StateShrink) and, with
    `regional`, the mean that regional_shift splits against (RegionalShift). The cells' latents are kept
    (`corrector.latents`), so the correction decodes them without encoding again."""
    n_codes = corrector.batches.n_training + len(corrector.batches.unseen)
    mode = corrector.settings.regional_shift if regional else "apply"
    whole = mode == "keep_input" and not corrector.counts_output
    term_sums = np.zeros((n_codes, len(corrector.trained.genes)))
    change_sums = np.zeros_like(term_sums)  # keep_input only
    n_cells = np.zeros(n_codes, dtype=np.int64)
    normal = None
    if regional and corrector.normal is not None:
        normal = (ReferenceCellSums if corrector.counts_output else LogReferenceCellSums)(corrector, n_codes)
    corrector.latents = np.empty((n_obs, corrector.latent_dim), dtype=np.float32)
    for start in range(0, n_obs, corrector.settings.chunk_size):
        stop = min(start + corrector.settings.chunk_size, n_obs)
        x = corrector.model_input(rows.rows(start, stop), start)
        for begin in range(0, stop - start, corrector.batch_size):
            codes = corrector.batches.codes[start + begin:start + min(begin + corrector.batch_size, stop - start)]
            part = x[begin:begin + len(codes)]
            mu, _ = corrector.net.encode(part)  # (B, latent)
            corrector.latents[start + begin:start + begin + len(codes)] = mu.numpy()
            term, change = batch_terms(corrector, part, mu, codes, whole)
            for code in np.unique(codes[codes >= 0]):
                term_sums[code] += term[codes == code].sum(axis=0)
                if change is not None:
                    change_sums[code] += change[codes == code].sum(axis=0)
                n_cells[code] += int((codes == code).sum())
            if normal is not None:
                normal.add(part, torch.from_numpy(term) if corrector.counts_output else mu, codes, start + begin)
    set_mean_shift(corrector, term_sums, change_sums if whole else term_sums, n_cells, mode, regional)
    if normal is not None:
        corrector.regional.offset = normal.offset()


def set_mean_shift(corrector, term_sums: np.ndarray, split_sums: np.ndarray, n_cells: np.ndarray, mode: str,
                   regional: bool) -> None:
    """The corrector's `state` and `regional` from the per-code sums (`estimate_mean_shift`)."""
    settings, n_codes = corrector.settings, len(n_cells)
    estimated = n_cells >= calibration.MIN_UNSEEN_CELLS
    small = [corrector.batch_name(c) for c in np.flatnonzero(~estimated & (n_cells > 0))]
    unmet = [what for what, needed in (
        ("keep no regional part of their shift (regional_shift=keep)", mode == "keep"),
        ("get all of its state dependence (state_dependence < 1)", settings.state_dependence < 1)) if needed]
    if small and unmet:
        log.warning("Batches with fewer than %d cells in the input have no mean shift of their own; their cells "
                    "%s: %s", calibration.MIN_UNSEEN_CELLS, " and ".join(unmet), small)
    batch_mean = term_sums / np.maximum(n_cells, 1)[:, None]  # (codes, G)
    as_tensor = partial(torch.as_tensor, dtype=torch.float32)
    if settings.state_dependence < 1:
        corrector.state = counterfactual.StateShrink(float(settings.state_dependence), as_tensor(batch_mean),
                                                     as_tensor(estimated))
    if not regional:
        return
    if mode == "keep":
        mean_shift = batch_mean
    else:  # one mean over every cell, for every batch
        mean_shift = np.repeat(split_sums.sum(axis=0, keepdims=True) / max(n_cells.sum(), 1), n_codes, axis=0)
        estimated = np.full(n_codes, n_cells.sum() >= calibration.MIN_UNSEEN_CELLS)
    smoother = genome_smoother(list(corrector.trained.module.hparams.chromosome), settings.regional_order,
                               settings.regional_window, settings.regional_seed)
    corrector.regional = RegionalShift(smoother, as_tensor(mean_shift), as_tensor(estimated),
                                       whole=mode == "keep_input" and not corrector.counts_output)


class ReferenceCellSums:
    """Per batch code, over its reference cells (correction.normal_key; corrected counts): their modelled genes'
    counts with the non-regional part of the correction applied (count x exp(shift - its running mean along the
    genome)), their squares and their libraries, from which `offset` gives each batch's regional correction."""

    def __init__(self, corrector, n_codes: int):
        self.corrector = corrector
        self.genes = corrector.gene_sets[0] if corrector.gene_sets else None  # the counts' modelled genes
        settings = corrector.settings
        chromosome = list(corrector.trained.module.hparams.chromosome)
        self.smoother = genome_smoother(chromosome, settings.regional_order, settings.regional_window,
                                        settings.regional_seed)
        self.prior_smoother = genome_smoother(chromosome, settings.regional_order,
                                              settings.regional_window * PRIOR_WINDOWS, settings.regional_seed)
        self.sums = np.zeros((n_codes, len(corrector.trained.genes)))  # per code: counts (log output: levels)
        self.squares = np.zeros_like(self.sums)
        self.library = np.zeros(n_codes)
        self.n_cells = np.zeros(n_codes, dtype=np.int64)

    def add(self, x: torch.Tensor, shift: torch.Tensor, codes: np.ndarray, first_cell: int) -> None:
        """One forward batch: its input `x` (B, G), decoder shift (B, G) and codes, its first cell's row."""
        normal = self.corrector.normal[first_cell:first_cell + len(codes)] & (codes >= 0)
        if not normal.any():
            return
        code_tensor = torch.from_numpy(codes[normal])
        total = count_output.total_log_shift(self.genes, shift[normal], code_tensor)
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
        names = [self.corrector.batch_name(c) for c in range(len(self.n_cells))]
        settings = self.corrector.settings
        log.info("Reference cells (%s of obs column %s) per batch: %s", list(settings.normal_values),
                 settings.normal_key, ", ".join(f"{names[c]} {self.n_cells[c]}" for c in range(len(names))))
        in_input = np.isin(np.arange(len(names)), self.corrector.batches.codes)
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
        normal = self.corrector.normal[first_cell:first_cell + len(codes)] & (codes >= 0)
        if not normal.any():
            return
        corrector = self.corrector
        values, _, observed, _ = counterfactual.output_terms(
            corrector.net, x[normal], mu[normal], torch.from_numpy(codes[normal]), corrector.reference,
            corrector.statistics, corrector.present)
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
