"""Gene-level fidelity of a corrected expression matrix, judged as a matrix.

Users run differential expression and marker plots on corrected expression, so beside the scIB
embedding scores (`batchfix.eval.metrics`) the corrected matrix is compared gene by gene with a
reference that holds no batch effect: log1p(counts per 10k) of the *uncorrected* counts
(`batchfix.data.normalize.log_cp10k`; a cell's library size is its sum over the genes given), with
every comparison made **within one batch**. All four scores are 1.0 for the reference itself.

- **DE-rank agreement**: for each label and each batch holding >= `MIN_CELLS_DE` cells of the
  label and >= `MIN_CELLS_DE` other cells, the per-gene difference mean(label) - mean(rest) of the
  log values over that batch's cells; these differences are averaged (unweighted) over the
  qualifying batches. The same is done for the corrected matrix on the same cells, batches and
  averaging, so only the per-gene signal differs between the two. Score: Spearman correlation of
  the corrected with the reference differences, averaged over the labels with >= 1 qualifying
  batch.
- **Marker recall**: for the same labels and differences, |top-`N_MARKERS` genes by reference
  difference & top-`N_MARKERS` by corrected difference| / `N_MARKERS` (largest positive
  differences = up-regulated markers), averaged over labels.
- **Within-type 10-NN kept**: for each (batch, label) group of >= `MIN_CELLS_GROUP` cells, the
  `N_NEIGHBORS`-nearest-neighbour sets (Euclidean, the cell itself excluded) on an `N_PCS`-
  component PCA of the group's reference values vs on an `N_PCS`-component PCA of the same
  cells' corrected values; Jaccard index of the two sets per cell, averaged over the group's
  cells, then an unweighted mean over groups (each group counts once, whatever its size).
- **HVG conservation**: per batch (>= 2 cells), |top-`N_HVG` genes by variance over the batch's
  cells in the reference & top-`N_HVG` in the corrected values| / `N_HVG` (or / the number of
  genes if fewer), averaged over batches.

Without labels only HVG conservation (label-free) is computed; the other three are None and the
result's `note` says why. A per-batch constant shift of the corrected values (any per-gene vector
per batch) leaves every score unchanged (up to rounding), since everything is compared within a
batch; a corrected matrix whose values are shuffled across cells scores near 0 on DE-rank
agreement and neighbours.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.stats import rankdata
from sklearn.decomposition import PCA
from sklearn.neighbors import NearestNeighbors

from batchfix.data.io import count_bad_values
from batchfix.data.normalize import LIBRARY_SIZE, log_cp10k

MIN_CELLS_DE = 10  # cells of the label, and other cells, a batch needs for a DE comparison
MIN_CELLS_GROUP = 30  # cells a (batch, label) group needs for the neighbour comparison
N_MARKERS = 50
N_PCS = 10
N_NEIGHBORS = 10
N_HVG = 200
# Per-group PCA: LAPACK's full SVD up to this min(cells, genes), ARPACK's top components above (the same
# components to solver tolerance, 4x faster for 800 cells x 2,000 genes; a randomized SVD was faster still
# but kept only 9% of the 10-NN on noisy data, whose trailing components are close in variance).
FULL_SVD_MAX = 200

DE_RANK = "DE-rank agreement"
MARKER_RECALL = "Marker recall"
WITHIN_TYPE = "Within-type 10-NN kept"
HVG_CONSERVATION = "HVG conservation"
GENE_METRICS = [DE_RANK, MARKER_RECALL, WITHIN_TYPE, HVG_CONSERVATION]
LABEL_METRICS = [DE_RANK, MARKER_RECALL, WITHIN_TYPE]

NO_LABELS_NOTE = (
    "No labels: DE-rank agreement, marker recall and within-type neighbours were not computed "
    "(they compare a label with the rest, or cells within a label); only the label-free HVG "
    "conservation is reported."
)


@dataclass(frozen=True)
class Thresholds:
    """The sizes the definitions use (module constants by default)."""

    min_cells_de: int = MIN_CELLS_DE
    min_cells_group: int = MIN_CELLS_GROUP
    n_markers: int = N_MARKERS
    n_pcs: int = N_PCS
    n_neighbors: int = N_NEIGHBORS
    n_hvg: int = N_HVG

    def __post_init__(self):
        for name, value in asdict(self).items():
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}.")
        if self.min_cells_group < 2:
            raise ValueError(f"min_cells_group must be >= 2 (a cell needs a neighbour); got {self.min_cells_group}.")


@dataclass
class WithinBatch:
    """What the pass over batches collects: HVG overlaps, DE difference sums, neighbour scores."""

    hvg_per_batch: dict[str, float] = field(default_factory=dict)
    de_sum_ref: dict[str, np.ndarray] = field(default_factory=dict)
    de_sum_cor: dict[str, np.ndarray] = field(default_factory=dict)
    de_batches: dict[str, list[str]] = field(default_factory=dict)
    group_scores: dict[str, float] = field(default_factory=dict)


def gene_fidelity(counts, corrected, batch: Sequence, labels: Sequence | None = None, *,
                  require_integer_counts: bool = True, library: np.ndarray | None = None, **thresholds) -> dict:
    """Score `corrected` (cells x genes, log scale) against the within-batch reference of `counts`.

    `counts`: raw counts of the same cells and genes (dense or sparse; whole numbers unless
    `require_integer_counts=False`). `library`: each cell's count total the reference is normalised by (e.g. over
    all genes, as a layer made by normalize_total over all genes is); by default the sum over `counts`' genes.
    `batch`, `labels`: one entry per cell. `thresholds`: fields of
    `Thresholds` (min_cells_de, min_cells_group, n_markers, n_pcs, n_neighbors, n_hvg). Returns a
    JSON-able dict: the four scores under `GENE_METRICS` (None where not computed), how many labels,
    groups and batches were scored, per-label and per-batch values, the parameters, and a `note`
    naming what was not computed and why (absent when everything was). See the module docstring
    for the definitions. Bad input raises ValueError naming the problem.
    """
    params = Thresholds(**thresholds)
    counts, corrected = _check_matrices(counts, corrected, require_integer_counts)
    n_cells, n_genes = counts.shape
    batch = _check_labels(batch, n_cells, "batch")
    labels = None if labels is None else _check_labels(labels, n_cells, "labels")
    k_markers, k_hvg = min(params.n_markers, n_genes), min(params.n_hvg, n_genes)
    within = _within_batch(counts, corrected, batch, labels, params, k_hvg, library)
    per_label, flat_reference = _label_scores(within, k_markers)
    result = {
        DE_RANK: _mean([v[DE_RANK] for v in per_label.values()]),
        MARKER_RECALL: _mean([v[MARKER_RECALL] for v in per_label.values()]),
        WITHIN_TYPE: _mean(list(within.group_scores.values())),
        HVG_CONSERVATION: _mean(list(within.hvg_per_batch.values())),
        "n_cells": int(n_cells),
        "n_genes": int(n_genes),
        "n_labels_scored": len(per_label),
        "n_groups_scored": len(within.group_scores),
        "n_batches_scored": len(within.hvg_per_batch),
        "labels_given": labels is not None,
        "per_label": per_label,
        "per_group": within.group_scores,
        "per_batch": within.hvg_per_batch,
        "parameters": {**asdict(params), "n_markers": int(k_markers), "n_hvg": int(k_hvg)},
    }
    notes = _notes(within, per_label, flat_reference, labels, params)
    if notes:
        result["note"] = " ".join(notes)
    return result


def _within_batch(counts, corrected, batch: np.ndarray, labels: np.ndarray | None, params: Thresholds,
                  k_hvg: int, library: np.ndarray | None = None) -> WithinBatch:
    """One pass over batches: everything is compared within a batch, never across."""
    within = WithinBatch()
    for b in pd.unique(batch):
        rows = np.flatnonzero(batch == b)
        block = _dense_rows(counts, rows)
        ref = log_cp10k(block) if library is None else np.log1p(
            block * (LIBRARY_SIZE / np.maximum(np.asarray(library, dtype=np.float64)[rows], 1.0))[:, None])
        cor = _dense_rows(corrected, rows)
        if len(rows) >= 2:
            within.hvg_per_batch[b] = _top_overlap(ref.var(axis=0), cor.var(axis=0), k_hvg)
        if labels is None:
            continue
        cell_labels = labels[rows]
        for label in pd.unique(cell_labels):
            in_label = cell_labels == label
            n_in = int(in_label.sum())
            if n_in >= params.min_cells_de and len(rows) - n_in >= params.min_cells_de:
                for sums, values in ((within.de_sum_ref, ref), (within.de_sum_cor, cor)):
                    diff = values[in_label].mean(axis=0) - values[~in_label].mean(axis=0)
                    sums[label] = sums.get(label, 0.0) + diff
                within.de_batches.setdefault(label, []).append(b)
            if n_in >= params.min_cells_group:
                within.group_scores[f"{b} / {label}"] = _neighbours_kept(
                    ref[in_label], cor[in_label], params.n_pcs, params.n_neighbors)
    return within


def _label_scores(within: WithinBatch, k_markers: int) -> tuple[dict[str, dict], list[str]]:
    """DE-rank agreement and marker recall per label, and the labels whose reference is flat."""
    per_label, flat_reference = {}, []
    for label in sorted(within.de_batches):
        n = len(within.de_batches[label])
        diff_ref, diff_cor = within.de_sum_ref[label] / n, within.de_sum_cor[label] / n
        if np.ptp(diff_ref) == 0:
            flat_reference.append(label)
            continue
        per_label[label] = {
            DE_RANK: _spearman(diff_ref, diff_cor),
            MARKER_RECALL: _top_overlap(diff_ref, diff_cor, k_markers),
            "batches": within.de_batches[label],
        }
    return per_label, flat_reference


def _notes(within: WithinBatch, per_label: dict, flat_reference: list[str], labels: np.ndarray | None,
           params: Thresholds) -> list[str]:
    """What was not computed, and why."""
    notes = []
    if labels is None:
        notes.append(NO_LABELS_NOTE)
    else:
        unscored = sorted(set(map(str, pd.unique(labels))) - set(per_label))
        if unscored:
            notes.append(
                f"Labels without DE scores: {unscored} (a label needs a batch with >= "
                f"{params.min_cells_de} of its cells and >= {params.min_cells_de} other cells"
                + (f"; {flat_reference} have identical reference means in and out of the label"
                   if flat_reference else "") + ")."
            )
        if not within.group_scores:
            notes.append(f"No (batch, label) group has >= {params.min_cells_group} cells: within-type "
                         "neighbours were not computed.")
    if not within.hvg_per_batch:
        notes.append("No batch has >= 2 cells: HVG conservation was not computed.")
    return notes


def _dense_rows(matrix, rows: np.ndarray) -> np.ndarray:
    block = matrix[rows]
    block = block.toarray() if sp.issparse(block) else np.asarray(block)
    return block.astype(np.float64, copy=False)


def _top_overlap(reference: np.ndarray, corrected: np.ndarray, k: int) -> float:
    """|top-k of reference & top-k of corrected| / k (largest values; ties by gene order)."""
    top_ref = np.argsort(-reference, kind="stable")[:k]
    top_cor = np.argsort(-corrected, kind="stable")[:k]
    return len(np.intersect1d(top_ref, top_cor)) / k


def _spearman(reference: np.ndarray, corrected: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties); 0.0 if `corrected` is constant."""
    if np.ptp(corrected) == 0:
        return 0.0
    return float(np.corrcoef(rankdata(reference), rankdata(corrected))[0, 1])


def _neighbours_kept(reference: np.ndarray, corrected: np.ndarray, n_pcs: int, k: int) -> float:
    """Mean over cells of the Jaccard index of their k-NN sets on the two PCAs."""
    k = min(k, len(reference) - 1)
    sets = [_knn(_pca(values, n_pcs), k) for values in (reference, corrected)]
    shared = (sets[0][:, :, None] == sets[1][:, None, :]).sum(axis=(1, 2))
    return float(np.mean(shared / (2 * k - shared)))


def _pca(values: np.ndarray, n_pcs: int) -> np.ndarray:
    n_comps = min(n_pcs, *values.shape)
    solver = "full" if min(values.shape) <= FULL_SVD_MAX else "arpack"
    return PCA(n_components=n_comps, svd_solver=solver, random_state=0).fit_transform(values)


def _knn(embedding: np.ndarray, k: int) -> np.ndarray:
    # kneighbors() without a query excludes each cell from its own neighbours
    return NearestNeighbors(n_neighbors=k).fit(embedding).kneighbors(return_distance=False)


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _check_matrices(counts, corrected, require_integer_counts: bool):
    counts = counts.tocsr() if sp.issparse(counts) else np.asarray(counts)  # CSR: rows by index
    corrected = corrected.tocsr() if sp.issparse(corrected) else np.asarray(corrected)
    for what, matrix in (("counts", counts), ("corrected", corrected)):
        if matrix.ndim != 2:
            raise ValueError(f"The {what} matrix must be 2-D (cells x genes); got shape {matrix.shape}.")
        if not np.issubdtype(matrix.dtype, np.number) or np.issubdtype(matrix.dtype, np.complexfloating):
            raise ValueError(f"The {what} matrix must hold real numbers; got dtype {matrix.dtype}.")
    if counts.shape != corrected.shape:
        raise ValueError(
            f"Shape mismatch: counts {counts.shape} vs corrected {corrected.shape}; both must be "
            "the same cells x the same genes, in the same order."
        )
    if counts.shape[0] < 2 or counts.shape[1] < 1:
        raise ValueError(f"Need at least 2 cells and 1 gene; got {counts.shape}.")
    for what, matrix in (("corrected", corrected), ("counts", counts)):
        n_bad, n_negative, n_fraction = count_bad_values(matrix.data if sp.issparse(matrix) else matrix)
        if n_bad:
            raise ValueError(f"The {what} matrix holds {n_bad} NaN or infinite values.")
    n_fraction = n_fraction if require_integer_counts else 0
    if n_negative or n_fraction:
        raise ValueError(
            f"The counts matrix does not hold raw counts ({n_negative} negative and {n_fraction} "
            "non-integer values); pass the uncorrected counts (not log-normalized values), or "
            "require_integer_counts=False for non-negative fractional counts."
        )
    return counts, corrected


def _check_labels(values, n_cells: int, what: str) -> np.ndarray:
    series = pd.Series(np.asarray(values, dtype=object).ravel() if not isinstance(values, pd.Series)
                       else values.to_numpy(dtype=object))
    if len(series) != n_cells:
        raise ValueError(f"{what} has {len(series)} entries for {n_cells} cells.")
    n_missing = int(series.isna().sum())
    if n_missing:
        raise ValueError(f"{what} holds {n_missing} missing values (NaN/None); every cell needs one.")
    return series.astype(str).to_numpy()
