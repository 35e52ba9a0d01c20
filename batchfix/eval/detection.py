"""Scores that see a corrected counts matrix's defects: detection calibration, false DE, PIT histograms.

Each works on cells x genes matrices (dense or sparse) with per-cell labels and batches, and returns plain
numbers or DataFrames:

- detection calibration: per (gene, label, batch) group with >= `min_cells` cells, the corrected share of nonzero
  cells against the share a reference model expects (the mean over the group's cells of P(count > 0)), the
  fraction of groups within `tolerance` (beside `calibrated_within`, the fraction perfectly calibrated counts
  reach at the same group sizes), and the spread across batches of the nonzero share (sd over batches per
  gene x label, averaged) of the corrected and of the raw counts; `zeros_raised` is the share of observed zeros
  that a method's counts make positive; `reference_nonzero` gives expected shares where a method has no model of
  its own (a batch-free NB: per label rate at each cell's library, one theta per gene by moments);
- false DE: within each label, a t-test between every pair of batches on a log matrix (scanpy's
  rank_genes_groups), genes called at |logFC| > 1 and adjusted p < 0.05; a gene with zero raw counts in every cell
  of both groups is never a sound call, and on a stress set's null genes every call is a false one;
- PIT: a randomised PIT of counts under NB(mean, theta), u ~ U(F(y - 1), F(y)), histogrammed per batch and
  gene; a gene fails where a chi-square test of the histogram's uniformity gives p < `PIT_ALPHA`
  (`histogram_uniformity` of histograms a correction stored; `summed_calibration` scores detection from its sums).
"""
from __future__ import annotations

from itertools import combinations

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp
from scipy import stats

MIN_GROUP_CELLS = 20  # a (gene, label, batch) group is scored from this many cells
DETECTION_TOLERANCE = 0.05  # an observed nonzero share this close to the expected one is calibrated
SAMPLING_Z = 1.96  # ... or this many of its sampling sds (binomial, from the expected probabilities), if wider
DE_LOGFC = 1.0  # |log2 fold change| above this ...
DE_PADJ = 0.05  # ... and adjusted p below this: a DE call
PIT_BINS = 10
PIT_ALPHA = 1e-3  # a (batch, gene) PIT histogram with a chi-square p below this fails uniformity


def nb_nonzero_probability(mean: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """P(count > 0) under NB(mean, theta) (theta the inverse dispersion), elementwise with broadcasting."""
    mean, theta = np.asarray(mean, dtype=np.float64), np.asarray(theta, dtype=np.float64)
    return -np.expm1(theta * np.log(theta / (theta + mean)))


def reference_nonzero(raw: sp.csr_matrix, labels: np.ndarray) -> np.ndarray:
    """Cells x genes P(count > 0) under a batch-free NB: per cell type rate x the cell's library, theta by moments."""
    dense = raw.toarray().astype(np.float64)
    library = dense.sum(axis=1, keepdims=True)
    mean = np.empty_like(dense)
    for label in np.unique(labels):
        cells = labels == label
        mean[cells] = library[cells] * (dense[cells].sum(axis=0) / library[cells].sum())
    excess = ((dense - mean) ** 2 - mean).sum(axis=0)
    theta = np.clip((mean ** 2).sum(axis=0) / np.maximum(excess, 1e-12), 1e-2, 1e4)
    return nb_nonzero_probability(mean, theta)


def _groups(labels, batches) -> tuple[pd.DataFrame, np.ndarray]:
    """The (label, batch) groups present (a frame with their sizes) and each cell's group index."""
    frame = pd.DataFrame({"label": np.asarray(labels).astype(str), "batch": np.asarray(batches).astype(str)})
    codes, uniques = pd.MultiIndex.from_frame(frame).factorize()
    groups = pd.DataFrame(list(uniques), columns=["label", "batch"])
    groups["n_cells"] = np.bincount(codes, minlength=len(groups))
    return groups, codes


def _group_means(values, codes: np.ndarray, n_groups: int) -> np.ndarray:
    """(groups, genes) mean of each group's rows of `values` (dense or sparse)."""
    onehot = sp.csr_matrix((np.ones(len(codes)), (codes, np.arange(len(codes)))), shape=(n_groups, len(codes)))
    sums = onehot @ values
    sums = sums.toarray() if sp.issparse(sums) else np.asarray(sums)
    return sums / np.bincount(codes, minlength=n_groups)[:, None]


def _nonzero(values):
    """A 0/1 matrix of the positive entries (sparse stays sparse)."""
    if sp.issparse(values):
        return (sp.csr_matrix(values) > 0).astype(np.float64)
    return (np.asarray(values) > 0).astype(np.float64)


def nonzero_shares(counts, labels, batches, min_cells: int = MIN_GROUP_CELLS) -> pd.DataFrame:
    """Long frame (gene, label, batch, n_cells, share) of the share of nonzero cells per group of >= min_cells."""
    groups, codes = _groups(labels, batches)
    shares = _group_means(_nonzero(counts), codes, len(groups))
    keep = groups["n_cells"].to_numpy() >= min_cells
    frame = groups[keep].reset_index(drop=True)
    long = frame.loc[np.repeat(frame.index, shares.shape[1])].reset_index(drop=True)
    long.insert(0, "gene", np.tile(np.arange(shares.shape[1]), len(frame)))
    long["share"] = shares[keep].ravel()
    return long


def batch_spread(shares: pd.DataFrame) -> float:
    """Mean over (gene, label) of the sd (ddof=1) over batches of the nonzero share; pairs with one batch skipped."""
    sd = shares.groupby(["gene", "label"])["share"].std(ddof=1)
    return float(sd.dropna().mean())


def detection_calibration(
    corrected, raw, expected_nonzero, labels, batches,
    min_cells: int = MIN_GROUP_CELLS, tolerance: float = DETECTION_TOLERANCE,
) -> tuple[dict, pd.DataFrame]:
    """Corrected nonzero shares against the expected ones (cells x genes P(count > 0) under the reference model).

    Returns the summary (fraction of groups within `tolerance`; within the tolerance or SAMPLING_Z sampling sds of
    the group's share, if wider, about 0.95 for counts drawn from the expected probabilities; the share perfectly
    calibrated counts reach within the tolerance; the groups' mean absolute gap; the spread across batches of the
    corrected and raw shares; the share of raw zeros raised) and the per-group frame."""
    frame = nonzero_shares(corrected, labels, batches, min_cells)
    groups, codes = _groups(labels, batches)
    probability = np.asarray(expected_nonzero, dtype=np.float64)  # (cells, genes)
    expected = _group_means(probability, codes, len(groups))
    frame["expected"] = expected[groups["n_cells"].to_numpy() >= min_cells].ravel()
    frame["gap"] = frame["share"] - frame["expected"]
    sizes = groups["n_cells"].to_numpy()[:, None]
    variance = _group_means(probability * (1.0 - probability), codes, len(groups)) / sizes
    frame["sampling_sd"] = np.sqrt(variance[groups["n_cells"].to_numpy() >= min_cells].ravel())
    raw_shares = nonzero_shares(raw, labels, batches, min_cells)
    allowed = np.maximum(tolerance, SAMPLING_Z * frame["sampling_sd"])
    summary = {
        "groups": len(frame),
        "within_tolerance": float((frame["gap"].abs() <= tolerance).mean()) if len(frame) else float("nan"),
        "within_sampling": float((frame["gap"].abs() <= allowed).mean()) if len(frame) else float("nan"),
        "calibrated_within": calibrated_within(expected_nonzero, labels, batches, min_cells, tolerance),
        "mean_abs_gap": float(frame["gap"].abs().mean()),
        "spread_corrected": batch_spread(frame),
        "spread_raw": batch_spread(raw_shares),
        "zeros_raised": zeros_raised(raw, corrected),
    }
    return summary, frame


def calibrated_within(expected_nonzero, labels, batches, min_cells: int = MIN_GROUP_CELLS,
                      tolerance: float = DETECTION_TOLERANCE, seed: int = 0) -> float:
    """The share of groups within `tolerance` that perfectly calibrated counts reach: each entry detected with
    its expected probability (one seeded draw), scored as `detection_calibration` scores a matrix. Groups of a
    few dozen cells miss the tolerance by sampling alone (the sd of a share of 45 cells at 0.5 is 0.075), so
    this, not 1, is the most a matrix can reach."""
    expected = np.asarray(expected_nonzero, dtype=np.float64)
    draws = np.random.default_rng(seed).random(expected.shape) < expected
    frame = nonzero_shares(draws, labels, batches, min_cells)
    groups, codes = _groups(labels, batches)
    frame["expected"] = _group_means(expected, codes, len(groups))[groups["n_cells"].to_numpy() >= min_cells].ravel()
    return float(((frame["share"] - frame["expected"]).abs() <= tolerance).mean()) if len(frame) else float("nan")


def zeros_raised(raw, corrected) -> float:
    """Share of the observed zeros of `raw` that are positive in `corrected` (same shape)."""
    raw_nz, corrected_nz = sp.csr_matrix(_nonzero(raw)), sp.csr_matrix(_nonzero(corrected))
    zeros = raw_nz.shape[0] * raw_nz.shape[1] - raw_nz.nnz
    raised = corrected_nz.nnz - corrected_nz.multiply(raw_nz).nnz
    return raised / zeros if zeros else 0.0


def _batch_pair_test(log_values, batches: np.ndarray, first: str, second: str) -> pd.DataFrame:
    """scanpy's t-test of `first` against `second` (cells of both in `log_values`), rows in gene order."""
    obs = pd.DataFrame({"batch": pd.Categorical(batches)}, index=np.arange(len(batches)).astype(str))
    adata = ad.AnnData(X=log_values, obs=obs, var=pd.DataFrame(index=np.arange(log_values.shape[1]).astype(str)))
    adata.uns["log1p"] = {"base": None}
    sc.tl.rank_genes_groups(adata, "batch", groups=[first], reference=second, method="t-test",
                            n_genes=adata.n_vars)
    result = sc.get.rank_genes_groups_df(adata, group=first)
    return result.set_index(result["names"].astype(int)).sort_index()


def false_de(
    log_values, raw, labels, batches, null_genes=None,
    min_cells: int = MIN_GROUP_CELLS, logfc: float = DE_LOGFC, padj: float = DE_PADJ,
) -> pd.DataFrame:
    """Per (label, batch pair) with >= min_cells cells each: DE calls between the batches on `log_values`, those
    on genes with zero raw counts in every cell of both groups, and (given a boolean mask of null genes) the calls
    among the null genes and their rate."""
    labels, batches = np.asarray(labels).astype(str), np.asarray(batches).astype(str)
    rows = []
    for label in np.unique(labels):
        in_label = labels == label
        sizes = pd.Series(batches[in_label]).value_counts()
        for first, second in combinations(sorted(sizes.index[sizes >= min_cells]), 2):
            cells = np.flatnonzero(in_label & np.isin(batches, [first, second]))
            test = _batch_pair_test(log_values[cells], batches[cells], first, second)
            called = ((test["logfoldchanges"].abs() > logfc) & (test["pvals_adj"] < padj)).to_numpy()
            silent = np.asarray((raw[cells] != 0).sum(axis=0)).ravel() == 0
            row = {"label": label, "batch_1": first, "batch_2": second, "called": int(called.sum()),
                   "called_zero_raw": int((called & silent).sum())}
            if null_genes is not None:
                null = np.asarray(null_genes, dtype=bool)
                row.update(null_called=int((called & null).sum()), null_rate=float(called[null].mean()))
            rows.append(row)
    return pd.DataFrame(rows)


def randomized_pit(counts, mean, theta, rng: np.random.Generator) -> np.ndarray:
    """u ~ U(F(y - 1), F(y)) under NB(mean, theta), elementwise (cells x genes, dense float64)."""
    y = sp.csr_matrix(counts).toarray() if sp.issparse(counts) else np.asarray(counts)
    y = y.astype(np.float64)
    mean, theta = np.broadcast_arrays(np.asarray(mean, dtype=np.float64), np.asarray(theta, dtype=np.float64))
    p = theta / (theta + mean)
    upper = stats.nbinom.cdf(y, theta, p)
    lower = np.where(y > 0, stats.nbinom.cdf(y - 1, theta, p), 0.0)
    return lower + rng.random(y.shape) * (upper - lower)


def pit_histograms(counts, mean, theta, batches, seed: int = 0, bins: int = PIT_BINS,
                   alpha: float = PIT_ALPHA) -> pd.DataFrame:
    """Per (batch, gene): the randomised PIT histogram (`bins` equal bins, counts of cells), the chi-square p of
    its uniformity and `fails` where that p < alpha."""
    return pit_uniformity(randomized_pit(counts, mean, theta, np.random.default_rng(seed)), batches, bins, alpha)


def pit_uniformity(pit: np.ndarray, batches, bins: int = PIT_BINS, alpha: float = PIT_ALPHA) -> pd.DataFrame:
    """`pit_histograms` of PIT values already drawn (cells x genes)."""
    batches = np.asarray(batches).astype(str)
    names = np.unique(batches)
    hist = np.empty((len(names), pit.shape[1], bins), dtype=np.int64)  # (batches, genes, bins)
    for row, batch in enumerate(names):
        index = np.minimum((pit[batches == batch] * bins).astype(int), bins - 1)  # (cells, genes) bin of each value
        hist[row] = np.stack([(index == b).sum(axis=0) for b in range(bins)], axis=1)
    return histogram_uniformity(hist, names, alpha)


def histogram_uniformity(hist: np.ndarray, batches, alpha: float = PIT_ALPHA) -> pd.DataFrame:
    """Per (batch, gene) of PIT histograms `hist` (batches, genes, bins) and the batches' names: the histogram, the
    chi-square p of its uniformity and `fails` where that p < alpha; a batch whose histograms are empty is left out."""
    rows = []
    for batch, counts in zip(np.asarray(batches).astype(str), hist):
        if not counts.any():  # a batch without checked cells
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            pvalue = stats.chisquare(counts, axis=1).pvalue
        for gene in range(counts.shape[0]):
            rows.append({"batch": batch, "gene": gene, "hist": counts[gene].tolist(), "pvalue": float(pvalue[gene]),
                         "fails": bool(pvalue[gene] < alpha)})
    return pd.DataFrame(rows)


def summed_calibration(cells: np.ndarray, detected: np.ndarray, expected: np.ndarray, variance: np.ndarray,
                       drawn: np.ndarray, min_cells: int = MIN_GROUP_CELLS,
                       tolerance: float = DETECTION_TOLERANCE) -> dict:
    """`detection_calibration`'s summary from sums over groups of cells: `cells` (groups,) and per gene (groups,
    genes) the cells detected, the sum of their expected P(count > 0), of its variance P (1 - P), and the cells a
    draw with that P detects. Groups of fewer than min_cells cells are left out."""
    keep = cells >= min_cells
    if not keep.any():
        return dict.fromkeys(("within_tolerance", "within_sampling", "calibrated_within"), float("nan"))
    n = cells[keep][:, None]
    gap = np.abs(detected[keep] - expected[keep]) / n
    allowed = np.maximum(tolerance, SAMPLING_Z * np.sqrt(variance[keep]) / n)
    return {"within_tolerance": float((gap <= tolerance).mean()), "within_sampling": float((gap <= allowed).mean()),
            "calibrated_within": float((np.abs(drawn[keep] - expected[keep]) / n <= tolerance).mean())}
