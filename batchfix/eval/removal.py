"""Gene-level batch-effect removal: how much of each gene's between-batch difference within a cell type is left.

For each label (cell type, or latent cluster) present in at least two batches with MIN_CELLS cells each, and each
gene that label expresses, the between-batch sd of the label's per-batch mean is taken before (the raw counts'
log1p(counts per 10k)) and after the correction; a pair's share left is after / before, and the score is the
median over (label, gene) pairs: 1 = nothing removed, 0 = every gene's batch means equal within each label.
It is computed on the log layer and on the mean scale (means of counts per 10k: the share is not the log of a
depth difference), and composition-balanced: each gene's batch effect averaged over the labels first (what ComBat
removes by construction), then its share left.
"""
from __future__ import annotations

import warnings

import numpy as np
import scipy.sparse as sp

MIN_CELLS = 10  # cells of a label a batch needs for its mean to count
MIN_MEAN = 0.1  # log1p(counts per 10k) a label's gene must reach (raw, over its cells) to be scored


def group_means(matrix, rows: list[np.ndarray], expm1: bool) -> np.ndarray:
    """(groups, genes) float64 mean of `matrix`'s rows of each group (of expm1 of the values with `expm1`)."""
    means = []
    for chosen in rows:
        part = matrix[chosen]
        part = part.toarray() if sp.issparse(part) else np.asarray(part)
        part = part.astype(np.float64)
        means.append((np.expm1(part) if expm1 else part).mean(axis=0))
    return np.vstack(means)


def label_batch_rows(batch: np.ndarray, labels: np.ndarray) -> dict[str, list[np.ndarray]]:
    """Per label with MIN_CELLS cells in at least two batches: the rows of each such batch."""
    groups = {}
    for label in np.unique(labels):
        rows = [np.flatnonzero((labels == label) & (batch == b)) for b in np.unique(batch)]
        rows = [r for r in rows if len(r) >= MIN_CELLS]
        if len(rows) >= 2:
            groups[str(label)] = rows
    return groups


def removal_scores(raw_log, corrected_log, batch, labels) -> dict[str, float | None]:
    """{'left_log', 'left_mean', 'left_balanced'}: the median share of the within-label between-batch spread of
    gene means left by the correction (module docstring); None where no label is in two batches."""
    batch, labels = np.asarray(batch).astype(str), np.asarray(labels).astype(str)
    groups = label_batch_rows(batch, labels)
    if not groups:
        return {"left_log": None, "left_mean": None, "left_balanced": None}
    shares = {"left_log": [], "left_mean": []}
    effects = {"raw": [], "corrected": []}  # per label: (batches, genes) deviation from its mean, log scale
    for rows in groups.values():
        raw, corrected = group_means(raw_log, rows, False), group_means(corrected_log, rows, False)
        scored = raw.mean(axis=0) >= MIN_MEAN
        for name, expm1 in (("left_log", False), ("left_mean", True)):
            before = (np.log1p(group_means(raw_log, rows, True)) if expm1 else raw).std(axis=0)[scored]
            after = (np.log1p(group_means(corrected_log, rows, True)) if expm1 else corrected).std(axis=0)[scored]
            keep = before > 0
            shares[name].append(after[keep] / before[keep])
        effects["raw"].append(np.where(scored, raw - raw.mean(axis=0), np.nan))
        effects["corrected"].append(np.where(scored, corrected - corrected.mean(axis=0), np.nan))
    result = {name: float(np.median(np.concatenate(values))) for name, values in shares.items()}
    result["left_balanced"] = balanced_share(groups, batch, effects)
    return result


def noise_floor(raw_log, batch, labels, seed: int = 0) -> dict[str, float | None]:
    """{'floor_log', 'floor_mean'}: the share of the within-label between-batch spread that sampling noise alone
    leaves, so that no correction can remove it without fitting noise: the spread of the same cells' means with the
    batch labels shuffled within each label (the batches' sizes kept), over the spread with the true labels, median
    over (label, gene) pairs as in `removal_scores`. A correction scoring below it removed noise (on a random split,
    where all the spread is noise, such a correction changes what it should not)."""
    batch, labels = np.asarray(batch).astype(str), np.asarray(labels).astype(str)
    rng = np.random.default_rng(seed)
    shuffled = batch.copy()
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        shuffled[rows] = rng.permutation(batch[rows])
    groups = label_batch_rows(batch, labels)
    if not groups:
        return {"floor_log": None, "floor_mean": None}
    shares = {"floor_log": [], "floor_mean": []}
    for label, rows in groups.items():
        kept = [np.unique(batch[r])[0] for r in rows]
        noise_rows = [np.flatnonzero((labels == label) & (shuffled == b)) for b in kept]
        scored = group_means(raw_log, rows, False).mean(axis=0) >= MIN_MEAN
        for name, expm1 in (("floor_log", False), ("floor_mean", True)):
            before, after = (group_means(raw_log, r, expm1) for r in (rows, noise_rows))
            before, after = ((np.log1p(m) if expm1 else m).std(axis=0)[scored] for m in (before, after))
            keep = before > 0
            shares[name].append(after[keep] / before[keep])
    return {name: float(np.median(np.concatenate(values))) for name, values in shares.items()}


def balanced_share(groups: dict, batch: np.ndarray, effects: dict) -> float | None:
    """The median over genes of the between-batch sd of each batch's effect averaged over the labels it has, after
    / before."""
    every = np.unique(batch)
    averaged = {}
    for kind, per_label in effects.items():
        stacked = np.full((len(per_label), len(every), per_label[0].shape[1]), np.nan)  # (labels, batches, genes)
        for i, (rows, effect) in enumerate(zip(groups.values(), per_label)):
            stacked[i, np.searchsorted(every, [batch[r[0]] for r in rows])] = effect
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a gene no label scores: NaN
            averaged[kind] = np.nanstd(np.nanmean(stacked, axis=0), axis=0)  # (genes,)
    keep = np.isfinite(averaged["raw"]) & (averaged["raw"] > 0)
    return float(np.median(averaged["corrected"][keep] / averaged["raw"][keep])) if keep.any() else None
