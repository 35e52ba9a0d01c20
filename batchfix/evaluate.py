"""Evaluate a corrected .h5ad: scores (JSON + markdown) and a UMAP picture, into one folder."""
from __future__ import annotations

import json
from pathlib import Path

from batchfix import metrics
from batchfix.config import CorrectionOptions
from batchfix.io import OutputKeys, read_h5ad
from batchfix.runfolder import METRICS_JSON, METRICS_MD, UMAP_PNG


def evaluate_file(
    input_path,
    batch_key: str,
    label_key: str | None,
    out_dir,
    counts_layer: str | None = None,
    key_added: str = CorrectionOptions.key_added,
) -> dict:
    """Score a corrected file (never modified) and write metrics.json, metrics.md, umap.png.

    Scored with scib-metrics: the latent `obsm['X_<key_added>']`, the PCA of `layers[key_added]` and
    the uncorrected PCA, all on the modelled genes (see `batchfix.metrics.evaluation_embeddings`).
    Scored gene by gene (`gene_fidelity` in the result): `layers[key_added]` against the raw counts
    on the same genes, within each batch (`batchfix.metrics.gene_level_scores`). Returns the
    metrics dict written to metrics.json.
    """
    adata = read_h5ad(input_path)
    metrics.check_obs_keys(adata.obs, batch_key, label_key)
    embeddings, info = metrics.evaluation_embeddings(adata, OutputKeys(key_added), counts_layer)
    table, result = metrics.score_evaluation(
        adata.obs, embeddings, {"input": str(input_path), **info}, batch_key, label_key
    )
    result["gene_fidelity"] = metrics.gene_level_scores(adata, OutputKeys(key_added), batch_key, label_key,
                                                        counts_layer)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / METRICS_JSON).write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / METRICS_MD).write_text(_markdown_report(table, result))
    labels = adata.obs[label_key] if label_key else None
    metrics.plot_umaps(embeddings, adata.obs[batch_key], labels, out_dir / UMAP_PNG)
    return result


def _markdown_report(table, result: dict) -> str:
    lines = [
        f"# Evaluation of {Path(result['input']).name}",
        "",
        f"{result['n_cells']} cells, {result['n_genes_scored']} genes ({result['genes']}); "
        f"batch key `{result['batch_key']}`, label key `{result['label_key']}`.",
        f"Uncorrected: {result['uncorrected_source']}. scib-metrics, unscaled; "
        "Total = 0.4 batch correction + 0.6 bio conservation.",
        "",
    ]
    if "note" in result:
        lines += [f"**{result['note']}**", ""]
    genes = result["gene_fidelity"]
    return "\n".join(lines) + "\n" + metrics.markdown_table(table) + "\n" + "\n".join([
        f"## Gene-level fidelity of layers['{result['corrected_layer']}']",
        "",
        f"Against {genes['reference']} (batchfix.fidelity; 1.0 = the uncorrected values' own structure).",
        "",
        metrics.gene_markdown(genes),
    ])
