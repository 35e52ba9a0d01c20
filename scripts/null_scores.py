"""What a correction changes between the pseudo-batches of a null split (scripts/null_split.py), where every change
is an artefact: the ideal corrector leaves the split cells as they are.

Scored on the split cells only (obs[batch_key] differs from obs['source_batch']; every cell when that column is
absent), for the corrected counts (`--layer`), with `--combat` for scanpy's ComBat on the log-normalised raw
counts of the whole file (genes without variance in some batch left as they are), and with `--combat-seq` for
ComBat-seq's adjusted counts of the whole file (inmoose, no covariate; scripts/baselines.py):

- counts changed: share of the nonzero raw entries that the correction changes (log scale for ComBat, |change| >
  1e-6); zeros raised: share of the raw zeros made positive; mean |log change|: mean over all entries of the
  change of log1p(counts per 10k) (the corrected counts normalised alike; ComBat's own matrix); shift gap: how
  differently the pseudo-batches were moved, per gene |mean log change in one - mean in the others|, averaged
  over genes (with real batches kept beside the split, a change shared by all split cells can be the removal of
  the source batch's real effect; this gap, the kNN and the DE genes are artefacts whatever the file); shuffled:
  the same gap with the pseudo-batch labels permuted (seed 0), the floor that changes varying by cell alone give;
- kNN kept: for each cell, the share of its 15 nearest neighbours that are the same before and after, averaged; both
  sides through one recipe: log1p(counts per 10k) of the 2,000 genes most variable in the raw split cells (scanpy,
  flavor 'seurat'), centred PCA of 50 components, Euclidean neighbours without the cell itself;
- DE genes: scanpy's rank_genes_groups, wilcoxon, each pseudo-batch against the others, on the corrected log layer
  (`--log-layer`, else log1p(counts per 10k) of `--layer`) and on the raw log layer; a gene is called at
  BH-adjusted p < 0.05 and |log2 fold change| > 0.25 in some group (those of the raw log layer are the draw's own);
- pseudobulk DE (only with pydeseq2 installed, two pseudo-batches): counts summed per (pseudo-batch, label), the
  label a covariate (~ label + pseudo-batch), pydeseq2 via scripts/de_benchmark.py, calls at padj < 0.05 among the
  2,000 genes detected in most split cells; raw and corrected counts.

    python -m scripts.null_scores null.h5ad run/corrected.h5ad --layer batchfix_counts --log-layer batchfix --combat
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp
from sklearn.decomposition import PCA
from sklearn.neighbors import NearestNeighbors

from batchfix.data.atomic import atomic_output
from batchfix.data.normalize import log_cp10k
from batchfix.eval.detection import zeros_raised
from scripts.null_split import SOURCE_KEY

N_NEIGHBOURS = 15
N_HVGS = 2000
N_PCS = 50
DE_PADJ = 0.05
DE_LOGFC = 0.25
CHANGE_TOL = 1e-6
PSEUDOBULK_GENES = 2000
DE_LISTED = 20  # DE genes named per matrix


@dataclass
class SplitCells:
    """The split cells of a raw file: raw counts (CSR), their log layer, pseudo-batches, labels (or None) and the
    HVG columns of the kNN recipe."""

    raw: sp.csr_matrix
    raw_log: sp.csr_matrix
    pseudo_batches: np.ndarray
    labels: np.ndarray | None
    gene_names: np.ndarray
    hvgs: np.ndarray


def split_rows(obs: pd.DataFrame, batch_key: str) -> np.ndarray:
    """Rows of the split cells: those whose batch is not their source batch (all rows without a source column)."""
    if SOURCE_KEY not in obs:
        return np.arange(len(obs))
    return np.flatnonzero(obs[batch_key].astype(str).to_numpy() != obs[SOURCE_KEY].astype(str).to_numpy())


def hvg_columns(log_values: sp.csr_matrix, n_top: int = N_HVGS) -> np.ndarray:
    """Columns of the `n_top` most variable genes (scanpy, flavor 'seurat'); all genes when there are fewer."""
    if log_values.shape[1] <= n_top:
        return np.arange(log_values.shape[1])
    table = sc.pp.highly_variable_genes(ad.AnnData(X=log_values.copy()), n_top_genes=n_top, flavor="seurat",
                                        inplace=False)
    return np.flatnonzero(table["highly_variable"].to_numpy())


def read_split(raw: ad.AnnData, batch_key: str, label_key: str | None) -> SplitCells:
    """The split cells of `raw` (raw counts in X) with the HVGs chosen on their raw log layer."""
    rows = split_rows(raw.obs, batch_key)
    counts = sp.csr_matrix(raw.X[rows], dtype=np.float32)
    log_values = log_cp10k(counts)
    labels = raw.obs[label_key].astype(str).to_numpy()[rows] if label_key and label_key in raw.obs else None
    return SplitCells(counts, log_values, raw.obs[batch_key].astype(str).to_numpy()[rows], labels,
                      raw.var_names.to_numpy(), hvg_columns(log_values))


def neighbour_sets(log_values, columns: np.ndarray, k: int = N_NEIGHBOURS) -> np.ndarray:
    """cells x k: each cell's k nearest neighbours (itself excluded) on a centred PCA of the given columns."""
    values = log_values[:, columns]
    values = values.toarray() if sp.issparse(values) else np.asarray(values)
    n_comps = min(N_PCS, values.shape[0] - 1, values.shape[1])
    embedding = PCA(n_components=n_comps, svd_solver="full").fit_transform(values.astype(np.float64))
    return NearestNeighbors(n_neighbors=min(k, len(values) - 1)).fit(embedding).kneighbors(return_distance=False)


def knn_kept(before: np.ndarray, after: np.ndarray) -> float:
    """Mean over cells of the share of a cell's neighbours (cells x k) that are the same in both sets."""
    shared = (before[:, :, None] == after[:, None, :]).sum(axis=(1, 2))  # cells
    return float(np.mean(shared / before.shape[1]))


def de_genes(log_values, groups: np.ndarray, gene_names: np.ndarray) -> list[str]:
    """Genes called between the groups (wilcoxon, each against the rest): padj < DE_PADJ and |logFC| > DE_LOGFC."""
    values = sp.csr_matrix(log_values, dtype=np.float32) if sp.issparse(log_values) else np.asarray(log_values)
    obs = pd.DataFrame({"group": pd.Categorical(groups)}, index=np.arange(len(groups)).astype(str))
    adata = ad.AnnData(X=values, obs=obs, var=pd.DataFrame(index=np.arange(values.shape[1]).astype(str)))
    adata.uns["log1p"] = {"base": None}
    sc.tl.rank_genes_groups(adata, "group", method="wilcoxon", n_genes=adata.n_vars, tie_correct=True)
    called = np.zeros(values.shape[1], dtype=bool)
    for group in adata.obs["group"].cat.categories:
        table = sc.get.rank_genes_groups_df(adata, group=group)
        hit = (table["pvals_adj"] < DE_PADJ) & (table["logfoldchanges"].abs() > DE_LOGFC)
        called[table.loc[hit, "names"].astype(int).to_numpy()] = True
    return gene_names[called].tolist()


def changed_share(raw_values, corrected_values) -> float:
    """Share of the nonzero entries of `raw_values` that differ in `corrected_values` by more than CHANGE_TOL."""
    raw_values = sp.csr_matrix(raw_values)
    rows, cols = raw_values.nonzero()
    corrected = corrected_values[rows, cols]
    corrected = np.asarray(corrected).ravel()
    return float(np.mean(np.abs(corrected - np.asarray(raw_values[rows, cols]).ravel()) > CHANGE_TOL))


def mean_abs_log_change(raw_log, corrected_log) -> float:
    """Mean |difference| over all entries of two log matrices of one shape."""
    difference = sp.csr_matrix(corrected_log) - sp.csr_matrix(raw_log)
    return float(abs(difference).sum() / np.prod(difference.shape))


def shift_gap(raw_log, corrected_log, groups: np.ndarray) -> float:
    """How differently the pseudo-batches were moved: per gene, |mean log change in one pseudo-batch - mean in the
    others|, averaged over genes and pseudo-batches (0 for any change shared by every split cell)."""
    change = sp.csr_matrix(corrected_log) - sp.csr_matrix(raw_log)  # cells x genes
    gaps = []
    for group in np.unique(groups):
        inside = groups == group
        gap = np.asarray(change[inside].mean(axis=0) - change[~inside].mean(axis=0)).ravel()  # genes
        gaps.append(np.abs(gap).mean())
    return float(np.mean(gaps))


def matrix_scores(split: SplitCells, changed: float, raised: float, corrected_log) -> dict:
    """The scores of one corrected matrix (its changes, given) against the raw split cells."""
    before = neighbour_sets(split.raw_log, split.hvgs)
    genes = de_genes(corrected_log, split.pseudo_batches, split.gene_names)
    return {"counts_changed": changed, "zeros_raised": raised,
            "mean_abs_log_change": mean_abs_log_change(split.raw_log, corrected_log),
            "shift_gap": shift_gap(split.raw_log, corrected_log, split.pseudo_batches),
            "shift_gap_shuffled": shift_gap(split.raw_log, corrected_log,
                                            np.random.default_rng(0).permutation(split.pseudo_batches)),
            "knn_kept": knn_kept(before, neighbour_sets(corrected_log, split.hvgs)),
            "de_genes": len(genes), "de_genes_listed": genes[:DE_LISTED]}


def corrected_counts_scores(split: SplitCells, counts, log_values=None) -> dict:
    """Scores of corrected counts (cells x genes of the split) and their log layer (log1p(cp10k) when None)."""
    counts = sp.csr_matrix(counts, dtype=np.float32)
    log_values = log_cp10k(counts) if log_values is None else sp.csr_matrix(log_values, dtype=np.float32)
    return matrix_scores(split, changed_share(split.raw, counts), zeros_raised(split.raw, counts), log_values)


def raw_scores(split: SplitCells) -> dict:
    """The raw split cells scored against themselves: no change, and the DE genes of the draw itself."""
    return corrected_counts_scores(split, split.raw, split.raw_log)


def combat_log(raw: ad.AnnData, batch_key: str) -> np.ndarray:
    """scanpy ComBat of log1p(counts per 10k) of the whole file (cells x genes, dense); genes without variance in
    some batch (which ComBat cannot scale) keep their log values."""
    log_values = np.asarray(log_cp10k(sp.csr_matrix(raw.X, dtype=np.float32)).toarray(), dtype=np.float64)
    batches = raw.obs[batch_key].astype(str).to_numpy()
    varies = np.all([log_values[batches == b].var(axis=0) > 0 for b in np.unique(batches)], axis=0)
    adata = ad.AnnData(X=log_values[:, varies], obs=pd.DataFrame({"batch": pd.Categorical(batches)},
                                                                  index=raw.obs_names))
    sc.pp.combat(adata, key="batch")
    log_values[:, varies] = adata.X
    return log_values


def combat_scores(raw: ad.AnnData, split: SplitCells, batch_key: str) -> dict:
    """The scores of ComBat's matrix (log scale) against the raw split cells' log layer."""
    corrected = combat_log(raw, batch_key)[split_rows(raw.obs, batch_key)]
    return matrix_scores(split, changed_share(split.raw_log, corrected), zeros_raised(split.raw, corrected),
                         corrected)


def combat_seq_scores(raw: ad.AnnData, split: SplitCells, batch_key: str) -> dict:
    """The scores of ComBat-seq's adjusted counts of the whole file, as corrected counts."""
    from scripts.baselines import combat_seq

    adjusted = combat_seq(sp.csr_matrix(raw.X, dtype=np.float32), raw.obs[batch_key].astype(str).to_numpy())
    return corrected_counts_scores(split, adjusted[split_rows(raw.obs, batch_key)])


def pseudobulk_calls(split: SplitCells, counts: sp.csr_matrix, genes: np.ndarray) -> int:
    """Genes called at padj < DE_PADJ between the two pseudo-batches by pydeseq2 on counts summed per (pseudo-batch,
    label), the label a covariate (without labels: three random replicates per pseudo-batch, no covariate)."""
    from scripts.de_benchmark import deseq_p, pseudobulk

    first, second = sorted(set(split.pseudo_batches))
    if split.labels is None:
        covariate, strata = False, np.random.default_rng(0).integers(0, 3, len(split.pseudo_batches)).astype(str)
    else:
        covariate, strata = True, split.labels
    obs = pd.DataFrame({"sample": [f"{b}|{s}" for b, s in zip(split.pseudo_batches, strata)], "batch": strata,
                        "condition": np.where(split.pseudo_batches == first, "A", "B")})
    _, padj = deseq_p(*pseudobulk(sp.csr_matrix(counts)[:, genes], obs), covariate)
    return int((padj < DE_PADJ).sum())


def pseudobulk_scores(split: SplitCells, corrected_counts) -> dict:
    """pydeseq2 calls on raw and corrected counts, or why they were skipped."""
    if importlib.util.find_spec("pydeseq2") is None:
        return {"skipped": "pydeseq2 is not installed"}
    if len(set(split.pseudo_batches)) != 2:
        return {"skipped": "pseudobulk DE needs exactly two pseudo-batches"}
    detected = np.asarray((split.raw > 0).sum(axis=0)).ravel()
    genes = np.sort(np.argsort(-detected, kind="stable")[:PSEUDOBULK_GENES])
    return {"genes_tested": len(genes), "raw_calls": pseudobulk_calls(split, split.raw, genes),
            "corrected_calls": pseudobulk_calls(split, corrected_counts, genes)}


def aligned(corrected: ad.AnnData, raw: ad.AnnData, batch_key: str, layer: str) -> ad.AnnData:
    """The split cells of `corrected` in the raw file's cell and gene order (every one must be there)."""
    cells = raw.obs_names[split_rows(raw.obs, batch_key)]
    missing_cells = cells.difference(corrected.obs_names)
    missing_genes = raw.var_names.difference(corrected.var_names)
    if len(missing_cells) or len(missing_genes) or layer not in corrected.layers:
        raise SystemExit(f"the corrected file lacks {len(missing_cells)} split cells, {len(missing_genes)} genes "
                         f"of the raw file, or layers['{layer}'] (it has {list(corrected.layers)})")
    return corrected[cells, raw.var_names]


def null_scores(raw: ad.AnnData, corrected: ad.AnnData | None, layer: str, log_layer: str | None = None,
                batch_key: str = "batch", label_key: str | None = "cell_type", combat: bool = False,
                combat_seq: bool = False) -> dict:
    """Every score of the module for one corrected file of a null split (see the module's docstring); without a
    corrected file, the raw cells and the baselines asked for."""
    split = read_split(raw, batch_key, label_key)
    if len(set(split.pseudo_batches)) < 2:
        raise SystemExit(f"fewer than two pseudo-batches among the split cells of obs['{batch_key}']")
    methods = {"raw": raw_scores(split)}
    counts = None
    if corrected is not None:
        corrected = aligned(corrected, raw, batch_key, layer)
        counts = corrected.layers[layer]
        methods[layer] = corrected_counts_scores(split, counts, corrected.layers[log_layer] if log_layer else None)
    if combat:
        methods["ComBat"] = combat_scores(raw, split, batch_key)
    if combat_seq:
        methods["ComBat-seq"] = combat_seq_scores(raw, split, batch_key)
    return {"split_cells": len(split.pseudo_batches),
            "cells_per_pseudo_batch": pd.Series(split.pseudo_batches).value_counts().sort_index().to_dict(),
            "hvgs": len(split.hvgs), "neighbours": N_NEIGHBOURS,
            "de_rule": f"wilcoxon, BH padj < {DE_PADJ} and |log2FC| > {DE_LOGFC}", "methods": methods,
            "pseudobulk": pseudobulk_scores(split, counts) if counts is not None else {"skipped": "no corrected file"}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", help="the null split (.h5ad, raw counts in X) the corrector was given")
    parser.add_argument("corrected", nargs="?", help="the corrected file (.h5ad) of those cells (none: the raw "
                        "cells and the baselines asked for)")
    parser.add_argument("--layer", default="batchfix_counts", help="its corrected counts layer")
    parser.add_argument("--log-layer", help="its log layer for DE (default: log1p(counts per 10k) of --layer)")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type", help="labels: the pseudobulk covariate")
    parser.add_argument("--combat", action="store_true", help="score scanpy's ComBat in the same run")
    parser.add_argument("--combat-seq", action="store_true", help="score ComBat-seq (inmoose) in the same run")
    parser.add_argument("--out", type=Path, help="JSON written (default: <corrected name>.null_scores.json here)")
    args = parser.parse_args(argv)
    scores = null_scores(ad.read_h5ad(args.raw), ad.read_h5ad(args.corrected) if args.corrected else None,
                         args.layer, args.log_layer, args.batch_key, args.label_key, args.combat, args.combat_seq)
    table = pd.DataFrame({name: {k: v for k, v in row.items() if k != "de_genes_listed"}
                          for name, row in scores["methods"].items()}).T
    print(table.to_string(float_format="%.4f"))
    print(f"pseudobulk: {scores['pseudobulk']}")
    out = args.out or Path.cwd() / (Path(args.corrected or args.raw).stem + ".null_scores.json")
    with atomic_output(out, overwrite=True) as tmp:
        tmp.write_text(json.dumps(scores, indent=2) + "\n")
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
