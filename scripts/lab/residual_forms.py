"""Where the counterfactual output's batch signal sits: forms that change only the residual term.

The counterfactual output (batchfix/correction/counterfactual.py) is, for cell c of batch b,

    corrected = max(0, decoded_ref(z_c) + location_ref + k_b * r(c)),    r(c) = observed(c) - decoded_b(z_c) - location_b

and r holds each cell's own deviation from what the decoder expects for its state: counting noise, biology the
decoder misses, and batch-specific structure the decoder misses. Each row below replaces r by another form,
built from one model's terms (`harness.counterfactual_terms`; the default row is checked against
the package's log-scale output, regional_shift=apply):

    residual weight A        A r (correction.residual_weight=A): every part of r shrunk alike
    local mean kept, A       rbar + A (r - rbar), rbar the mean of r over the cell's LOCAL_NEIGHBOURS nearest cells
                             in the latent space, from every batch: what the decoder misses of a state, shared by
                             the batches, is kept whole and only the rest is shrunk
    cluster swap N           r - rbar(b, cl) + mean over batches of rbar(b', cl), per k-means cluster cl of the
                             latent (N clusters; (batch, cluster) groups of >= MIN_GROUP cells): the batch-specific
                             part of each state's mean residual removed, constant within a cluster
    linear swap              r - (z - zbar_b) (beta_b - mean beta): the batch-specific linear dependence of r on
                             the latent (ridge regression per batch, penalty RIDGE per cell) removed
    quantile match N         each gene's r in batch b mapped through its batch's empirical distribution onto the
                             batches' barycenter (the mean of their quantile functions at N levels): location,
                             spread and shape matched per gene and batch, order within a batch kept
    state 0.5 [, cluster     correction.state_dependence=0.5 (the decoder term shrunk halfway toward its batch mean),
    swap N]                  and with the cluster swap applied to all it leaves beyond decoded_ref + location_ref
                             (the residual and the state shift it does not apply)

Scored as scripts/lab/decoding_scale.py scores its rows, with the same options (--truth-layer, --model-dir, --out).

    nice python -m scripts.lab.residual_forms data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2
    nice python -m scripts.lab.residual_forms data/cellbench5.h5ad --seeds 0 1 2 --model-dir models/bundled
"""
from __future__ import annotations

import sys
from pathlib import Path

import anndata as ad
import numpy as np
import torch
from scipy.stats import rankdata
from sklearn.cluster import KMeans
from sklearn.neighbors import NearestNeighbors

import batchfix
from batchfix.nn.attention import fused_attention
from scripts.lab.decoding_scale import main, trained_model
from scripts.lab.harness import BATCH_SIZE, counterfactual_terms
from scripts.lab.marker_loss import check_shipped, reference_rows

WEIGHTS = (0.75, 0.5)  # residual weights of the plain and the local-mean-kept rows
LOCAL_NEIGHBOURS = 50
CLUSTERS = (5, 30)
MIN_GROUP = 10  # cells a (batch, cluster) group needs for its mean residual
RIDGE = 0.01  # ridge penalty per cell of the per-batch regression of r on the latent (close to least squares)
QUANTILES = (20, 100)
STATE = 0.5  # correction.state_dependence of the rows with the decoder term shrunk toward its batch mean


@torch.no_grad()
def latent_means(adata: ad.AnnData, model: batchfix.BatchfixModel) -> np.ndarray:
    """(cells, latent) the encoder's means, float64."""
    counts = np.asarray(adata[:, model.genes].X, dtype=np.float32)
    with fused_attention(model.net):
        blocks = [model.net.encode(torch.from_numpy(counts[start:start + BATCH_SIZE]))[0].numpy()
                  for start in range(0, len(counts), BATCH_SIZE)]
    return np.concatenate(blocks).astype(np.float64)


def local_mean(residual: np.ndarray, latent: np.ndarray, k: int) -> np.ndarray:
    """(cells, G) the mean residual of each cell's k nearest cells in the latent space (itself included)."""
    neighbours = NearestNeighbors(n_neighbors=k).fit(latent).kneighbors(latent, return_distance=False)  # (cells, k)
    return residual[neighbours].mean(axis=1)


def cluster_swap(residual: np.ndarray, codes: np.ndarray, clusters: np.ndarray) -> np.ndarray:
    """The residual with each (batch, cluster) group's mean replaced by the cluster's mean over its batches' means
    (groups of >= MIN_GROUP cells; a cluster with one such batch is left as it is)."""
    swapped = residual.copy()
    for cluster in np.unique(clusters):
        groups = {b: (clusters == cluster) & (codes == b) for b in np.unique(codes)}
        means = {b: residual[rows].mean(axis=0) for b, rows in groups.items() if rows.sum() >= MIN_GROUP}
        if len(means) < 2:
            continue
        pooled = np.mean(list(means.values()), axis=0)
        for b, mean in means.items():
            swapped[groups[b]] += pooled - mean
    return swapped


def linear_swap(residual: np.ndarray, codes: np.ndarray, latent: np.ndarray) -> np.ndarray:
    """The residual less its batch-specific linear dependence on the latent: (z - zbar_b) (beta_b - mean_b beta)."""
    batches = np.unique(codes)
    centred, betas = {}, {}
    for b in batches:
        rows = codes == b
        centred[b] = latent[rows] - latent[rows].mean(axis=0)  # (n_b, latent)
        gram = centred[b].T @ centred[b] + RIDGE * rows.sum() * np.eye(latent.shape[1])
        betas[b] = np.linalg.solve(gram, centred[b].T @ (residual[rows] - residual[rows].mean(axis=0)))  # (latent, G)
    mean_beta = np.mean(list(betas.values()), axis=0)
    swapped = residual.copy()
    for b in batches:
        swapped[codes == b] -= centred[b] @ (betas[b] - mean_beta)
    return swapped


def quantile_match(residual: np.ndarray, codes: np.ndarray, levels: int) -> np.ndarray:
    """Each gene's residual in each batch mapped onto the batches' barycenter: the mean over batches of their
    quantile functions at `levels` levels, read at the cell's within-batch rank (linear between levels)."""
    grid = (np.arange(levels) + 0.5) / levels
    batches = np.unique(codes)
    barycenter = np.mean([np.quantile(residual[codes == b], grid, axis=0) for b in batches], axis=0)  # (levels, G)
    genes = np.arange(residual.shape[1])[None, :]
    matched = np.empty_like(residual)
    for b in batches:
        rows = codes == b
        position = np.clip((rankdata(residual[rows], axis=0) - 0.5) / rows.sum() * levels - 0.5, 0, levels - 1)
        low = np.floor(position).astype(int)
        high = np.minimum(low + 1, levels - 1)
        share = position - low
        matched[rows] = (1 - share) * barycenter[low, genes] + share * barycenter[high, genes]
    return matched


def residual_rows(adata: ad.AnnData, batch_key: str, seed: int,
                  model_path: Path | None) -> tuple[list, np.ndarray, dict]:
    """(modelled genes, counts on them, {row: corrected matrix}): uncorrected, ComBat, the default and the forms."""
    model = trained_model(adata, batch_key, seed, model_path)
    terms = counterfactual_terms(adata, model, batch_key)
    default = np.maximum(terms.unclipped(), 0.0)
    check_shipped(default, adata, model, batch_key, "default")
    residual = terms.observed - terms.own - terms.location  # (cells, G)
    base = terms.reference + terms.ref_location

    def output(form: np.ndarray, scale: np.ndarray = terms.scale) -> np.ndarray:
        return np.maximum(base + scale * form, 0.0)

    latent = latent_means(adata, model)
    shared = local_mean(residual, latent, LOCAL_NEIGHBOURS)
    rows = {"default": default}
    rows.update({f"residual weight {a:g}": output(a * residual) for a in WEIGHTS})
    rows.update({f"local mean kept, {a:g}": output(shared + a * (residual - shared)) for a in WEIGHTS})
    clusters = {n: KMeans(n_clusters=n, n_init=10, random_state=seed).fit_predict(latent) for n in CLUSTERS}
    rows.update({f"cluster swap {n}": output(cluster_swap(residual, terms.codes, clusters[n])) for n in CLUSTERS})
    rows["linear swap"] = output(linear_swap(residual, terms.codes, latent))
    rows.update({f"quantile match {n}": output(quantile_match(residual, terms.codes, n), 1.0) for n in QUANTILES})
    decoder = terms.decoder
    state = terms.unclipped(decoder=terms.state_shrunk(decoder, STATE)) - base  # (cells, G): all beyond the base
    rows[f"state {STATE:g}"] = np.maximum(base + state, 0.0)
    swapped = cluster_swap(state, terms.codes, clusters[CLUSTERS[0]])
    rows[f"state {STATE:g}, cluster swap {CLUSTERS[0]}"] = np.maximum(base + swapped, 0.0)
    counts, uncorrected = reference_rows(adata, model.genes, batch_key)
    return list(model.genes), counts, {**uncorrected, **rows}


if __name__ == "__main__":
    sys.exit(main(build=residual_rows))
