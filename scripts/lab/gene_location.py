"""What the corrected counts leave of each gene's batch effect, batch-wide: an empirical location per (batch, gene)
measured after the model's correction within state groups, weighed by its evidence and applied on top (a
measurement of the mechanism, outside the engine: the location scales the corrected counts, so its rows are not
counts).

For each batch b and gene g, with the corrected counts' mean share L_bkg of the gene in b's cells of state group k
(10 k-means groups of the output latent, as batchfix.correction.state_groups fits them), R_kg the mean of log L_jkg
over the batches with MIN_CELLS cells in k:

    delta_bg = sum_k n_bk (R_kg - log L_bkg) / sum_k n_bk     over the groups every such batch expresses g in
    var      = sum_k (n_bk / n_b)^2 var(R_kg - log L_bkg)     each log L's var(share) / (n L^2), the covariance
                                                              with the reference counted
    applied  = delta_bg * evidence.shrinkage(delta_b, var_b)  (a prior across the batch's genes, centred on 0)

Rows (one default model per seed, trained on the cells, every gene):

    batchfix                                   depth=keep (the default)
    batchfix + gene location                   the same, each batch's genes scaled by exp(applied)
    batchfix + gene location, unweighted       scaled by exp(delta_bg): every location applied, as ComBat does
    batchfix, depth=reference                  each batch's depth brought to the reference's
    batchfix, depth=reference + gene location (and unweighted)
    ComBat, noise floor                        as scripts/lab/library_shift.py

    python -m scripts.lab.gene_location data/cellbench5.h5ad --batches sc_celseq2_5cl_p1 sc_celseq2_5cl_p2 \\
        sc_celseq2_5cl_p3 --seeds 0 1 2
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.cluster import KMeans

import batchfix
from batchfix.correction import evidence
from scripts.lab.evidence_forms import paired_runs

MIN_CELLS = 10  # a batch's cells in a state group for its level there to count
N_GROUPS = 10  # k-means groups of the latent, as batchfix.correction.state_groups


def group_levels(shares: sp.csr_matrix, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((genes,) mean share of the rows, (genes,) the sampling variance of its log)."""
    part = shares[rows]
    mean = np.asarray(part.mean(axis=0)).ravel()
    square = np.asarray(part.multiply(part).mean(axis=0)).ravel()
    with np.errstate(divide="ignore", invalid="ignore"):
        variance = np.maximum(square - mean**2, 0.0) / (len(rows) * mean**2)
    return mean, variance


def gene_location(counts: sp.csr_matrix, batch: np.ndarray, groups: np.ndarray) -> dict[str, tuple]:
    """Per batch: ((genes,) delta, (genes,) its variance) as the module docstring defines them."""
    counts = sp.csr_matrix(counts, dtype=np.float64)
    library = np.asarray(counts.sum(axis=1)).ravel()
    shares = sp.csr_matrix(sp.diags(1.0 / np.maximum(library, 1.0)) @ counts)
    n_genes, batches = counts.shape[1], np.unique(batch)
    total = {b: np.zeros(n_genes) for b in batches}
    variance = {b: np.zeros(n_genes) for b in batches}
    weight = {b: np.zeros(n_genes) for b in batches}
    for group in np.unique(groups):
        members = {b: np.flatnonzero((groups == group) & (batch == b)) for b in batches}
        members = {b: rows for b, rows in members.items() if len(rows) >= MIN_CELLS}
        if len(members) < 2:
            continue
        levels = {b: group_levels(shares, rows) for b, rows in members.items()}
        expressed = np.all([level > 0 for level, _ in levels.values()], axis=0)
        logs = {b: np.log(np.where(expressed, level, 1.0)) for b, (level, _) in levels.items()}
        reference = np.mean(list(logs.values()), axis=0)
        share = 1.0 / len(members)
        reference_variance = sum(np.where(expressed, v, 0.0) for _, v in levels.values()) * share**2
        for b, rows in members.items():
            own = np.where(expressed, levels[b][1], 0.0)
            n = np.where(expressed, len(rows), 0.0)
            total[b] += n * (reference - logs[b])
            variance[b] += n**2 * (own * (1 - 2 * share) + reference_variance)
            weight[b] += n
    result = {}
    for b in batches:
        cells = np.maximum(weight[b], 1.0)
        result[b] = (np.where(weight[b] > 0, total[b] / cells, 0.0), variance[b] / cells**2)
    return result


def located(counts: sp.csr_matrix, batch: np.ndarray, groups: np.ndarray) -> tuple[dict[str, sp.csr_matrix], dict]:
    """({"weighted": the counts with each batch's genes scaled by exp of its evidence-weighted location,
    "unweighted": by exp of the whole location}, per batch: the share of genes given a location by the weights and
    the variance over genes of delta / sd, which is 1 where every location is sampling noise alone)."""
    factors = {"weighted": np.ones(counts.shape), "unweighted": np.ones(counts.shape)}
    summary = {}
    for b, (delta, variance) in gene_location(counts, batch, groups).items():
        measured = variance > 0
        weighted = np.zeros_like(delta)
        weighted[measured] = delta[measured] * evidence.shrinkage(delta[measured], variance[measured])[0]
        factors["weighted"][batch == b] = np.exp(weighted)
        factors["unweighted"][batch == b] = np.exp(delta)
        z = delta[measured] / np.sqrt(variance[measured])
        summary[b] = (round(float((weighted != 0).mean()), 3), round(float(z.var()), 2))
    counts = sp.csr_matrix(counts, dtype=np.float64)
    return {form: sp.csr_matrix(counts.multiply(factor)) for form, factor in factors.items()}, summary


def batchfix_rows(cells, batch_key: str, label_key: str, seed: int) -> dict[str, sp.csr_matrix]:
    """Both depths' corrected counts of one default model, each with and without the gene location."""
    model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                           enable_progress_bar=False)
    batch = cells.obs[batch_key].astype(str).to_numpy()
    rows = {}
    for depth, name in (("keep", "batchfix"), ("reference", "batchfix, depth=reference")):
        corrected = batchfix.correct(cells, model, copy=True, progress=False, depth=depth)
        counts = sp.csr_matrix(corrected.layers["batchfix_counts"])
        n_groups = min(N_GROUPS, max(1, len(cells) // 200))
        groups = KMeans(n_clusters=n_groups, n_init=4, random_state=seed).fit_predict(corrected.obsm["X_batchfix"])
        forms, summary = located(counts, batch, groups)
        rows[name] = counts
        rows[f"{name} + gene location"] = forms["weighted"]
        rows[f"{name} + gene location, unweighted"] = forms["unweighted"]
        print(f"seed {seed}, {name}: per batch (share of genes given a location, variance of location / sd) "
              f"{summary}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return paired_runs(argv, __doc__, batchfix_rows, "batchfix")


if __name__ == "__main__":
    main()
