"""Batch-mixing and biology-conservation scores, computed with scib-metrics' `Benchmarker`.

Scores are unscaled (`get_results(min_max_scale=False)`), so a number means the same thing in
every table. Batch correction = mean of BRAS, iLISI, kBET per label, graph connectivity and PCR
comparison; bio conservation = mean of isolated labels, KMeans NMI/ARI, label silhouette and
cLISI; Total = 0.4 batch + 0.6 bio (the scIB weighting, as in scib-metrics).

Without cell-type labels only the label-free batch metrics (iLISI, PCR comparison) are
computed: BRAS, kBET per label and graph connectivity are defined per label, and running them
on one dummy label would let differences in cell-type composition between batches pass for
batch effects. Bio conservation and Total are then NaN, and `LABEL_FREE_NOTE` says why.

Their markdown tables: batchfix.eval.reports; UMAP pictures of the embeddings: batchfix.eval.umap_plots.
"""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Mapping

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp
from scib_metrics.benchmark import BatchCorrection, Benchmarker, BioConservation

from batchfix.config import NEIGHBOR_METHODS, EvaluationOptions
from batchfix.data.io import OutputKeys
from batchfix.data.normalize import log_cp10k
from batchfix.errors import InputError
from batchfix.eval import cnv, fidelity

BATCH_SCORE = "Batch correction"
BIO_SCORE = "Bio conservation"
TOTAL_SCORE = "Total"
AGGREGATE_COLUMNS = [BATCH_SCORE, BIO_SCORE, TOTAL_SCORE]

UNINTEGRATED = "Unintegrated PCA"
LATENT = "batchfix latent"
CORRECTED = "batchfix corrected expression (PCA)"

LABEL_FREE_NOTE = (
    "No label key: bio conservation was not scored; batch correction is the mean of the "
    "label-free metrics iLISI and PCR comparison only (not comparable to a labelled run). Mixing alone rewards "
    "over-correction: merging distinct cell types mixes batches too; look at the UMAP, or score with "
    "data.label_key=<obs column>."
)
_LABEL_FREE_BATCH_METRICS = BatchCorrection(
    bras=False, kbet_per_label=False, graph_connectivity=False
)
_DUMMY_LABEL = "_batchfix_no_label"


def pca_embedding(matrix, n_comps: int = 50, seed: int = 0) -> np.ndarray:
    """PCA (ARPACK, centred) of a cells x genes log-expression matrix, dense or sparse."""
    n_comps = min(n_comps, min(matrix.shape) - 1)
    pcs = sc.pp.pca(
        ad.AnnData(matrix.astype(np.float32, copy=False)),
        n_comps=n_comps,
        svd_solver="arpack",
        random_state=seed,
        copy=True,
    ).obsm["X_pca"]
    return np.asarray(pcs, dtype=np.float32)


def score_embeddings(
    obs: pd.DataFrame,
    embeddings: Mapping[str, np.ndarray],
    unintegrated: np.ndarray,
    batch_key: str,
    label_key: str | None,
    neighbors: str = EvaluationOptions.neighbors,
) -> pd.DataFrame:
    """Score each embedding against the unintegrated embedding with scib-metrics (neighbour graphs:
    `neighbors`, one of NEIGHBOR_METHODS; see `resolve_neighbors`).

    Returns one row per embedding name (in the given order) with every metric column, then
    'Batch correction', 'Bio conservation' and 'Total' (NaN for the last two without labels).
    """
    if not embeddings:
        raise ValueError("No embeddings to score.")
    n_cells = len(obs)
    for name, emb in {**embeddings, "unintegrated": unintegrated}.items():
        if emb.ndim != 2 or emb.shape[0] != n_cells:
            raise ValueError(f"Embedding {name!r} has shape {emb.shape}; expected ({n_cells}, k).")
    check_obs_keys(obs, batch_key, label_key)

    keys = [f"emb{i}" for i in range(len(embeddings))]
    frame = pd.DataFrame(index=obs.index.astype(str))
    frame["batch"] = obs[batch_key].astype(str).to_numpy()
    frame["labels"] = obs[label_key].astype(str).to_numpy() if label_key else _DUMMY_LABEL
    holder = ad.AnnData(obs=frame)
    for key, emb in zip(keys, embeddings.values()):
        holder.obsm[key] = np.asarray(emb, dtype=np.float32)
    holder.obsm["X_unintegrated"] = np.asarray(unintegrated, dtype=np.float32)

    bench = Benchmarker(
        holder,
        batch_key="batch",
        label_key="labels",
        embedding_obsm_keys=keys,
        bio_conservation_metrics=BioConservation() if label_key else None,
        batch_correction_metrics=BatchCorrection() if label_key else _LABEL_FREE_BATCH_METRICS,
        pre_integrated_embedding_obsm_key="X_unintegrated",
        n_jobs=1,
        progress_bar=False,
    )
    exact = resolve_neighbors(neighbors, n_cells) == "exact"
    bench.prepare(neighbor_computer=exact_neighbors if exact else None)
    with frozen_heap(), exact_diffusion_neighbors() if exact else contextlib.nullcontext():
        bench.benchmark()
    results = bench.get_results(min_max_scale=False)
    results = results.loc[keys].astype(float)
    results.index = list(embeddings)
    results.index.name = "Embedding"
    for column in AGGREGATE_COLUMNS:
        if column not in results:
            results[column] = np.nan
    metric_columns = [c for c in results.columns if c not in AGGREGATE_COLUMNS]
    return results[metric_columns + AGGREGATE_COLUMNS]


# How the scores' neighbour graphs are found: "approximate" = scib-metrics' pynndescent (its default; the
# benchmark's, like the reference scores'), "exact" = brute force (well under a second for a few thousand
# cells, seconds for 20,000), "auto" (train's and evaluate's default) = exact up to EXACT_NEIGHBORS_MAX_CELLS.
# pynndescent's numba code takes functions as arguments, so no cache keeps it: every process compiles it
# again (20-45 s on a 2-core CPU); exact search compiles nothing. On the bundled data pynndescent finds
# 99.998% of the exact neighbours; kBET, which weighs the neighbours by distance, still moves between the two.
EXACT_NEIGHBORS_MAX_CELLS = 50_000


def resolve_neighbors(method: str, n_cells: int) -> str:
    """'exact' or 'approximate': what `method` (one of NEIGHBOR_METHODS) means for n_cells scored cells."""
    if method not in NEIGHBOR_METHODS:
        raise ValueError(f"neighbors must be one of {list(NEIGHBOR_METHODS)}, got {method!r}.")
    if method == "auto":
        return "exact" if n_cells <= EXACT_NEIGHBORS_MAX_CELLS else "approximate"
    return method


@contextlib.contextmanager
def frozen_heap():
    """Within it, the garbage collector skips every object that existed before.

    scib-metrics' Benchmarker runs gc.collect() after each metric of each embedding (30 times for three
    embeddings); in a process holding torch and Lightning each pass walks the whole heap (about 0.5 s each on a
    2-core CPU: 16 s of a 1,000-cell evaluation). Nothing scoring allocates is kept from the collector.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def exact_diffusion_neighbors():
    """Within it, scib-metrics' kBET finds its diffusion-map neighbours exactly too.

    kbet_per_label re-embeds each label's cells (scib_metrics.utils.diffusion_nn) and searches them with
    `scib_metrics.nearest_neighbors.pynndescent` whatever graph it was given; with exact graphs asked for,
    that search is routed to `exact_neighbors` so no pynndescent code is compiled.
    """
    import scib_metrics.nearest_neighbors as scib_neighbors

    original = scib_neighbors.pynndescent
    scib_neighbors.pynndescent = lambda x, n_neighbors, **_: exact_neighbors(x, n_neighbors)
    try:
        yield
    finally:
        scib_neighbors.pynndescent = original


def exact_neighbors(x: np.ndarray, n_neighbors: int):
    """scib-metrics' NeighborsResults of the exact euclidean nearest neighbours (each cell first)."""
    from scib_metrics.nearest_neighbors import NeighborsResults
    from sklearn.neighbors import NearestNeighbors

    distances, indices = NearestNeighbors(n_neighbors=n_neighbors, algorithm="brute").fit(x).kneighbors(x)
    # pynndescent's types: scib-metrics' kernels are compiled for them
    return NeighborsResults(indices=indices.astype(np.int32), distances=distances.astype(np.float32))


def evaluation_embeddings(
    adata: ad.AnnData,
    keys: OutputKeys,
    counts_layer: str | None = None,
    n_comps: int = 50,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], dict]:
    """The embeddings to score for an AnnData corrected under `keys`, first the uncorrected PCA.

    Genes are those the correction modelled (`var[keys.modelled]`, else all). The uncorrected
    PCA is of log1p(counts per 10k) of the counts (X or `counts_layer`) restricted to those genes
    first, so library sizes are over the same genes the correction models; values that are not
    whole numbers are taken as already log-scale and used as given. Returns (embeddings by name,
    a JSON-able description of what was used).
    """
    _check_adata_keys(adata, keys, counts_layer=counts_layer)
    genes = modelled_genes(adata, keys)

    counts = adata.layers[counts_layer] if counts_layer else adata.X
    counts = counts[:, genes]
    integer_counts = is_integer_valued(counts)
    uncorrected = log_cp10k(counts) if integer_counts else counts
    embeddings = {
        UNINTEGRATED: pca_embedding(uncorrected, n_comps, seed),
        LATENT: np.asarray(adata.obsm[keys.latent], dtype=np.float32),
        CORRECTED: pca_embedding(adata.layers[keys.layer][:, genes], n_comps, seed),
    }

    info = {
        "n_cells": int(adata.n_obs),
        "n_genes_scored": int(genes.sum()),
        "genes": f"var['{keys.modelled}']" if keys.modelled in adata.var else "all genes",
        "uncorrected_source": (
            f"{counts_layer or 'X'} counts, log1p(counts per 10k)"
            if integer_counts
            else f"{counts_layer or 'X'} as given (not whole-number counts: taken as log-scale)"
        ),
        "corrected_layer": keys.layer,
        "latent_key": keys.latent,
        "pca_components": int(embeddings[UNINTEGRATED].shape[1]),
    }
    return embeddings, info


def gene_level_scores(
    adata: ad.AnnData,
    keys: OutputKeys,
    batch_key: str,
    label_key: str | None,
    counts_layer: str | None = None,
) -> dict:
    """Gene-level fidelity (batchfix.eval.fidelity) of layers[keys.layer] on the modelled genes, against the
    within-batch log1p(counts per 10k) of the raw counts (X or `counts_layer`) of the same genes.

    Without labels only HVG conservation is computed (the result's `note` says so). Counts that
    are not whole numbers give no scores, with a note: the reference is made from raw counts.
    """
    _check_adata_keys(adata, keys, counts_layer=counts_layer)
    genes = modelled_genes(adata, keys)
    counts = (adata.layers[counts_layer] if counts_layer else adata.X)[:, genes]
    source = f"{counts_layer or 'X'} on var['{keys.modelled}']" if keys.modelled in adata.var else counts_layer or "X"
    if not is_integer_valued(counts):
        return {**dict.fromkeys(fidelity.GENE_METRICS), "reference": source,
                "note": f"{counts_layer or 'X'} does not hold raw counts: the gene-level scores, which compare with "
                        "log1p(counts per 10k) of the raw counts, were not computed (set the counts layer)."}
    labels = adata.obs[label_key].to_numpy() if label_key else None
    over_all = "log_transform" in adata.uns.get(keys.uns, {})  # the counts' log layer: normalize_total, all genes
    raw = adata.layers[counts_layer] if counts_layer else adata.X
    library = np.asarray(raw.sum(axis=1), dtype=np.float64).ravel() if over_all else None
    result = fidelity.gene_fidelity(counts, adata.layers[keys.layer][:, genes], adata.obs[batch_key].to_numpy(),
                                    labels, library=library)
    per = "all genes' counts" if over_all else "these genes' counts"
    return {"reference": f"log1p(counts per 10k of {per}) of {source}, within each batch", **result}


def cnv_level_scores(adata: ad.AnnData, keys: OutputKeys, batch_key: str, label_key: str | None,
                     counts_layer: str | None = None) -> dict:
    """CNV profile retention (batchfix.eval.cnv) of layers[keys.layer] on the modelled genes placed by
    var['chromosome'] and var['start'], against log1p(counts per 10k) of the raw counts of the same genes.

    Needs labels, coordinates in var and raw counts; otherwise None scores with a note saying which is missing.
    """
    empty = {"retention_r": None, "uncorrected_r": None, "relative_r": None, "amplitude_ratio": None}
    genes = modelled_genes(adata, keys)
    counts = (adata.layers[counts_layer] if counts_layer else adata.X)[:, genes]
    if label_key is None:
        return {**empty, "note": "no label key: CNV profile retention compares each label across batches"}
    if not {"chromosome", "start"} <= set(adata.var.columns):
        return {**empty, "note": f"var has no 'chromosome' and 'start' columns (it has {list(adata.var.columns)}): "
                                 "no CNV profiles"}
    if not is_integer_valued(counts):
        return {**empty, "note": f"{counts_layer or 'X'} does not hold raw counts: no CNV profiles"}
    placed = adata.var.iloc[np.flatnonzero(genes)]
    profiled = placed["chromosome"].astype(str).str.replace(r"^chr", "", regex=True).isin(cnv.CHROMOSOMES)
    if not (profiled & pd.to_numeric(placed["start"], errors="coerce").notna()).any():
        return {**empty, "note": "no modelled gene lies on a profiled chromosome: no CNV profiles"}
    windows = cnv.windows_of(placed)
    result = cnv.profile_retention(log_cp10k(counts), adata.layers[keys.layer][:, genes],
                                   adata.obs[batch_key].to_numpy(), adata.obs[label_key].to_numpy(), windows)
    return {"profile": f"windows of {cnv.WINDOW} genes, step {cnv.STEP} (batchfix.eval.cnv)",
            "n_genes": int(profiled.sum()), "n_windows": len(windows.members),
            **{k: v for k, v in result.items() if k != "groups"}}


def score_evaluation(
    obs: pd.DataFrame,
    embeddings: Mapping[str, np.ndarray],
    info: Mapping,
    batch_key: str,
    label_key: str | None,
    neighbors: str = EvaluationOptions.neighbors,
) -> tuple[pd.DataFrame, dict]:
    """Score `evaluation_embeddings` output; returns (scores table, JSON-able results dict)."""
    start = time.perf_counter()
    table = score_embeddings(obs, embeddings, embeddings[UNINTEGRATED], batch_key, label_key, neighbors)
    result = results_dict(table, batch_key, label_key, info, time.perf_counter() - start)
    return table, result


def results_dict(
    table: pd.DataFrame,
    batch_key: str,
    label_key: str | None,
    info: Mapping | None = None,
    scoring_seconds: float | None = None,
) -> dict:
    """JSON-able dict of a `score_embeddings` table (NaN becomes None)."""
    scores = {
        name: {col: _json_number(val) for col, val in row.items()} for name, row in table.iterrows()
    }
    out = {
        "batch_key": batch_key,
        "label_key": label_key,
        "bio_conservation_scored": label_key is not None,
        **(dict(info) if info else {}),
        "scores": scores,
    }
    if scoring_seconds is not None:
        out["scoring_seconds"] = round(scoring_seconds, 2)
    if label_key is None:
        out["note"] = LABEL_FREE_NOTE
    return out


def headline(metrics: dict) -> float | None:
    """The number a sweep optimises: corrected-expression Total when evaluated, else the validation negative ELBO."""
    scores = (metrics.get("evaluation") or {}).get("scores", {})
    total = scores.get(CORRECTED, {}).get(TOTAL_SCORE)
    if total is not None:
        return float(total)
    loss = metrics.get("losses", {}).get("val_elbo")
    return None if loss is None else float(loss)


MIN_SCORED_CELLS = 90  # scib-metrics' neighbour graphs hold 90 neighbours per cell


def check_enough_cells(obs: pd.DataFrame) -> None:
    """Refuse a file with too few cells for `evaluate`'s neighbour graphs, before the scoring time."""
    if len(obs) < MIN_SCORED_CELLS:
        raise InputError(f"Scoring needs at least {MIN_SCORED_CELLS} cells (scib-metrics' neighbour graphs); the file "
                         f"has {len(obs)}.")


def check_obs_keys(obs: pd.DataFrame, batch_key: str, label_key: str | None) -> None:
    """Refuse, before the scoring time, what scib-metrics would fail on after it: a missing column or value, a
    single batch, or labels that name single cells."""
    for what, key in (("batch key", batch_key), ("label key", label_key)):
        if key is not None and key not in obs.columns:
            raise InputError(
                f"The {what} {key!r} is not an obs column; obs has: {sorted(map(str, obs.columns))}"
            )
        if key is not None and obs[key].isna().any():
            raise InputError(f"obs['{key}'] has {int(obs[key].isna().sum())} missing values: scoring needs a "
                             f"{what.split()[0]} for every cell (drop those cells, or fill them in).")
    if obs[batch_key].nunique() < 2:
        raise InputError(f"obs['{batch_key}'] holds one batch: batch mixing needs at least two. Is data.batch_key "
                         "the column that names the batches?")
    if label_key is not None and obs[label_key].nunique() > len(obs) // 2:
        raise InputError(f"obs['{label_key}'] has {obs[label_key].nunique()} labels for {len(obs)} cells: labels "
                         "group cells (cell types). Is data.label_key the column of cell types? (null: no labels)")


def _check_adata_keys(adata, keys: OutputKeys, counts_layer) -> None:
    for what, key, where in (
        ("corrected layer", keys.layer, adata.layers),
        ("counts layer", counts_layer, adata.layers),
        ("latent obsm key", keys.latent, adata.obsm),
    ):
        if key is not None and key not in where:
            raise InputError(f"The {what} {key!r} is missing; the file has: {sorted(where.keys())}. "
                             "Was it corrected under another key_added?")


def modelled_genes(adata: ad.AnnData, keys: OutputKeys) -> np.ndarray:
    """Boolean mask of the modelled genes (var[keys.modelled]; every gene when the column is missing)."""
    if keys.modelled not in adata.var:
        return np.ones(adata.n_vars, dtype=bool)
    mask = adata.var[keys.modelled].to_numpy().astype(bool)
    if not mask.any():
        raise InputError(f"var['{keys.modelled}'] marks no gene as modelled.")
    return mask


def is_integer_valued(matrix, n_sample: int = 100_000) -> bool:
    """Whether the first n_sample stored values are non-negative whole numbers (raw counts)."""
    values = matrix.data if sp.issparse(matrix) else np.asarray(matrix).ravel()
    values = values[:n_sample]
    return bool(np.all(values >= 0) and np.all(np.mod(values, 1) == 0))


def _json_number(value) -> float | None:
    return None if pd.isna(value) else float(value)
