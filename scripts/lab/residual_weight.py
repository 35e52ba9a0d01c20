"""How much of each cell's residual the counterfactual output keeps: correction.residual_weight from 1 to 0.

The counterfactual output (batchfix/correction/counterfactual.py) is, for cell c of batch b,

    corrected = max(0, decoded_ref(z_c) + location_ref + a * k_b * (observed(c) - decoded_b(z_c) - location_b))

with a the residual weight: 1 (the default) keeps each cell's whole deviation from what the decoder expects for its
state, 0 leaves the denoised output plus the reference's location. The rows are built from one model's terms
(`harness.counterfactual_terms`), with rows for correction.spread=gene beside them (k per gene and batch, a = 1),
alone and with state_dependence=STATE, and that pair at a = SPREAD_GENE_WEIGHT; the a = 1, a = CHECKED and spread=gene,
state STATE rows (at a = 1 and at SPREAD_GENE_WEIGHT) are checked against batchfix.correct with those options
(regional_shift=apply). They are scored as scripts/lab/decoding_scale.py scores its
rows (scIB Total of each matrix's PCA, the gene-level scores, and with --truth-layer the contrast truth error and
the gene-level scores against the truth counts, a second model per seed being trained on the truth counts), with the
same options.

    nice python -m scripts.lab.residual_weight data/cellbench5.h5ad --seeds 0 1 2 --model-dir models/bundled
    nice python -m scripts.lab.residual_weight stress_sd1.h5ad --truth-layer truth --seeds 0 1 2 --model-dir models/sd1
"""
from __future__ import annotations

import sys
from pathlib import Path

import anndata as ad
import numpy as np

from scripts.lab.decoding_scale import main, trained_model
from scripts.lab.harness import cell_scale, counterfactual_terms
from scripts.lab.marker_loss import check_shipped, reference_rows

WEIGHTS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.0)  # the rows' residual weights
CHECKED = 0.75  # a weight below 1 whose row is compared with batchfix.correct's
SPREAD_GENE = "spread gene"  # correction.spread=gene at weight 1: k per gene and batch, as ComBat's scale
STATE = 0.5  # the spread=gene row is also given with this correction.state_dependence
SPREAD_GENE_WEIGHT = 0.9  # ... and that row with this residual weight as well


def weight_rows(adata: ad.AnnData, batch_key: str, seed: int, model_path: Path | None) -> tuple[list, np.ndarray, dict]:
    """(modelled genes, counts on them, {row: corrected matrix}): uncorrected, ComBat and one row per weight."""
    model = trained_model(adata, batch_key, seed, model_path)
    terms = counterfactual_terms(adata, model, batch_key)
    rows = {f"residual weight {weight:g}": np.maximum(terms.unclipped(scale=weight * terms.scale), 0.0)
            for weight in WEIGHTS}
    gene_scale = cell_scale(model, terms.codes, spread_by="gene")  # (cells, G)
    rows[SPREAD_GENE] = np.maximum(terms.unclipped(scale=gene_scale), 0.0)
    for weight, suffix in ((1.0, ""), (SPREAD_GENE_WEIGHT, f", weight {SPREAD_GENE_WEIGHT:g}")):
        scale = weight * gene_scale
        rows[f"{SPREAD_GENE}, state {STATE:g}{suffix}"] = np.maximum(
            terms.unclipped(decoder=terms.state_shrunk(terms.decoder_term(scale=scale), STATE), scale=scale), 0.0)
    checked = {f"residual weight {1.0:g}": {}, f"residual weight {CHECKED:g}": {"residual_weight": CHECKED},
               f"{SPREAD_GENE}, state {STATE:g}": {"spread": "gene", "state_dependence": STATE},
               f"{SPREAD_GENE}, state {STATE:g}, weight {SPREAD_GENE_WEIGHT:g}": {
                   "spread": "gene", "state_dependence": STATE, "residual_weight": SPREAD_GENE_WEIGHT}}
    for name, options in checked.items():
        check_shipped(rows[name], adata, model, batch_key, name, **options)
    counts, uncorrected = reference_rows(adata, model.genes, batch_key)
    return list(model.genes), counts, {**uncorrected, **rows}


if __name__ == "__main__":
    sys.exit(main(build=weight_rows, doc=__doc__))
