"""The estimate pass: what a correction reduces from *all* of the input's cells before any row is corrected.

`estimate` runs it over the input and returns one frozen `Estimates`; the output kinds
(batchfix.correction.outputs) then correct any row range from the bound model, the estimates and those rows.

- Batches the model never saw: their location and spread (the log output), or their per-gene ratio to the
  average decoder and their dispersion (the corrected counts), from one pass over their cells.
- Every batch's mean shift, for correction.state_dependence < 1 and the regional shift: the mean of the decoder
  term (log output) or of the log-mean shift (counts) over the batch's cells (keep) or over all cells (keep_all;
  keep_input, whose whole change is on the log output's scale, splits the counts' shift as keep_all does);
  with reference cells (correction.normal_key), each batch's regional correction from its normal cells instead
  (`ReferenceCellSums`).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from batchfix.correction import calibration, count_output, counterfactual, counts
from batchfix.correction.count_output import CountTables
from batchfix.correction.evidence import ShiftEvidenceSums
from batchfix.correction.regional import RegionalShift, genome_smoother
from batchfix.nn.attention import fused_attention

MIN_NORMAL_CELLS = 20  # reference cells a batch needs for its own regional correction (correction.normal_key)
PRIOR_WINDOWS = 5  # windows around a gene over which a reference level's signal is estimated (regional_offset)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Estimates:
    """Everything a correction reduces from all input cells; what correcting any row range reads besides the model.

    statistics: each batch code's location and spread (the counterfactual output; the log output reads them);
    count_tables: one `CountTables` per gene set of the bound model (corrected counts); state: the state shrink
    (state_dependence < 1); regional: the regional shift's smoother and mean shifts (reference cells' offsets
    included); shift_prior_sd: per gene set, each batch code's prior sd of its shifts across genes (the evidence
    weights', batchfix.correction.evidence, held in the tables). None (or empty) where the output does not use it."""

    statistics: calibration.Statistics | None = None
    count_tables: tuple[CountTables, ...] = ()
    shift_prior_sd: tuple[np.ndarray, ...] = ()
    state: counterfactual.StateShrink | None = None
    regional: RegionalShift | None = None

    def summary(self, batch_names: list[str]) -> dict:
        """What was estimated, for uns[key_added]['estimates']; `batch_names` by batch code."""
        shrink = self.state if self.state is not None else self.regional
        with_mean = [] if shrink is None else np.flatnonzero(shrink.estimated.numpy() > 0)
        regional = "none" if self.regional is None else "reference_cells" if self.regional.offset is not None \
            else "whole_change" if self.regional.whole else "decoder_term"
        return {"gene_sets_with_count_tables": len(self.count_tables), "state_shrink": self.state is not None,
                "regional_split": regional, "batches_with_mean_shift": [batch_names[c] for c in with_mean],
                **({"shift_evidence": self.evidence_summary(batch_names)} if self.shift_prior_sd else {})}

    def evidence_summary(self, batch_names: list[str]) -> dict:
        """Per batch: its shifts' prior sd across the modelled genes, and over every corrected gene the median
        weight of its shift and the share of genes whose shift was more than halved (batchfix.correction.evidence)."""
        weights = np.hstack([tables.shift_weight for tables in self.count_tables])  # (codes, all genes)
        return {name: {"prior_sd": round(float(self.shift_prior_sd[0][code]), 4),
                       "median_weight": round(float(np.median(weights[code])), 4),
                       "share_more_than_halved": round(float((weights[code] < 0.5).mean()), 4)}
                for code, name in enumerate(batch_names)}


def estimate(bound, rows, n_obs: int) -> tuple[Estimates, np.ndarray | None]:
    """(the estimates of the bound model's output over the input's `rows`, the (cells, latent) latents the pass
    encoded, or None: a cache the correction may reuse instead of encoding again). Nothing is estimated for the
    denoised output."""
    if bound.settings.output_mode != "counterfactual":
        return Estimates(), None
    regional = bound.settings.regional_shift != "apply"
    if regional and all(c is None for c in bound.trained.module.hparams.chromosome):
        log.info("regional_shift=%s: no modelled gene has genomic coordinates, so no part of the shift is "
                 "regional: all of it is removed (as with regional_shift=apply).", bound.settings.regional_shift)
        regional = False
    with fused_attention(bound.net), torch.no_grad():
        first = estimate_unseen(bound, rows, n_obs)
        evidence = bound.counts_output and bound.settings.shrink == "evidence"
        if regional or bound.settings.state_dependence < 1 or evidence:
            return estimate_mean_shift(bound, first, rows, n_obs, regional)
    return first, None


def unseen_cells(bound, rows, n_obs: int):
    """(model input, the count gene sets' inputs, codes) of the cells of unseen batches, chunk by chunk, in
    batches of the forward pass."""
    n_training = bound.batches.n_training
    for start in range(0, n_obs, bound.settings.chunk_size):
        stop = min(start + bound.settings.chunk_size, n_obs)
        codes = bound.batches.codes[start:stop]
        picked = np.flatnonzero(codes >= n_training)
        if len(picked):
            chunk = rows.rows(start, stop)[picked]
            x = bound.model_input(chunk, start)
            inputs = [x] + [genes.observed(chunk) for genes in bound.gene_sets[1:]]
            for begin in range(0, len(picked), bound.batch_size):
                part = slice(begin, begin + bound.batch_size)
                yield x[part], [values[part] for values in inputs], codes[picked[part]]


def estimate_unseen(bound, rows, n_obs: int) -> Estimates:
    """The statistics (log output) and, for the counts, each gene set's tables: the training batches' from the
    checkpoint, the unseen batches' ratios and dispersions from their cells."""
    n_training, n_genes = bound.batches.n_training, len(bound.trained.genes)
    sums = [calibration.ResidualSums(n_genes) for _ in bound.batches.unseen]
    count_sums = [[counts.CountSums(len(genes.present)) for _ in bound.batches.unseen] for genes in bound.gene_sets]
    net, present = bound.net, bound.present
    for x, inputs, codes in unseen_cells(bound, rows, n_obs) if sums else ():
        mu, _ = net.encode(x)
        r = calibration.residual(net, x, mu, None, present).numpy()
        for code in np.unique(codes):
            sums[code - n_training].add(r[codes == code])
        for genes, values, set_sums in zip(bound.gene_sets, inputs, count_sums):
            mean = (net.mean_fractions(mu, None, genes.present, genes.extra)
                    * values[:, genes.present].sum(-1, keepdim=True)).numpy()
            for code in np.unique(codes):
                set_sums[code - n_training].add(values.numpy()[codes == code], mean[codes == code])
    settings = bound.settings
    statistics = calibration.Statistics(bound.trained.net, bound.reference, sums, present.numpy(), settings.spread,
                                        settings.residual_weight)
    tables = tuple(count_tables(bound.trained.net, genes, set_sums, bound.reference, settings.spread)
                   for genes, set_sums in zip(bound.gene_sets, count_sums))
    return Estimates(statistics=statistics, count_tables=tables)


def count_tables(net, genes, count_sums: list[counts.CountSums], reference: int | None, spread: str) -> CountTables:
    """The gene set's theta and ratio (codes, G: the training batches', then the unseen batches' from `count_sums`)
    and the reference's ratio (G,), float64; the reference's theta (G,) with spread=gene, None with spread=batch
    (each count keeps its own batch's dispersion: only the mean moves)."""
    decoder = net.extra_decoder if genes.extra else net.decoder
    shared = decoder.log_theta.detach().double().exp().numpy()
    trained_theta = (net.extra_count_theta if genes.extra else net.count_theta).double().numpy()
    trained_ratio = (net.extra_count_ratio if genes.extra else net.count_ratio).double().numpy()
    theta = np.vstack([trained_theta, *[s.dispersion().theta(shared) for s in count_sums]])
    ratio = np.vstack([trained_ratio, *[s.ratio() for s in count_sums]])
    tiny = np.finfo(np.float64).tiny
    if reference is None:  # the average reference: theta_g, and the geometric mean of the batches' ratios
        reference_theta = shared
        reference_ratio = np.exp(np.log(np.maximum(trained_ratio, tiny)).mean(axis=0))
    else:
        reference_theta, reference_ratio = trained_theta[reference], trained_ratio[reference]
    return CountTables(theta, ratio, reference_ratio, None if spread == "batch" else reference_theta)


def batch_terms(bound, first: Estimates, x: torch.Tensor, mu: torch.Tensor, codes: np.ndarray, whole: bool):
    """(the term whose batch means are estimated, the whole change or None, the own batch's mean fractions or None)
    for one forward batch: the decoder term and, with `whole`, the floored output's change (log output); the
    log-mean shift and the fractions it came from (counts)."""
    code_tensor = torch.from_numpy(codes)
    if bound.counts_output:
        shift, own = counterfactual.log_mean_shift(bound.net, mu, code_tensor, bound.reference, bound.present)
        return shift.numpy(), None, own
    values, decoder, observed, _ = counterfactual.output_terms(
        bound.net, x, mu, code_tensor, bound.reference, first.statistics, bound.present)
    return decoder.numpy(), (values.clamp_min(0.0).masked_fill(x.eq(0), 0.0) - observed).numpy() if whole else None, \
        None


def add_evidence(bound, first: Estimates, evidence: list[ShiftEvidenceSums], inputs: list[torch.Tensor],
                 mu: torch.Tensor, codes: np.ndarray, modelled: tuple[np.ndarray, torch.Tensor]) -> None:
    """One forward batch's shifts, counts and own-batch means of every count gene set (`inputs`: each set's
    counts, (B, decoder genes)) into its `evidence` sums; `modelled`: the modelled genes' (shift, own fractions),
    already decoded for the mean shift (`batch_terms`)."""
    code_tensor, known = torch.from_numpy(codes), np.maximum(codes, 0)
    for genes, tables, values, sums in zip(bound.gene_sets, first.count_tables, inputs, evidence):
        shift, own = modelled if not genes.extra else counterfactual.log_mean_shift(
            bound.net, mu, code_tensor, bound.reference, genes.present, extra=True)
        library = values[:, genes.present].sum(-1, keepdim=True)  # (B, 1)
        means = (own * library).double().numpy() * tables.ratio[known]
        sums.add(codes, np.asarray(shift, dtype=np.float64), values.double().numpy(), means)


def weighted_tables(bound, first: Estimates, evidence: list[ShiftEvidenceSums]) -> tuple[tuple, tuple]:
    """(each gene set's tables with the shift weights of its evidence, each set's (codes,) prior sd)."""
    if not evidence:
        return first.count_tables, ()
    if bound.reference is None:
        detected = [sums.detected_reference(tables, bound.batches.n_training, calibration.MIN_UNSEEN_CELLS)
                    for tables, sums in zip(first.count_tables, evidence)]
    else:
        detected = list(first.count_tables)
    weighted = [sums.weights(tables, genes.present.numpy(), calibration.MIN_UNSEEN_CELLS)
                for genes, tables, sums in zip(bound.gene_sets, detected, evidence)]
    tables = tuple(dataclasses.replace(t, shift_weight=w) for t, (w, _) in zip(detected, weighted))
    return tables, tuple(tau for _, tau in weighted)


class MeanShiftSums:
    """Per batch code, over its cells: the sums of the term whose means the state shrink and the regional shift
    split against, of the whole change (keep_input on the log output), and the cell counts."""

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


def estimate_mean_shift(bound, first: Estimates, rows, n_obs: int,
                        regional: bool) -> tuple[Estimates, np.ndarray]:
    """`first` with each batch code's mean term over its cells (for state_dependence, counterfactual.StateShrink)
    and, with `regional`, the mean that regional_shift splits against (RegionalShift); and the (cells, latent)
    latents encoded on the way."""
    n_codes = bound.batches.n_training + len(bound.batches.unseen)
    mode = bound.settings.regional_shift if regional else "apply"
    whole = mode == "keep_input" and not bound.counts_output
    sums = MeanShiftSums(n_codes, len(bound.trained.genes), whole)
    normal = None
    if regional and bound.normal is not None:
        normal = (ReferenceCellSums if bound.counts_output else LogReferenceCellSums)(bound, first, n_codes)
    evidence = [ShiftEvidenceSums(n_codes, len(genes.present)) for genes in bound.gene_sets] \
        if bound.counts_output and bound.settings.shrink == "evidence" else []
    latents = np.empty((n_obs, bound.latent_dim), dtype=np.float32)
    for start in range(0, n_obs, bound.settings.chunk_size):
        stop = min(start + bound.settings.chunk_size, n_obs)
        chunk = rows.rows(start, stop)
        x = bound.model_input(chunk, start)
        inputs = [x] + [genes.observed(chunk) for genes in bound.gene_sets[1:]] if evidence else []
        for part, cells in bound.forward_batches(stop - start, start):
            codes = bound.batches.codes[cells]
            mu, _ = bound.net.encode(x[part])  # (B, latent)
            latents[cells] = mu.numpy()
            term, change, own = batch_terms(bound, first, x[part], mu, codes, whole)
            sums.add(codes, term, change)
            if normal is not None:
                normal.add(x[part], torch.from_numpy(term) if bound.counts_output else mu, codes, cells[0])
            if evidence:
                add_evidence(bound, first, evidence, [values[part] for values in inputs], mu, codes, (term, own))
    state, shift = mean_shift(bound, sums, mode, regional)
    if shift is not None and normal is not None:
        shift = dataclasses.replace(shift, offset=normal.offset())
    tables, prior_sd = weighted_tables(bound, first, evidence)
    return dataclasses.replace(first, count_tables=tables, shift_prior_sd=prior_sd, state=state,
                               regional=shift), latents


def mean_shift(bound, sums: MeanShiftSums, mode: str,
               regional: bool) -> tuple[counterfactual.StateShrink | None, RegionalShift | None]:
    """The state shrink and the regional shift from the per-code sums (`estimate_mean_shift`)."""
    settings, n_cells = bound.settings, sums.n_cells
    n_codes = len(n_cells)
    estimated = n_cells >= calibration.MIN_UNSEEN_CELLS
    small = [bound.batch_name(c) for c in np.flatnonzero(~estimated & (n_cells > 0))]
    unmet = [what for what, needed in (
        ("keep no regional part of their shift (regional_shift=keep)", mode == "keep"),
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
    if mode == "keep":
        shift = batch_mean
    else:  # one mean over every cell, for every batch
        split_sums = sums.terms if sums.changes is None else sums.changes
        shift = np.repeat(split_sums.sum(axis=0, keepdims=True) / max(n_cells.sum(), 1), n_codes, axis=0)
        estimated = np.full(n_codes, n_cells.sum() >= calibration.MIN_UNSEEN_CELLS)
    smoother = genome_smoother(list(bound.trained.module.hparams.chromosome), settings.regional_order,
                               settings.regional_window, settings.regional_seed)
    return state, RegionalShift(smoother, as_tensor(shift), as_tensor(estimated),
                                whole=mode == "keep_input" and not bound.counts_output)


class ReferenceCellSums:
    """Per batch code, over its reference cells (correction.normal_key; corrected counts): their modelled genes'
    counts with the non-regional part of the correction applied (count x exp(shift - its running mean along the
    genome)), their squares and their libraries, from which `offset` gives each batch's regional correction."""

    def __init__(self, bound, first: Estimates, n_codes: int):
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
