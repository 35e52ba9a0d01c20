"""What the gene lines give corrected counts whose only change is one factor per gene and batch.

The gene scores (batchfix.eval.fidelity) rank log1p(counts per 10k) differences within each batch. A log-scale
correction that adds one shift per gene and batch (ComBat's location) leaves every one of them as it was. A counts
correction that multiplies each gene by one factor per batch leaves every count ratio within a batch as it was too,
but log1p is not a log at the counts a cell holds (log1p(f x) - log1p(f y) moves with f where x, y are small), so
the differences the scores rank move, and a corrected-counts matrix can lose markers against the raw values with no
information lost. These rows measure that ceiling on the same cells and genes (the batch-aware 2,000 HVGs, as the
benchmark selects them), each scored on log_cp10k of its counts:

    uncorrected                 the raw counts
    ComBat                      scanpy's ComBat on log_cp10k of the raw counts (log scale, no counts)
    factor to the batches' mean each batch's mean fraction of a gene brought to the mean over batches of those
                                fractions (the average reference batchfix corrects to), one factor per gene and
                                batch, nothing else: not integers
    the same, integers          randomly rounded (floor(x + u), u ~ U(0, 1), seed 0)
    ComBat-seq's factor         the raw counts times ComBat-seq's own ratio of sums per gene and batch (bench extra)
    ComBat-seq                  inmoose's pycombat_seq counts (bench extra)
    batchfix, seed S            layers['batchfix_counts'] of a model trained on the cells (every option at its
                                default), the same genes; then their mean over the seeds

    python -m scripts.lab.count_scaling data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2
"""
from __future__ import annotations

import argparse

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

import batchfix
from batchfix.data.normalize import log_cp10k
from batchfix.eval import fidelity
from scripts import baselines
from scripts.benchmark import add_data_arguments, load, select_genes


def factor_to_mean_fraction(counts: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """counts (cells, genes) times one factor per gene and batch: each batch's mean fraction of the gene (counts over
    the cell's total) becomes the mean over batches of those fractions; a gene a batch never detects keeps its
    zeros (factor 1)."""
    fractions = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    names = np.unique(batch)
    batch_means = np.stack([fractions[batch == name].mean(axis=0) for name in names])  # (batches, genes)
    target = batch_means.mean(axis=0)
    factors = np.where(batch_means > 0, target / np.where(batch_means > 0, batch_means, 1.0), 1.0)
    return counts * factors[np.searchsorted(names, batch)]


def factor_of(counts: np.ndarray, corrected: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """counts times the ratio of `corrected`'s sum to `counts`' sum, per gene and batch (1 where counts sum to 0)."""
    out = counts.copy()
    for name in np.unique(batch):
        rows = batch == name
        raw_sum, corrected_sum = counts[rows].sum(axis=0), corrected[rows].sum(axis=0)
        out[rows] *= np.where(raw_sum > 0, corrected_sum / np.where(raw_sum > 0, raw_sum, 1.0), 1.0)
    return out


def randomly_rounded(values: np.ndarray, seed: int = 0) -> np.ndarray:
    """floor(x + u), u ~ U(0, 1): integers with the same expectation."""
    return np.floor(values + np.random.default_rng(seed).random(values.shape))


def count_rows(counts: np.ndarray, batch: np.ndarray, obs: pd.DataFrame, batch_key: str) -> dict[str, np.ndarray]:
    """Every row's log_cp10k values (cells, genes) but batchfix's; ComBat-seq's rows only with inmoose."""
    log_raw = np.asarray(log_cp10k(counts), dtype=np.float64)
    scaled = factor_to_mean_fraction(counts, batch)
    rows = {"uncorrected": log_raw, "ComBat": baselines.combat(log_raw, obs, batch_key),
            "factor to the batches' mean": log_cp10k(scaled), "the same, integers": log_cp10k(randomly_rounded(scaled))}
    if baselines.missing_module("inmoose") is None:
        combat_seq = baselines.combat_seq(sp.csr_matrix(counts), batch).toarray()
        rows["ComBat-seq's factor"] = log_cp10k(factor_of(counts, combat_seq, batch))
        rows["ComBat-seq"] = log_cp10k(combat_seq)
    return rows


def batchfix_rows(cells: ad.AnnData, genes: pd.Index, batch_key: str, label_key: str,
                  seeds: list[int]) -> dict[str, np.ndarray]:
    """log_cp10k of layers['batchfix_counts'] on `genes`, a model per seed trained on `cells` (all their genes)."""
    rows = {}
    for seed in seeds:
        model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                               enable_progress_bar=False)
        corrected = batchfix.correct(cells, model, copy=True)
        layer = corrected[:, genes].layers["batchfix_counts"]
        rows[f"batchfix, seed {seed}"] = log_cp10k(layer.toarray() if sp.issparse(layer) else layer)
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_arguments(parser)
    parser.add_argument("--seeds", nargs="*", type=int, default=[], help="batchfix models to train (none: no rows)")
    parser.add_argument("--out", help="CSV of the table")
    args = parser.parse_args(argv)
    cells = load(args.data, args.batch_key, args.label_key, None, args.batches)
    selected = select_genes(cells, args.batch_key, 2000)
    counts = np.asarray(selected.X, dtype=np.float64)
    batch = selected.obs[args.batch_key].astype(str).to_numpy()
    labels = selected.obs[args.label_key].astype(str).to_numpy()
    rows = count_rows(counts, batch, selected.obs, args.batch_key)
    rows.update(batchfix_rows(cells, selected.var_names, args.batch_key, args.label_key, args.seeds))
    table = pd.DataFrame({name: {metric: fidelity.gene_fidelity(counts, values, batch, labels)[metric]
                                 for metric in fidelity.GENE_METRICS} for name, values in rows.items()}).T
    if args.seeds:
        seeded = [f"batchfix, seed {seed}" for seed in args.seeds]
        table.loc[f"batchfix, mean of {len(seeded)} seeds"] = table.loc[seeded].mean()
    print(table.to_string(float_format="%.3f"))
    if args.out:
        table.to_csv(args.out, float_format="%.4f")
    return table


if __name__ == "__main__":
    main()
