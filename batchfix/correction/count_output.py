"""The corrected counts of one set of genes: the modelled genes (the main decoder) or the extra genes (the second
decoder, batchfix.correction.extra_genes), matched to an input's columns.

Each set's counts are mapped by batchfix.correction.counts with the set's decoder: the own batch's mean at the
cell's library of that set's genes, the reference's mean after the shift (the options of the counterfactual
output act on the modelled genes' shift; the extra genes, which have no place in the encoder's genomic order,
take their whole shift), and the dispersions of its decoder.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from batchfix.correction import counterfactual, counts, device_map
from batchfix.correction.lacking_genes import member_mean
from batchfix.correction.library_shift import LibraryShift
from batchfix.correction.stages import StageClock
from batchfix.correction.state_groups import StateGroups
from batchfix.data import ondisk


@dataclass(frozen=True)
class GeneSet:
    """Output genes of one decoder: `model_index` (k,) their index among the decoder's genes and `columns` (k,)
    their input columns (ascending); `present` (decoder genes,) bool: held by the input; `keys` (k,) their names'
    keys for the draws."""

    extra: bool
    model_index: np.ndarray
    columns: np.ndarray
    present: torch.Tensor
    keys: np.ndarray

    def observed(self, rows) -> torch.Tensor:
        """(cells, decoder genes) float32 counts of the input rows in the decoder's gene order (missing: 0)."""
        return torch.from_numpy(ondisk.placed_columns(rows, self.columns, self.model_index, len(self.present)))


def gene_set(genes: list[str], var_names: pd.Index, extra: bool) -> GeneSet | None:
    """The GeneSet of a decoder's `genes` found in `var_names` (first of repeated names), or None if none is."""
    names = pd.Index(var_names).astype(str)
    position = pd.Series(np.arange(len(names)), index=names)[~names.duplicated()]
    columns = position.reindex(genes).fillna(-1).to_numpy(dtype=np.int64)
    held = np.flatnonzero(columns >= 0)
    if len(held) == 0:
        return None
    order = np.argsort(columns[held], kind="stable")
    model_index, file_columns = held[order], columns[held][order]
    return GeneSet(extra, model_index, file_columns, torch.from_numpy(columns >= 0),
                   counts.name_keys(names[file_columns]))


@dataclass(frozen=True)
class CountTables:
    """One gene set's NB tables, float64 (batchfix.correction.estimates): `theta` and `ratio` (codes, decoder
    genes: the training batches', then the unseen batches' estimated from their cells), `reference_ratio`
    (decoder genes,) and `reference_theta` (decoder genes,; None: each count keeps its own batch's dispersion,
    correction.spread=batch); `shift_weight` (codes, decoder genes): the weight of each batch's shift of each gene
    (batchfix.correction.evidence; None: every shift applied in full), and `state_weight` (codes, groups, decoder
    genes) the same by the state group (`state_groups`) of each cell (None: by batch alone); `reference_members`
    (training batches, decoder genes) bool: the batches the average reference of each gene is taken over (None:
    every batch); `depth`: each batch's depth shift to the reference (correction.depth=reference,
    batchfix.correction.library_shift; None: each cell keeps its library), and `lacking` (codes, decoder genes) bool
    the genes a batch lacks as biology (batchfix.correction.lacking_genes): not shifted, not raised by its depth."""

    theta: np.ndarray
    ratio: np.ndarray
    reference_ratio: np.ndarray
    reference_theta: np.ndarray | None
    shift_weight: np.ndarray | None = None
    reference_members: np.ndarray | None = None
    state_weight: np.ndarray | None = None
    state_groups: StateGroups | None = None
    depth: LibraryShift | None = None
    lacking: np.ndarray | None = None

    @functools.cached_property
    def ratio_shift(self) -> np.ndarray:
        """(codes, decoder genes) float64 each batch's ratio shift log(r_ref / r_b), taken once for every cell."""
        return np.log(self.reference_ratio / self.ratio)

    def weight(self, codes: np.ndarray, latents: torch.Tensor) -> np.ndarray | None:
        """(B, decoder genes) the evidence weight of each cell's shift (1 for cells without a batch), or None."""
        if self.shift_weight is None:
            return None
        known, missing = np.maximum(codes, 0), (codes < 0)[:, None]
        chosen = self.shift_weight[known] if self.state_weight is None else \
            self.state_weight[known, self.state_groups.assign(latents)]
        return np.where(missing, 1.0, chosen)


def total_log_shift(tables: CountTables, shift: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """(B, decoder genes) float64: the decoder's log-mean shift plus the batch's ratio shift log(r_ref / r_b) (the
    counts' analogue of the log output's location; 0 for cells without a batch)."""
    known, missing = codes.clamp_min(0).numpy(), (codes < 0).numpy()[:, None]
    ratio_shift = np.where(missing, 0.0, tables.ratio_shift[known])
    return shift.double() + torch.from_numpy(ratio_shift)


@dataclass
class CountDistributions:
    """(B, k) float64 arrays for one forward batch and one gene set's output genes: the observed counts, and the
    NB of each count in its own batch (own_mean, own_theta) and in the reference (ref_mean, ref_theta)."""

    observed: np.ndarray
    own_mean: np.ndarray
    ref_mean: np.ndarray
    own_theta: np.ndarray
    ref_theta: np.ndarray

    def rows(self, picked: np.ndarray) -> CountDistributions:
        """The distributions of the cells at positions `picked` only."""
        return CountDistributions(*(getattr(self, f.name)[picked] for f in dataclasses.fields(self)))

    def reference_nonzero(self) -> np.ndarray:
        """(B, k) P(count > 0) under the reference's NB: the detection the corrected counts should show."""
        p = self.ref_theta / (self.ref_theta + self.ref_mean)
        return -np.expm1(self.ref_theta * np.log(p))

    def own_pit(self, draws: np.ndarray) -> np.ndarray:
        """(B, k) the randomised PIT of the observed counts under their own batch's NB, F(y - 1) + v P(y) with v
        the uniform `draws`: uniform on (0, 1) where the model fits. Small counts by the pmf's recurrence
        (counts.walk_tails), the others by the incomplete beta function."""
        y, theta, mean = (np.ravel(a).astype(np.float64) for a in (self.observed, self.own_theta, self.own_mean))
        p, q = theta / (theta + mean), mean / (theta + mean)
        below, mass = np.empty_like(y), np.empty_like(y)
        walk = (y <= counts.WALK_STEPS) & (theta * np.log(p) > counts.LOG_PMF_FLOOR)
        below[walk], mass[walk] = counts.walk_tails(y[walk], theta[walk], p[walk], q[walk])
        rest = ~walk
        below[rest] = counts.lower_tail(y[rest] - 1.0, theta[rest], p[rest])
        mass[rest] = counts.lower_tail(y[rest], theta[rest], p[rest]) - below[rest]
        return (below + np.ravel(draws) * mass).reshape(np.shape(self.observed))


@torch.no_grad()
def count_distributions(net, genes: GeneSet, tables: CountTables, x: torch.Tensor, mu: torch.Tensor,
                        codes: torch.Tensor, reference: int | None, state=None,
                        regional=None) -> CountDistributions:
    """The own batch's and the reference's NB of the set's output genes for cells with input `x` (B, decoder
    genes), latents `mu` and batch `codes` (the shift after every correction option)."""
    shift, own = counterfactual.log_mean_shift(net, mu, codes, reference, genes.present, genes.extra,
                                               tables.reference_members)
    by_reference_cells = not genes.extra and regional is not None and regional.offset is not None
    if not genes.extra:
        shift = counterfactual.applied_shift(shift, codes, mu, state, None if by_reference_cells else regional)
    total = total_log_shift(tables, shift, codes)
    index, known, missing = genes.model_index, codes.clamp_min(0).numpy(), (codes < 0).numpy()[:, None]
    weight = tables.weight(codes.numpy(), mu)
    if weight is not None:  # each batch's shift of each gene weighted by its evidence
        total = total * torch.from_numpy(weight)
    if by_reference_cells:  # the regional part: the batch's own, from its reference cells (shrunk by its noise)
        total = counterfactual.reference_cell_shift(total, codes, regional)
    if tables.depth is not None:  # the batch's depth, on every gene it has (weighed as one number per batch)
        depth = tables.depth.applied(codes.numpy())  # (B, 1)
        if tables.lacking is not None:
            depth = np.where(tables.lacking[known], 0.0, depth)  # (B, decoder genes)
        total = total + torch.from_numpy(depth)
    ratio = np.where(missing, 1.0, tables.ratio[known][:, index])  # (B, k): the batch's observed / decoded mean
    library = x[:, genes.present].sum(-1, keepdim=True)  # (B, 1): this set's counts in the cell
    own_mean = (own[:, index] * library).double().numpy() * ratio
    ref_mean = own_mean * np.exp(total[:, index].numpy())
    own_theta = tables.theta[known][:, index]
    ref_theta = own_theta if tables.reference_theta is None else np.where(missing, own_theta,
                                                                           tables.reference_theta[index])
    observed = x[:, genes.model_index].double().numpy()
    return CountDistributions(observed, own_mean, ref_mean, own_theta, ref_theta)


def interval_points(seed: int, cell_keys: np.ndarray, gene_keys: np.ndarray) -> torch.Tensor:
    """(cells, genes) float64: where in its own quantile interval each count is taken from, a draw per (seed, cell,
    gene).

    Every count's quantile is drawn, zeros and positives alike, so the mapped counts of a batch follow the reference's
    distribution exactly (a count moves only with the probability the two distributions give it). Taking a positive
    count's middle instead, as ComBat-seq's deterministic mapping does, keeps small counts where they are under a
    small shift and so leaves part of every low-count gene's batch effect: on the platform pair it left 0.58 of the
    within-label between-batch spread where draws leave 0.40 (ComBat 0.39; docs/lab/count-draws.md). Drawn in torch
    over its threads, bit for bit counts.counter_uniform's."""
    return device_map.counter_uniform_torch(seed, cell_keys, gene_keys)


def mapped_counts(net, genes: GeneSet, tables: CountTables, x: torch.Tensor, mu: torch.Tensor, codes: torch.Tensor,
                  cell_keys: np.ndarray, reference: int | None, seed: int, state=None, regional=None, *,
                  clock: StageClock) -> tuple[CountDistributions, np.ndarray]:
    """(the NB of each count, the corrected counts (B, k)) of the set's output genes for cells with input `x` (B,
    decoder genes), latents `mu` and batch `codes`; `clock` times the decoding and the map."""
    with clock.stage("decode"):
        nb = count_distributions(net, genes, tables, x, mu, codes, reference, state, regional)
    with clock.stage("map"):
        uniform = interval_points(seed, cell_keys, genes.keys)
        flat = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64).ravel())
                for a in (nb.observed, nb.own_mean, nb.ref_mean, nb.own_theta, nb.ref_theta)]
        mapped = device_map.quantile_map_torch(*flat, uniform.reshape(-1)).numpy()  # counts.quantile_map's, in torch
    return nb, mapped.reshape(nb.observed.shape)


PIT_BINS = 10  # equal bins of the observed counts' PIT histograms
FIXED_POINT = 2.0**32  # probabilities summed as integers in units of 2^-32: the same sums in any order (shards)


@dataclass
class ModelChecks:
    """The corrected counts checked against the model, summed over the checked cells (the state groups' name-keyed
    sample, state_groups.SAMPLE_CELLS of the input's cells or all of a smaller one) and the modelled genes, for
    batchfix.eval.matrix_scores to score without the model: `pit` (codes, genes, PIT_BINS) histograms of the
    observed counts' randomised PIT under their own batch's NB (uniform where the model fits); per (batch code,
    state group): `cells` (codes, groups) and, per gene (codes, groups, genes), the corrected and the observed
    counts detected (> 0), the sum of each cell's P(count > 0) under its reference NB (the detection they should
    show), the sum of its variance P (1 - P) (both in units of 1 / FIXED_POINT), and the cells detected by a draw
    with that P (what perfectly calibrated counts show)."""

    pit: np.ndarray
    cells: np.ndarray
    detected: np.ndarray
    observed: np.ndarray
    expected: np.ndarray
    variance: np.ndarray
    drawn: np.ndarray

    @classmethod
    def empty(cls, n_codes: int, n_groups: int, n_genes: int) -> ModelChecks:
        per_gene = (n_codes, n_groups, n_genes)
        return cls(np.zeros((n_codes, n_genes, PIT_BINS), dtype=np.int64), np.zeros((n_codes, n_groups), np.int64),
                   *(np.zeros(per_gene, np.int64) for _ in range(5)))

    def __eq__(self, other) -> bool:
        return isinstance(other, ModelChecks) and all(np.array_equal(getattr(self, f.name), getattr(other, f.name))
                                                      for f in dataclasses.fields(self))

    def __add__(self, other: ModelChecks) -> ModelChecks:
        return ModelChecks(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def add(self, codes: np.ndarray, groups: np.ndarray, pit: np.ndarray, nonzero: np.ndarray, observed: np.ndarray,
            corrected: np.ndarray, draws: np.ndarray) -> None:
        """Add cells of batch `codes` (B,) and state `groups` (B,): their PIT values, reference P(count > 0),
        observed and corrected counts and uniform draws (B, genes each)."""
        n_codes, n_groups, n_genes = self.detected.shape
        pair = codes * n_groups + groups  # (B,) each cell's (batch, group)
        by_pair = sp.csr_matrix((np.ones(len(pair)), (pair, np.arange(len(pair)))), shape=(n_codes * n_groups,
                                                                                             len(pair)))
        self.cells += np.bincount(pair, minlength=n_codes * n_groups).reshape(n_codes, n_groups)
        for total, values in ((self.detected, corrected > 0), (self.observed, observed > 0),
                              (self.expected, np.rint(nonzero * FIXED_POINT)),
                              (self.variance, np.rint(nonzero * (1.0 - nonzero) * FIXED_POINT)),
                              (self.drawn, draws < nonzero)):
            total += np.rint(by_pair @ values.astype(np.float64)).astype(np.int64).reshape(total.shape)  # exact
        bins = np.minimum((pit * PIT_BINS).astype(np.int64), PIT_BINS - 1)  # (B, genes)
        slot = (codes[:, None] * n_genes + np.arange(n_genes)) * PIT_BINS + bins  # (B, genes) flat (code, gene, bin)
        self.pit += np.bincount(slot.ravel(), minlength=self.pit.size).reshape(self.pit.shape)

    def record(self, batch_names: list[str], gene_names: list[str]) -> dict:
        """uns[key_added]['model_checks']: the sums by batch name, the (batch, group) pairs with cells as rows."""
        pairs = np.argwhere(self.cells > 0)  # (pairs, 2): batch code, group
        code, group = pairs[:, 0], pairs[:, 1]
        return {"genes": list(gene_names), "batches": list(batch_names), "pit_histograms": self.pit,
                "pair_batch": code, "pair_state_group": group, "pair_cells": self.cells[code, group],
                "detected": self.detected[code, group].astype(np.int32),
                "observed": self.observed[code, group].astype(np.int32),
                "expected": (self.expected[code, group] / FIXED_POINT).astype(np.float32),
                "variance": (self.variance[code, group] / FIXED_POINT).astype(np.float32),
                "drawn": self.drawn[code, group].astype(np.int32)}


def count_tables(trained, genes, count_sums: list[counts.CountSums], reference: int | None, spread: str,
                 members: np.ndarray | None = None) -> CountTables:
    """The gene set's theta and ratio (codes, G: the training batches', then the unseen batches' from `count_sums`)
    and the reference's ratio (G,), float64, the average's over each gene's `members` (training batches, G) bool
    (None: every batch); the reference's theta (G,) with spread=gene, None with spread=batch (each count keeps its
    own batch's dispersion: only the mean moves)."""
    net, tables = trained.net, trained.tables
    decoder = net.extra_decoder if genes.extra else net.decoder
    shared = decoder.log_theta.detach().double().exp().numpy()
    trained_theta = (tables.extra_count_theta if genes.extra else tables.count_theta).double().numpy()
    trained_ratio = (tables.extra_count_ratio if genes.extra else tables.count_ratio).double().numpy()
    theta = np.vstack([trained_theta, *[s.dispersion().theta(shared) for s in count_sums]])
    ratio = np.vstack([trained_ratio, *[s.ratio() for s in count_sums]])
    tiny = np.finfo(np.float64).tiny
    if reference is None:  # the average reference: theta_g, and the geometric mean of the batches' ratios
        reference_theta = shared
        reference_ratio = np.exp(member_mean(np.log(np.maximum(trained_ratio, tiny)), members))
    else:
        reference_theta, reference_ratio = trained_theta[reference], trained_ratio[reference]
    return CountTables(theta, ratio, reference_ratio, None if spread == "batch" else reference_theta,
                       reference_members=members)
