"""Evaluate a corrected .h5ad: scores (JSON + markdown) and a UMAP picture, into one folder."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import anndata as ad
import h5py
import numpy as np

try:  # anndata >= 0.11
    from anndata.io import read_elem
except ImportError:  # pragma: no cover - older anndata
    from anndata.experimental import read_elem

from batchfix import runfolder
from batchfix.config import CorrectionOptions, EvaluateConfig, EvaluationOptions
from batchfix.data import ondisk
from batchfix.data.atomic import atomic_output
from batchfix.data.io import OutputKeys, check_h5ad_path, input_path, obs_strings, read_h5ad
from batchfix.data.subsample import SEED, stratified_rows
from batchfix.errors import InputError
from batchfix.eval import caches, matrix_scores, metrics, reports, umap_plots
from batchfix.runfolder import METRICS_JSON, METRICS_MD, UMAP_PNG

log = logging.getLogger(__name__)


def evaluate(cfg: EvaluateConfig, out_dir: str | Path) -> dict:
    """The evaluate verb: score cfg.input (null = the bundled dataset) into out_dir (refused if it holds a run or
    an evaluation, unless cfg.overwrite)."""
    out_dir = Path(out_dir)
    runfolder.check_evaluation_folder(out_dir, cfg.overwrite)
    source = input_path(cfg.input)
    out_dir.mkdir(parents=True, exist_ok=True)
    with runfolder.held(out_dir):  # no other command writes into it meanwhile
        runfolder.check_evaluation_folder(out_dir, cfg.overwrite)
        return evaluate_file(source, cfg.data.batch_key, cfg.data.label_key, out_dir,
                             counts_layer=cfg.data.counts_layer, key_added=cfg.correction.key_added,
                             max_cells=cfg.evaluation.max_cells, neighbors=cfg.evaluation.neighbors)


def evaluate_file(
    path,
    batch_key: str,
    label_key: str | None,
    out_dir,
    counts_layer: str | None = None,
    key_added: str = CorrectionOptions.key_added,
    max_cells: int = EvaluationOptions.max_cells,
    neighbors: str = EvaluationOptions.neighbors,
    in_memory: bool = False,
) -> dict:
    """Score a corrected file (never modified) and write metrics.json, metrics.md, umap.png (`in_memory`: the
    file is batchfix.evaluate's copy of an AnnData, whose scratch paths the progress lines do not name).

    Scored with scib-metrics: the latent `obsm['X_<key_added>']`, the PCA of `layers[key_added]` and
    the uncorrected PCA, all on the modelled genes (see `batchfix.eval.metrics.evaluation_embeddings`).
    Scored gene by gene (`gene_fidelity` in the result): `layers[key_added]` against the raw counts
    on the same genes, within each batch (`batchfix.eval.metrics.gene_level_scores`), and by the matrix
    scores of `batchfix.eval.matrix_scores` on the modelled genes (`matrix_scores` in the result: detection
    calibration against a batch-free NB; raw zeros raised; between-batch DE on zero-raw genes; the gene-level batch
    effect left within each label; from the model
    checks the correction stored in uns[key_added], the genes the model misfits and detection against its
    reference).
    Returns the metrics dict written to metrics.json.

    `neighbors`: "exact", "approximate" (pynndescent, scib-metrics' default) or "auto" (exact up to
    batchfix.eval.metrics.EXACT_NEIGHBORS_MAX_CELLS scored cells) neighbour graphs for the scores and the UMAP;
    the result's `neighbors` says which were used. A file of more than `max_cells` cells is scored (every
    score and the UMAP) on a subsample of `max_cells` cells stratified by batch x label (by batch without
    labels), read from disk without loading the rest; the result's `subsample` says so. JAX and numba
    compile into a user cache directory (batchfix.eval.caches), so a second evaluation does not compile again.
    """
    started = time.perf_counter()
    caches.enable()
    source = "an AnnData in memory" if in_memory else str(path)
    log.info("Reading %s ...", source)
    adata, subsample = read_for_scoring(path, batch_key, label_key, max_cells, OutputKeys(key_added),
                                        counts_layer)
    metrics.check_enough_cells(adata.obs)  # first: a file of no or few cells is named as such, not as one batch
    metrics.check_obs_keys(adata.obs, batch_key, label_key)
    embeddings, info = metrics.evaluation_embeddings(adata, OutputKeys(key_added), counts_layer)
    neighbors = metrics.resolve_neighbors(neighbors, adata.n_obs)
    log.info("Scoring %d cells (%s neighbours; %s): %s ...", adata.n_obs, neighbors,
             "batch mixing and bio conservation" if label_key else "batch mixing only: no data.label_key",
             ", ".join(embeddings))
    table, result = metrics.score_evaluation(
        adata.obs, embeddings, {"input": source, **info, "neighbors": neighbors}, batch_key, label_key,
        neighbors,
    )
    log.info("Gene-level fidelity and CNV profiles of layers['%s'] ...", key_added)
    result["gene_fidelity"] = metrics.gene_level_scores(adata, OutputKeys(key_added), batch_key, label_key,
                                                        counts_layer)
    result["cnv_fidelity"] = metrics.cnv_level_scores(adata, OutputKeys(key_added), batch_key, label_key,
                                                      counts_layer)
    result["matrix_scores"] = matrix_scores.corrected_matrix_scores(
        adata, key_added, metrics.modelled_genes(adata, OutputKeys(key_added)), batch_key, label_key, counts_layer)
    if subsample is not None:
        result["subsample"] = subsample

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = adata.obs[label_key] if label_key else None
    log.info("UMAPs of %d embeddings ...", len(embeddings))
    with atomic_output(out_dir / UMAP_PNG, overwrite=True) as tmp:
        umap_plots.plot_umaps(embeddings, adata.obs[batch_key], labels, tmp, image_format="png", neighbors=neighbors)
    result["evaluation_seconds"] = round(time.perf_counter() - started, 2)
    write_reports(out_dir, table, result)
    where = "" if in_memory else f": {METRICS_JSON}, {METRICS_MD} and {UMAP_PNG} in {out_dir}"
    log.info("Scored in %.0f s%s.", result["evaluation_seconds"], where)
    return result


def write_reports(out_dir: Path, table, result: dict) -> None:
    """metrics.md and metrics.json in `out_dir` (atomically)."""
    with atomic_output(out_dir / METRICS_MD, overwrite=True) as tmp:
        tmp.write_text(_markdown_report(table, result))
    with atomic_output(out_dir / METRICS_JSON, overwrite=True) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")


def read_for_scoring(source, batch_key: str, label_key: str | None, max_cells: int, keys: OutputKeys,
                     counts_layer: str | None) -> tuple[ad.AnnData, dict | None]:
    """The corrected file whole (no more than max_cells cells), else a stratified subsample of its cells
    with only what scoring reads (obs, var, the counts, the corrected layer and the latent), and a
    description of the subsample (None when every cell is scored)."""
    path = check_h5ad_path(source)
    try:
        with h5py.File(path, "r") as f:
            ondisk.check_anndata_file(f, path)
            n_obs = ondisk.n_obs_of(f)
            if n_obs <= max_cells:
                rows = None
            else:
                strata = [stratum_column(f, key) for key in (batch_key, label_key) if key]
                rows = stratified_rows([s for s in strata if s is not None], max_cells) \
                    if all(s is not None for s in strata) else None
            if rows is not None:
                adata = read_rows(f, rows, keys, counts_layer)
    except OSError as err:
        raise InputError(f"Cannot read {path} as AnnData: {type(err).__name__}: {err}") from err
    if rows is None:
        return read_h5ad(path), None
    by = [key for key in (batch_key, label_key) if key]
    log.info("Scoring %d of %d cells (evaluation.max_cells=%d), stratified by %s.", len(rows), n_obs, max_cells,
             " x ".join(by))
    return adata, {"n_cells": len(rows), "of_cells": n_obs, "max_cells": max_cells, "stratified_by": by,
                   "seed": SEED}


def stratum_column(f: h5py.File, key: str):
    """obs[key] as strings, or None when it is missing (the scoring then reports it)."""
    column = ondisk.read_obs_column(f, key)
    return None if column is None else obs_strings(column, key)


def read_rows(f: h5py.File, rows: np.ndarray, keys: OutputKeys, counts_layer: str | None) -> ad.AnnData:
    """The cells `rows` (ascending) of an open .h5ad: obs, var, the counts (X or counts_layer), the corrected
    layer, the latent and uns[key_added]; a missing layer or latent is named with what the file has."""
    layers = list(f["layers"].keys()) if "layers" in f else []
    obsm = list(f["obsm"].keys()) if "obsm" in f else []
    for what, key, where in (("corrected layer", keys.layer, layers), ("counts layer", counts_layer, layers),
                             ("latent obsm key", keys.latent, obsm)):
        if key is not None and key not in where:
            raise InputError(f"The {what} {key!r} is missing; the file has: {sorted(where)}. "
                             "Was it corrected under another key_added?")
    obs = read_elem(f["obs"]).iloc[rows]
    var = read_elem(f["var"])
    x = ondisk.open_rows(ondisk.matrix_element(f, counts_layer)).take(rows)
    adata = ad.AnnData(X=None, obs=obs, var=var)
    adata.layers[keys.layer] = ondisk.open_rows(f["layers"][keys.layer]).take(rows)
    if counts_layer is None:
        adata.X = x
    else:
        adata.layers[counts_layer] = x
    adata.obsm[keys.latent] = np.asarray(ondisk.open_rows(f["obsm"][keys.latent]).take(rows))
    if "uns" in f and keys.uns in f["uns"]:  # what corrected the file, its model checks
        adata.uns[keys.uns] = read_elem(f["uns"][keys.uns])
    return adata


def subsample_lines(subsample: dict | None) -> list[str]:
    if not subsample:
        return []
    return [f"Scored on a subsample of {subsample['n_cells']} of {subsample['of_cells']} cells "
            f"(evaluation.max_cells={subsample['max_cells']}), stratified by "
            f"{' x '.join(subsample['stratified_by'])} (every score, gene-level fidelity and the UMAP)."]


def _markdown_report(table, result: dict) -> str:
    lines = [
        f"# Evaluation of {Path(result['input']).name}",
        "",
        f"{result['n_cells']} cells, {result['n_genes_scored']} genes ({result['genes']}); "
        f"batch key `{result['batch_key']}`, label key `{result['label_key']}`.",
        *subsample_lines(result.get("subsample")),
        f"Uncorrected: {result['uncorrected_source']}. scib-metrics, unscaled; "
        "Total = 0.4 batch correction + 0.6 bio conservation.",
        "",
    ]
    if "note" in result:
        lines += [f"**{result['note']}**", ""]
    genes = result["gene_fidelity"]
    return "\n".join(lines) + "\n" + reports.markdown_table(table) + "\n" + "\n".join([
        f"## Gene-level fidelity of layers['{result['corrected_layer']}']",
        "",
        f"Against {genes['reference']} (batchfix.eval.fidelity; 1.0 = the uncorrected values' own structure).",
        "",
        reports.gene_markdown(genes),
        f"## CNV profile retention of layers['{result['corrected_layer']}']",
        "",
        "Per (label, batch) group, Pearson r of its CNV profile with its label's uncorrected profile in the other "
        "batches; amplitude ratio = slope on that profile, corrected / uncorrected (batchfix.eval.cnv).",
        "",
        reports.cnv_markdown(result["cnv_fidelity"]),
        f"## Matrix scores of layers['{result['corrected_layer']}']",
        "",
        "Detection calibration, raw zeros made positive, DE calls between batches within a label on genes with "
        "zero raw counts in both groups, the share of each label's between-batch spread of gene means left (1 = "
        "none removed; on the log layer, on counts per 10k, and averaged over labels first); from the checks the correction stored, the share of (batch, gene) whose "
        "raw counts' PIT under the model is not uniform and detection against the model's reference per (gene, "
        "batch, state group) (batchfix.eval.matrix_scores, on the modelled genes).",
        "",
        reports.matrix_markdown(result["matrix_scores"]),
    ])
