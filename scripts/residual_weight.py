"""How much of each cell's residual the counterfactual output keeps: correction.residual_weight from 1 to 0.

The counterfactual output (batchfix/correction/counterfactual.py) is, for cell c of batch b,

    corrected = max(0, decoded_ref(z_c) + location_ref + a * k_b * (observed(c) - decoded_b(z_c) - location_b))

with a the residual weight: 1 (the default) keeps each cell's whole deviation from what the decoder expects for its
state, 0 leaves the denoised output plus the reference's location. The rows are built from one model's terms
(`marker_loss.counterfactual_terms`) and the a = 1 and a = CHECKED rows are checked against batchfix.correct with
that weight (regional_shift=apply); they are scored as scripts/decoding_scale.py scores its rows (scIB Total of each
matrix's PCA, the gene-level scores, and with --truth-layer the contrast truth error, a second model per seed being
trained on the truth counts), with the same options.

    nice python scripts/residual_weight.py data/cellbench5.h5ad --seeds 0 1 2 --model-dir models/bundled
    nice python scripts/residual_weight.py stress_sd1.h5ad --truth-layer truth --seeds 0 1 2 --model-dir models/sd1
"""
from __future__ import annotations

import sys
from pathlib import Path

import anndata as ad
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import combat  # noqa: E402
from decoding_scale import main, trained_model  # noqa: E402
from marker_loss import counterfactual_terms, shipped_values  # noqa: E402

from batchfix.data.normalize import log_cp10k  # noqa: E402

WEIGHTS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.0)  # the rows' residual weights
CHECKED = 0.75  # a weight below 1 whose row is compared with batchfix.correct's


def weight_rows(adata: ad.AnnData, batch_key: str, seed: int, model_path: Path | None) -> tuple[np.ndarray, dict]:
    """(counts on the modelled genes, {row: corrected matrix}): uncorrected, ComBat and one row per weight."""
    model = trained_model(adata, batch_key, seed, model_path)
    terms = counterfactual_terms(adata, model, batch_key)
    rows = {f"residual weight {weight:g}": np.maximum(terms.unclipped(scale=weight * terms.scale), 0.0)
            for weight in WEIGHTS}
    for weight in (1.0, CHECKED):
        difference = np.abs(rows[f"residual weight {weight:g}"]
                            - shipped_values(adata, model, batch_key, residual_weight=weight)).max()
        if difference > 1e-4:
            raise SystemExit(f"The weight {weight:g} row differs from batchfix.correct by {difference:.2e}.")
    counts = np.asarray(adata[:, model.genes].X, dtype=np.float32)
    log_values = np.asarray(log_cp10k(counts), dtype=np.float64)
    return counts, {"uncorrected": log_values, "ComBat": combat(log_values, adata.obs, batch_key), **rows}


if __name__ == "__main__":
    sys.exit(main(build=weight_rows, doc=__doc__))
