"""uns[key_added]: what produced a correction, its options read from the schemas (batchfix.config)."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

import batchfix
from batchfix.config import CorrectionOptions, InferenceOptions
from batchfix.correction.layers import LOG_TRANSFORM
from batchfix.data.io import OutputKeys

LAYER_MEANING = {
    "counts": "corrected counts: each observed count of a corrected gene moved from its batch's negative binomial to "
              "the reference's at the same quantile (batchfix.correction.counts), integers; the other genes' counts "
              "as in the input",
    "counts_log": f"{LOG_TRANSFORM} of the corrected counts",
    "log_counterfactual": "each cell's own log-scale value with only what its batch explains removed "
                          "(batchfix.correction.counterfactual); an input zero stays zero; modelled genes only",
    "denoised": "every cell decoded from its latent as the reference batch, log1p(expression per 10k counts of the "
                "modelled genes); modelled genes only",
}
# Options with no effect on an output, and why (they are reported as not applied, never as applied)
NOT_APPLIED = {
    "counts": {"residual_weight": "a count is mapped whole, not as a location and a residual"},
    "log_counterfactual": {"quantile_seed": "no random draw: the log-scale output has no counts"},
    "denoised": {name: "the denoised output decodes the latent alone" for name in (
        "regional_shift", "regional_window", "regional_order", "regional_seed", "spread", "state_dependence",
        "residual_weight", "quantile_seed")},
}


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def output_kind(corrector) -> str:
    """counts (the NB model's counterfactual output) | log_counterfactual (log-scale input) | denoised."""
    if corrector.counts_output:
        return "counts"
    return "log_counterfactual" if corrector.settings.output_mode == "counterfactual" else "denoised"


def layer_entries(corrector) -> dict:
    """{layer key: what it holds} of this output."""
    keys = OutputKeys(corrector.settings.key_added)
    kind = output_kind(corrector)
    if kind == "counts":
        return {keys.counts: LAYER_MEANING["counts"], keys.layer: LAYER_MEANING["counts_log"]}
    return {keys.layer: LAYER_MEANING[kind]}


def provenance(corrector) -> dict:
    """uns[key_added]: what produced the correction (after the last chunk: it counts the clipped values)."""
    trained, settings = corrector.trained, corrector.settings
    kind = output_kind(corrector)
    names = [f.name for schema in (CorrectionOptions, InferenceOptions) for f in dataclasses.fields(schema)]
    skipped = {name: why for name, why in NOT_APPLIED[kind].items() if name in names}
    params = {name: (float(v) if isinstance(v, float) else v) for name in names
              if name not in skipped and (v := getattr(settings, name)) is not None and v != []}
    info = {
        "version": batchfix.__version__,
        "checkpoint": str(trained.path.resolve()) if trained.path else "(in memory, not saved)",
        "checkpoint_sha256": file_sha256(trained.path) if trained.path else "",
        "output_mode": settings.output_mode,
        "correction_preset": settings.preset or "(none named)",  # the conf/correction/ entry params started from
        "reference_batch": corrector.reference_name,
        "training_batches": trained.batch_categories,
        "modelled_genes": trained.genes,
        "n_modelled_genes": len(trained.genes),
        "missing_genes": corrector.missing_genes,
        "n_missing_genes": len(corrector.missing_genes),
        "n_corrected_genes": int(corrector.corrected_mask.sum()),
        "n_uncorrected_genes": int((~corrector.corrected_mask).sum()),
        "extra_genes_corrected": int(corrector.corrected_mask.sum() - corrector.modelled_mask.sum()),
        "n_cells_without_counts": corrector.n_empty_modelled,  # in the modelled genes: decoded from nothing
        "layers": layer_entries(corrector),
        "params": {**params, "counts": corrector.source, "scale": trained.scale,
                   "model": dict(trained.module.hparams["model"])},
        "options_not_applied": skipped,
    }
    if kind == "counts":
        info["log_transform"] = LOG_TRANSFORM
        info["n_observed_zeros"] = corrector.n_zeros
        info["n_zeros_made_positive"] = corrector.n_zeros_raised
        if settings.regional_shift == "keep_input":
            info["regional_shift_note"] = "keep_input splits the counts' log-mean shift as keep_all does"
    if corrector.batches is not None:
        info["params"]["batch_key"] = corrector.batch_key
        info["unseen_batches_estimated"] = corrector.batches.unseen
        small = "unseen_batches_uncorrected" if kind == "counts" else "unseen_batches_denoised"
        info[small] = corrector.batches.denoised  # fewer than MIN_UNSEEN_CELLS cells: nothing estimated
        if kind != "counts":
            info["n_clipped_to_zero"] = corrector.n_clipped
    return info


def for_hdf5(value):
    """uns values as anndata writes them back exactly (an empty list would come back as floats)."""
    if isinstance(value, dict):
        return {k: for_hdf5(v) for k, v in value.items()}
    if isinstance(value, list):
        return np.array(value, dtype=object)
    return value
