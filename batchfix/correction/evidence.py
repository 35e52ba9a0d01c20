"""Evidence-weighted shifts of the corrected counts (correction.shrink=evidence, the default).

Every shift the counts receive is estimated from the data: the decoder's batch terms and the per-batch ratio
calibrated after the fit (an unseen batch's from its own cells). Applied in full, a shift estimated from a few
counts moves counts however little the data support it: on a random split of one batch (nothing to correct) the
corrected counts changed, and a gene absent from a whole batch (a donor's missing chrY) was given to its cells.

So each batch's shift of each gene is weighted by how well the input's cells of that batch measure it, as
ComBat shrinks its location by an empirical-Bayes prior across genes, here centred on no shift and adaptive
(Stephens 2017's adaptive shrinkage, `shrinkage`):

    s_bg      = the batch's mean total log-mean shift over its input cells (decoder shift + log(r_ref / r_b))
    v_bg      = its sampling variance: of the batch's level, the delta method on its total count of the gene,
                1 / (Y_bg + 1/2) + sum_c m_cg^2 / (theta_bg (M_bg + 1/2)^2)   (Poisson part + the NB's excess;
                Y the batch's counts, M = sum_c m_cg and m_cg the model's mean of the count in its own batch),
                less its covariance with the reference, which holds the batch's own level (`shift_variance`)
    prior     = a mixture of N(0, sigma_k^2) over the batch's genes, sigma_k on a grid from 0 to the largest
                shift, its weights fitted by maximum likelihood to the s_bg given their v_bg
    lambda_bg = median[true shift | s_bg] / s_bg under that prior (0 where no shift is at least as likely as any)

and each cell's whole shift of gene g (state-dependent part included) is multiplied by lambda_bg, or with state
groups (batchfix.correction.state_groups) by the larger of lambda_bg and lambda_bkg, the same over the batch's cells
in the cell's group k (`state_weights`): a shift that changes sign between cell states averages to nothing over the
batch and is measured in each state's cells instead; with reference cells (regional_shift=reference_cells) the
regional part is then the batch's own, as its reference cells measured it (shrunk by its own noise:
reference_cells.regional_offset). A shift far beyond its noise passes nearly whole; one within its noise is not
applied at all, so its counts stay exactly as they were (a count mapped to its own distribution is its own). The
weights come from the data alone: no tuned constant. The log-scale model's output is weighted alike
(`LogShiftEvidenceSums`): each batch's mean change of a gene over its cells, against the sampling variance of that
mean (the batch's residual variance over its cells; its covariance with the reference is not counted there), by
batch alone: weights per state group there, whose variance leaves out the decoder's own noise, changed 19.7 % of a
null split's values where these change 1 % (docs/lab/state-groups.md).

A batch that has no count of a gene in any of its cells in the input lacks it as biology (a female donor's chrY, a
knockout), not as a technical effect: its shift of that gene is not applied (its cells keep their zeros), and with
the average reference it is left out of that gene's reference (`DetectionSums.members`), the decoder's average and
the ratio alike, which its level would otherwise lower for every other batch; a reference batch (correction.reference)
that lacks it shifts no batch's counts of it toward its absence. The lacking genes: batchfix.correction.lacking_genes
(a sex-linked set held at an ambient level too).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch
from scipy import special

from batchfix.correction import calibration, counterfactual, counts
from batchfix.correction.count_output import CountTables
from batchfix.correction.lacking_genes import (
    absent_from_batches,
    lacking_sex_linked,
    set_lacking,
    unless_lacking,
    unshifted,
)
from batchfix.correction.state_groups import group_codes

if TYPE_CHECKING:  # the estimate pass reads this module's sums
    from batchfix.correction.estimates import Estimates

HALF_COUNT = counts.RATIO_PRIOR_COUNTS  # the pseudo-count of a batch's total, as in its ratio
EM_STEPS = 100  # EM iterations of the prior's mixture weights (converged well before on the development sets)
MEDIAN_STEPS = 40  # the posterior median is found to 2^-40 (1e-12) of its interval [0, shift]
DEPTH_PRIOR_SD = 1.0  # the depth shift's prior beside no shift: log depth ratios of about e-fold (depth_weights)


class ShiftEvidenceSums:
    """Per batch code, over its input cells, for one gene set: the sums of the decoder's log-mean shift, of the
    counts, of the model's own-batch means and of their squares; and the cells counted."""

    SUMMED = ("shift", "counts", "means", "mean_squares", "n_cells")  # batchfix.correction.reduction adds these

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

    def shift_variance(self, variance: np.ndarray, reference: int | None, members: np.ndarray) -> np.ndarray:
        """(codes, genes) the sampling variance of each batch's shift, from each batch's level's variance `variance`.

        A shift is the reference's level less the batch's, and the reference is measured on the same data: the
        average reference holds each of its K member batches' levels with weight a_k = 1/K (a reference batch:
        a_r = 1), so var = v_b (1 - 2 a_b) + sum_k a_k^2 v_k. Ignoring that covariance overstated the noise of two
        batches' shifts twofold (a random 2:1 split of one batch: shifts over the old variance had variance 0.4-0.9
        across genes, 1.0-1.2 over this one) and shrank real shifts as noise. A training batch without input cells adds
        nothing (its level is not measured here); the reference batch's own shift is 0 whatever its variance."""
        n_training = members.shape[0]
        share = np.zeros_like(variance)
        if reference is None:
            share[:n_training] = members / members.sum(axis=0)
        else:
            share[reference] = 1.0
        measured = np.where(self.n_cells[:n_training, None] > 0, variance[:n_training], 0.0)
        reference_variance = (np.square(share[:n_training]) * measured).sum(axis=0)
        return np.where(share >= 1.0, variance, variance * (1.0 - 2.0 * share) + reference_variance)

    def weights(self, tables: CountTables, present: np.ndarray, min_cells: int, reference: int | None,
                n_training: int) -> tuple[np.ndarray, np.ndarray]:
        """((codes, genes) lambda, (codes,) the prior's sd): each batch's posterior weight of each gene's shift under
        its adaptive prior (`shrinkage`; 1 for genes the input lacks and batches without cells), and 0 where the
        batch (of at least `min_cells` cells) has no count of the gene at all: a gene absent from a whole batch is
        biology, which no technical shift gives back."""
        n = np.maximum(self.n_cells, 1)[:, None]
        ratio_shift = np.log(tables.reference_ratio[None, :] / tables.ratio[:len(n)])
        mean_shift = self.shift / n + ratio_shift  # (codes, genes)
        level_variance = (1.0 / (self.counts + HALF_COUNT)
                          + self.mean_squares / (tables.theta[:len(n)] * np.square(self.means + HALF_COUNT)))
        members = (np.ones((n_training, len(present)), dtype=bool) if tables.reference_members is None
                   else tables.reference_members)
        variance = self.shift_variance(level_variance, reference, members)
        weight, prior_sd = weights_by_batch(mean_shift, variance, present, np.flatnonzero(self.n_cells > 0))
        weight[absent_from_batches(self.counts, self.n_cells, min_cells) & present[None, :]] = 0.0
        return weight, prior_sd

    def state_group(self, group: int, n_groups: int) -> ShiftEvidenceSums:
        """The sums of one state group, by batch code, from sums kept by group code (code * n_groups + group)."""
        view = copy.copy(self)
        for name in self.SUMMED:
            setattr(view, name, getattr(self, name)[group::n_groups])
        return view

    def state_weights(self, tables: CountTables, present: np.ndarray, reference: int | None, n_training: int,
                      batch_weight: np.ndarray) -> np.ndarray:
        """(codes, groups, genes) the weight of each batch's shift in each state group (`StateGroups`), from these
        sums kept by group code: each group's shifts weighted as a batch's are (`weights`, a prior per batch and
        group), and a cell's shift applied by whichever of its batch's and its group's evidence is the stronger
        (`batch_weight` (codes, genes)), so a shift that changes sign between states, which averages to nothing over
        a batch, is applied where its state measures it. A group without a count of the gene gives it no weight, so
        a gene the batch lacks keeps its batch's 0."""
        n_groups = len(self.n_cells) // len(batch_weight)
        by_group = np.stack([self.state_group(group, n_groups).weights(tables, present, 0, reference, n_training)[0]
                             for group in range(n_groups)], axis=1)  # (codes, groups, genes)
        by_group = np.where(self.n_cells.reshape(-1, n_groups)[:, :, None] > 0, by_group, 0.0)
        return np.maximum(batch_weight[:, None, :], by_group)


def add_evidence(bound, first: Estimates, evidence: list[ShiftEvidenceSums], inputs: list[torch.Tensor],
                 mu: torch.Tensor, codes: np.ndarray, modelled: tuple[np.ndarray, torch.Tensor]) -> None:
    """One forward batch's shifts, counts and own-batch means of every count gene set (`inputs`: each set's
    counts, (B, decoder genes)) into its `evidence` sums; `modelled`: the modelled genes' (shift, own fractions),
    already decoded for the mean shift (`batch_terms`)."""
    code_tensor, known = torch.from_numpy(codes), np.maximum(codes, 0)
    by_group = None if first.state_groups is None else group_codes(codes, first.state_groups, mu)
    for i, (genes, tables, values) in enumerate(zip(bound.gene_sets, first.count_tables, inputs)):
        shift, own = modelled if not genes.extra else counterfactual.log_mean_shift(
            bound.net, mu, code_tensor, bound.reference, genes.present, True, tables.reference_members)
        library = values[:, genes.present].sum(-1, keepdim=True)  # (B, 1)
        means = (own * library).double().numpy() * tables.ratio[known]
        added = (np.asarray(shift, dtype=np.float64), values.double().numpy(), means)
        evidence[i].add(codes, *added)
        if by_group is not None:  # the same, by state group (after every gene set's batch sums)
            evidence[len(inputs) + i].add(by_group, *added)


def weighted_tables(bound, first: Estimates, evidence: list[ShiftEvidenceSums]) -> tuple[tuple, tuple]:
    """(each gene set's tables with the shift weights of its evidence, each set's (codes,) prior sd)."""
    if not evidence:
        return first.count_tables, ()
    n_sets, present = len(bound.gene_sets), [genes.present.numpy() for genes in bound.gene_sets]
    weighted = [sums.weights(tables, chosen, calibration.MIN_UNSEEN_CELLS, bound.reference, bound.batches.n_training)
                for chosen, tables, sums in zip(present, first.count_tables, evidence)]
    by_state = [None] * n_sets if len(evidence) == n_sets else [
        sums.state_weights(tables, chosen, bound.reference, bound.batches.n_training, weight)
        for chosen, tables, sums, (weight, _) in zip(present, first.count_tables, evidence[n_sets:], weighted)]
    gone = [unshifted(t.lacking, bound.reference) for t in first.count_tables]
    tables = tuple(dataclasses.replace(t, shift_weight=unless_lacking(w, lacked), state_groups=first.state_groups,
                                       state_weight=None if state is None else unless_lacking(state, lacked))
                   for t, (w, _), state, lacked in zip(first.count_tables, weighted, by_state, gone))
    return tables, tuple(tau for _, tau in weighted)


class DetectionSums:
    """Per batch code, over its input cells: each input column's counts, and the cells counted (the first pass over
    the input, so that the second knows each gene's reference members)."""

    SUMMED = ("counts", "n_cells")  # batchfix.correction.reduction adds these

    def __init__(self, n_codes: int, n_columns: int):
        self.counts = np.zeros((n_codes, n_columns))
        self.n_cells = np.zeros(n_codes, dtype=np.int64)

    def add(self, codes: np.ndarray, rows) -> None:
        """One forward batch: codes (B,), its input rows (B, columns), sparse or dense."""
        for code in np.unique(codes[codes >= 0]):
            chosen = codes == code
            self.counts[code] += np.asarray(rows[chosen].sum(axis=0)).ravel()
            self.n_cells[code] += int(chosen.sum())

    def lacking(self, min_cells: int, sex_linked: list[np.ndarray]) -> np.ndarray:
        """(codes, columns) bool: the genes each batch (of at least `min_cells` cells) lacks as biology: no count in
        any of its cells, or a sex-linked set it holds at an ambient level (batchfix.correction.lacking_genes)."""
        return (absent_from_batches(self.counts, self.n_cells, min_cells)
                | lacking_sex_linked(self.counts, self.n_cells, sex_linked, min_cells))

    @staticmethod
    def members(genes, lacking: np.ndarray, n_training: int) -> np.ndarray | None:
        """(training batches, decoder genes) bool: the batches the average reference of each of the gene set's genes
        is taken over, those that do not lack it (`lacking`, by input column); every batch for a gene all lack or the
        input lacks. None where every batch is a member for every gene (the decoder's average then needs no mask)."""
        absent = set_lacking(genes, lacking[:n_training])
        members = ~absent | absent.all(axis=0)
        return None if members.all() else members


def weights_by_batch(shift: np.ndarray, variance: np.ndarray, present: np.ndarray,
                     batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((codes, genes) weights, (codes,) prior sds): `shrinkage` of each of `batches`' shifts over the `present`
    genes, a prior per batch; weight 1 and sd 0 elsewhere."""
    weight, prior_sd = np.ones_like(shift), np.zeros(len(shift))
    for code in batches:
        weight[code, present], prior_sd[code] = shrinkage(shift[code, present], variance[code, present])
    return weight, prior_sd


def shrinkage(shift: np.ndarray, variance: np.ndarray, steps: int = EM_STEPS) -> tuple[np.ndarray, float]:
    """((genes,) the applied share of each shift, the prior's sd) for shifts measured with these sampling variances,
    under a prior across genes fitted to them: a mixture of N(0, sigma_k^2) on a grid from 0 (no shift) to the
    largest shift seen, its weights by maximum likelihood (EM), as adaptive shrinkage (Stephens 2017, Biostatistics
    18:275) fits it. The share is the posterior median over the shift (Johnstone & Silverman 2004, Ann. Stat.
    32:1594, empirical-Bayes thresholding): exactly 0 where the data make no shift at least as likely as any, so
    those counts stay as they were, and nearly whole for a shift far beyond its noise. The posterior mean, used
    before, is never 0: under drawn quantiles each such small shift moved a share of the counts of every gene.
    No constant is tuned."""
    spread = np.sqrt(np.maximum(np.square(shift) - variance, 0.0).max(initial=0.0))
    floor = np.sqrt(variance.min(initial=1.0)) / 10
    sigma = np.concatenate([[0.0], floor * np.sqrt(2.0) ** np.arange(int(np.ceil(2 * np.log2(
        max(2 * spread, 2 * floor) / floor))) + 1)])  # (K,)
    total = sigma[None, :] ** 2 + variance[:, None]  # (genes, K)
    log_likelihood = -0.5 * (np.log(2 * np.pi * total) + np.square(shift)[:, None] / total)
    mix = mixture_weights(log_likelihood, steps)
    share = sigma[None, :] ** 2 / total  # (genes, K): each component's posterior mean over the shift
    median = posterior_median(np.abs(shift), variance, share, responsibilities(log_likelihood, mix))
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = np.where(shift != 0, median / np.abs(shift), 0.0)
    return weight, float(np.sqrt((mix * sigma**2).sum()))


def depth_weights(shift: np.ndarray, variance: np.ndarray) -> np.ndarray:
    """(codes,) the applied share of each batch's depth shift (batchfix.correction.library_shift), measured with
    these sampling variances: its posterior median under a prior of even odds between no depth difference and a
    log depth ratio of sd DEPTH_PRIOR_SD (the Bayes factor decides: a difference within about 2.6 sampling sds of
    a few hundred cells is not applied, one of a plate sequenced at another depth passes nearly whole). One number
    per batch, so no prior across batches is fitted, and its noise, shared by every gene, does not enter the genes'
    own weights, whose prior takes genes as independent."""
    measured = variance > 0
    size, sd = np.abs(shift[measured]), np.sqrt(variance[measured])
    sigma = np.array([0.0, DEPTH_PRIOR_SD])
    total = sigma[None, :] ** 2 + np.square(sd)[:, None]
    log_likelihood = -0.5 * (np.log(2 * np.pi * total) + np.square(size)[:, None] / total)
    median = posterior_median(size, np.square(sd), sigma[None, :] ** 2 / total,
                              responsibilities(log_likelihood, np.array([0.5, 0.5])))
    weight = np.zeros_like(shift, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        weight[measured] = np.where(size > 0, median / size, 0.0)
    return weight


def mixture_weights(log_likelihood: np.ndarray, steps: int) -> np.ndarray:
    """(K,) the prior's mixture weights fitted by `steps` EM steps to the (genes, K) log-likelihoods of each gene's
    shift under each component, from equal weights. The likelihoods are taken once, each gene's scaled by its largest
    (its best component's is 1, so no gene's sum underflows: that component's weight falls only while others explain
    the gene), and each step is two products with them: the responsibilities (likelihood x weight over the gene's
    sum) averaged over genes. The same weights as the responsibilities taken in logs each step, to 1e-12."""
    likelihood = np.exp(log_likelihood - log_likelihood.max(axis=1, keepdims=True))  # (genes, K)
    mix = np.full(log_likelihood.shape[1], 1.0 / log_likelihood.shape[1])
    for _ in range(steps):
        density = likelihood @ mix  # (genes,): each gene's scaled marginal likelihood
        mix = mix * (likelihood.T @ (1.0 / density)) / len(density)
    return mix


def posterior_median(size: np.ndarray, variance: np.ndarray, share: np.ndarray, posterior: np.ndarray,
                     steps: int = MEDIAN_STEPS) -> np.ndarray:
    """(genes,) the posterior median of true shifts measured as `size` >= 0: a mixture over the prior's components
    (`posterior` (genes, K) their probabilities) of N(share * size, share * variance), the first the point mass at 0.
    It lies in [0, size]: 0 where P(true shift <= 0) reaches 1/2, else found to 2^-steps of `size` by Newton's
    method on the posterior's distribution function, kept inside the bracket of the root and falling back to
    bisection where a step leaves it or shrinks less than by half (safeguarded Newton, rtsafe of Numerical Recipes):
    2-20 steps a gene where bisection took `steps`."""
    mean, sd = share * size[:, None], np.sqrt(share * variance[:, None])  # (genes, K)
    null, weight, mean, sd = posterior[:, 0], posterior[:, 1:], mean[:, 1:], sd[:, 1:]  # the point mass apart
    searched = np.flatnonzero(null + (weight * special.ndtr(-mean / sd)).sum(axis=1) < 0.5)  # P(true <= 0) < 1/2
    median = np.zeros_like(size, dtype=np.float64)
    state = MedianSearch(searched, null[searched], weight[searched], mean[searched], sd[searched],
                         size[searched].astype(np.float64), steps)
    for _ in range(2 * steps):  # a bisection step at least every other step
        done, value = state.step()
        median[state.index[done]] = value[done]
        if done.all():
            return median
        state.keep(~done)
    median[state.index] = state.middle
    return median


class MedianSearch:
    """The genes still searched by `posterior_median`: their posterior's components (n, K - 1) and the point mass
    (n,), the bracket [low, high] of each median, the current point and the last step's length."""

    def __init__(self, index, null, weight, mean, sd, size, steps: int):
        self.index, self.null, self.weight, self.mean, self.sd = index, null, weight, mean, sd
        self.low, self.high = np.zeros_like(size), size
        self.tolerance = size * 2.0**-steps
        self.middle, self.last = size / 2, size

    def step(self) -> tuple[np.ndarray, np.ndarray]:
        """One step of every gene: (done (n,) bool, the next point (n,)); done where it moved by at most the
        tolerance."""
        z = (self.middle[:, None] - self.mean) / self.sd  # (n, K - 1)
        below = self.null + (self.weight * special.ndtr(z)).sum(axis=1)  # P(true < middle)
        density = (self.weight * np.exp(-0.5 * np.square(z)) / self.sd).sum(axis=1) / np.sqrt(2 * np.pi)
        above = below < 0.5
        self.low, self.high = np.where(above, self.middle, self.low), np.where(above, self.high, self.middle)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            newton = self.middle - (below - 0.5) / density
        taken = (newton >= self.low) & (newton <= self.high) & (np.abs(newton - self.middle) <= self.last / 2)
        following = np.where(taken, newton, (self.low + self.high) / 2)
        self.last = np.abs(following - self.middle)
        self.middle = following
        return self.last <= self.tolerance, following

    def keep(self, chosen: np.ndarray) -> None:
        """Keep searching only the `chosen` genes."""
        for name in ("index", "null", "weight", "mean", "sd", "low", "high", "tolerance", "middle", "last"):
            setattr(self, name, getattr(self, name)[chosen])


def responsibilities(log_likelihood: np.ndarray, mix: np.ndarray) -> np.ndarray:
    """(genes, K) each component's posterior probability for each gene."""
    with np.errstate(divide="ignore"):
        joint = log_likelihood + np.log(mix)[None, :]
    joint -= joint.max(axis=1, keepdims=True)
    probability = np.exp(joint)
    return probability / probability.sum(axis=1, keepdims=True)


class LogShiftEvidenceSums:
    """Per batch code, over its input cells, for the log-scale output: the sums of each gene's change (output less
    input, before the floor) and of its residual (input less the batch's own decoding and location) and its square;
    and the cells counted."""

    SUMMED = ("change", "residual", "residual_squares", "n_cells")  # batchfix.correction.reduction adds these

    def __init__(self, n_codes: int, n_genes: int):
        self.change = np.zeros((n_codes, n_genes))
        self.residual = np.zeros_like(self.change)
        self.residual_squares = np.zeros_like(self.change)
        self.n_cells = np.zeros(n_codes, dtype=np.int64)

    def add(self, codes: np.ndarray, change: np.ndarray, residual: np.ndarray) -> None:
        """One forward batch: codes (B,), each cell's change and residual (B, genes)."""
        for code in np.unique(codes[codes >= 0]):
            chosen = codes == code
            self.change[code] += change[chosen].sum(axis=0)
            self.residual[code] += residual[chosen].sum(axis=0)
            self.residual_squares[code] += np.square(residual[chosen]).sum(axis=0)
            self.n_cells[code] += int(chosen.sum())

    def weights(self, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """((codes, genes) lambda, (codes,) the prior's sd): each batch's weight of each gene's change under its
        adaptive prior (`shrinkage`), the change's sampling variance its residual variance over its cells (1 for
        genes the input lacks and batches with fewer than two cells)."""
        n = self.n_cells[:, None].astype(np.float64)
        mean_change = self.change / np.maximum(n, 1)
        spread = (self.residual_squares - np.square(self.residual) / np.maximum(n, 1)) / np.maximum(n - 1, 1)
        variance = np.maximum(spread, np.finfo(np.float32).eps) / np.maximum(n, 1)
        return weights_by_batch(mean_change, variance, present, np.flatnonzero(self.n_cells > 1))


def log_change_and_residual(first: Estimates, terms: tuple, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, G) each cell's change on the log output before the floor (values - input) and its residual (input less
    its batch's decoding and location), from the output's `terms` (values, input, reference decoding)."""
    values, observed, reference_values = terms
    statistics = first.statistics
    scale = statistics.scale[torch.from_numpy(np.maximum(codes, 0))].clamp_min(torch.finfo(values.dtype).tiny)
    residual = (values - reference_values - statistics.ref_location) / scale  # values = ref + loc_ref + k residual
    return (values - observed).double().numpy(), residual.double().numpy()
