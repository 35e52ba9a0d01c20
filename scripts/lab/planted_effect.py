"""How much of a stress set's planted gene-wise effect each output leaves within cell types, apart from the data's
own differences between batches.

The removal score (batchfix.eval.removal) measures every within-label difference between batches: the planted
effect, the real data's own batch effects and the sampling noise of each batch's mean. A stress set
(scripts.stress_set) knows the first: each batch's mean log1p(counts per 10k) of each gene within a label, less the
label's mean over its batches (a deviation), is regressed over every (label, batch, gene) on

    planted  the batch's planted log factor of the gene (its stressed over its untouched counts, less the batch's
             median over genes: its depth), centred over the label's batches
    own      the same deviation of the untouched counts (the data's own batch differences and their noise)

Coefficient 1 on planted keeps the whole planted effect, 0 removes it, below 0 over-corrects; the residual's sd is
what neither explains (noise a correction adds, or a depth it keeps). Rows: the uncorrected data, batchfix's
corrected counts (the default, and with correction.depth=reference) and its denoised output (one default model per
seed), and ComBat, on the model's genes:

    python -m scripts.lab.planted_effect STRESS.h5ad --seeds 0 1 2
"""
from __future__ import annotations

import argparse

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

import batchfix
from batchfix.data.normalize import log_cp10k
from batchfix.eval import removal
from scripts import baselines
from scripts.lab.count_draws import seed_printed, seeds_written


def planted_log_factor(stressed: sp.spmatrix, truth: sp.spmatrix, batch: np.ndarray) -> np.ndarray:
    """(batches in sorted order, genes): log of each batch's stressed over untouched counts of each gene (one
    pseudo-count each), less the batch's median over genes."""
    names = np.unique(batch)
    stressed_sums = np.vstack([np.asarray(stressed[batch == name].sum(axis=0)).ravel() for name in names])
    truth_sums = np.vstack([np.asarray(truth[batch == name].sum(axis=0)).ravel() for name in names])
    factor = np.log((stressed_sums + 1.0) / (truth_sums + 1.0))
    return factor - np.median(factor, axis=1, keepdims=True)


def deviations(values: np.ndarray, rows: list[np.ndarray], scored: np.ndarray) -> np.ndarray:
    """(batches of the label, scored genes): each batch's mean of `values` less the label's mean over them."""
    means = removal.group_means(values, rows, False)
    return (means - means.mean(axis=0))[:, scored]


def decomposition(outputs: dict[str, np.ndarray], truth_log: np.ndarray, planted: np.ndarray, batch: np.ndarray,
                  labels: np.ndarray) -> pd.DataFrame:
    """Per output (cells x genes, log values): the least-squares coefficients of its within-label deviations on the
    planted factor and on the untouched counts' deviations (`truth_log`), the residual's sd and the deviations' sd;
    each label's genes with a mean of at least removal.MIN_MEAN in the untouched counts."""
    names = list(np.unique(batch))
    parts = {name: [] for name in outputs}
    known = []
    for rows in removal.label_batch_rows(batch, labels).values():
        scored = removal.group_means(truth_log, [np.concatenate(rows)], False)[0] >= removal.MIN_MEAN
        codes = [names.index(batch[r[0]]) for r in rows]
        factor = planted[codes][:, scored]
        known.append(np.column_stack([(factor - factor.mean(axis=0)).ravel(),
                                      deviations(truth_log, rows, scored).ravel()]))
        for name, values in outputs.items():
            parts[name].append(deviations(values, rows, scored).ravel())
    design = np.vstack(known)
    design = np.column_stack([design, np.ones(len(design))])
    table = {}
    for name, pieces in parts.items():
        target = np.concatenate(pieces)
        coef = np.linalg.lstsq(design, target, rcond=None)[0]
        table[name] = {"planted": coef[0], "own": coef[1], "residual sd": (target - design @ coef).std(),
                       "deviation sd": target.std()}
    return pd.DataFrame(table).T


def seed_outputs(cells: ad.AnnData, batch_key: str, label_key: str, seed: int) -> tuple[dict, np.ndarray]:
    """({row: (cells, model genes) log values}, the model genes' columns) from one default model trained on
    `cells`."""
    model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                           enable_progress_bar=False)
    columns = cells.var_names.get_indexer(model.genes)
    columns = columns[columns >= 0]
    raw = np.asarray(log_cp10k(sp.csr_matrix(cells.X, dtype=np.float64))[:, columns].toarray())
    outputs = {"uncorrected": raw}
    for name, depth in (("batchfix", "keep"), ("batchfix, depth=reference", "reference")):
        counts = batchfix.correct(cells, model, copy=True, progress=False, depth=depth).layers["batchfix_counts"]
        outputs[name] = np.asarray(log_cp10k(sp.csr_matrix(counts, dtype=np.float64))[:, columns].toarray())
    denoised = batchfix.correct(cells, model, copy=True, progress=False, output_mode="denoised").layers["batchfix"]
    outputs["batchfix denoised"] = np.asarray(sp.csr_matrix(denoised)[:, columns].toarray())
    outputs["ComBat"] = baselines.combat(raw, cells.obs, batch_key)
    return outputs, columns


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a stress set (.h5ad, its untouched counts in layers['truth'])")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", help="CSV of every seed's rows")
    args = parser.parse_args(argv)
    cells = ad.read_h5ad(args.data)
    batch = cells.obs[args.batch_key].astype(str).to_numpy()
    labels = cells.obs[args.label_key].astype(str).to_numpy()
    truth = sp.csr_matrix(cells.layers["truth"], dtype=np.float64)
    planted = planted_log_factor(sp.csr_matrix(cells.X, dtype=np.float64), truth, batch)
    frames = []
    for seed in args.seeds:
        outputs, columns = seed_outputs(cells, args.batch_key, args.label_key, seed)
        truth_log = np.asarray(log_cp10k(truth)[:, columns].toarray())
        frames.append(seed_printed(decomposition(outputs, truth_log, planted[:, columns], batch, labels), seed))
    return seeds_written(frames, args.out)


if __name__ == "__main__":
    main()
