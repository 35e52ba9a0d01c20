"""uns[key_added]: what produced a correction, its options read from the schemas (batchfix.config)."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

import batchfix
from batchfix.config import CorrectInferenceOptions, CorrectionAblations, CorrectionOptions
from batchfix.correction.layers import LOG_TRANSFORM
from batchfix.data import ondisk
from batchfix.data.io import OutputKeys, file_sha256
from batchfix.errors import InputError

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
    "log_counterfactual": {"quantile_seed": "no random draw: the log-scale output has no counts",
                           "depth": "the log-scale output has no counts, so no depth to move"},
    "denoised": {name: "the denoised output decodes the latent alone" for name in (
        "regional_shift", "regional_window", "regional_order", "regional_seed", "spread", "state_dependence",
        "residual_weight", "quantile_seed", "shrink", "depth")},
}
KIND_NAMES = {"counts": "the corrected counts (a counts model's counterfactual output)",
              "log_counterfactual": "a log-scale model's counterfactual output (data.scale=log)",
              "denoised": "the denoised output (output_mode=denoised)"}

log = logging.getLogger(__name__)


def output_kind_name(output_mode: str, likelihood: str) -> str:
    """counts (the NB model's counterfactual output) | log_counterfactual (a log-scale model's) | denoised."""
    if output_mode != "counterfactual":
        return "denoised"
    return "counts" if likelihood == "nb" else "log_counterfactual"


def warn_not_applied(told: Mapping, kind: str) -> None:
    """A warning for each correction option given one by one (`told`: name -> value) that the output `kind` does
    not read: why, and the output kinds that read it. It is still recorded, as not applied."""
    for name, value in told.items():
        if name in NOT_APPLIED[kind]:
            readers = [KIND_NAMES[other] for other in NOT_APPLIED if name not in NOT_APPLIED[other]]
            log.warning("correction.%s=%s does nothing on %s: %s. It is read by %s.", name, value, KIND_NAMES[kind],
                        NOT_APPLIED[kind][name], " and ".join(readers))


def layer_entries(bound) -> dict:
    """{layer key: what it holds} of the bound model's output."""
    keys = OutputKeys(bound.settings.key_added)
    kind = bound.kind
    if kind == "counts":
        return {keys.counts: LAYER_MEANING["counts"], keys.layer: LAYER_MEANING["counts_log"]}
    return {keys.layer: LAYER_MEANING[kind]}


def provenance(bound, estimates, tallies) -> dict:
    """uns[key_added]: what produced the correction, from the bound model, its estimates and the tallies of every
    chunk (batchfix.correction.outputs)."""
    trained, settings = bound.trained, bound.settings
    kind = bound.kind
    names = [f.name for schema in (CorrectionOptions, CorrectInferenceOptions, CorrectionAblations)
             for f in dataclasses.fields(schema)]
    skipped = {name: why for name, why in NOT_APPLIED[kind].items() if name in names}
    params = {name: (float(v) if isinstance(v, float) else v) for name in names
              if name not in skipped and (v := getattr(settings, name)) is not None and v != []}
    info = {
        "version": batchfix.__version__,
        "checkpoint": str(trained.path.resolve()) if trained.path else "(in memory, not saved)",
        "checkpoint_sha256": file_sha256(trained.path) if trained.path else "",
        "output_mode": settings.output_mode,
        "correction_preset": settings.preset or "(none named)",  # the conf/correction/ entry params started from
        "reference_batch": bound.reference_name,
        "training_batches": trained.batch_categories,
        "modelled_genes": trained.genes,
        "n_modelled_genes": len(trained.genes),
        "missing_genes": bound.missing_genes,
        "n_missing_genes": len(bound.missing_genes),
        "n_corrected_genes": int(bound.corrected_mask.sum()),
        "n_uncorrected_genes": int((~bound.corrected_mask).sum()),
        "extra_genes_corrected": int(bound.corrected_mask.sum() - bound.modelled_mask.sum()),
        "n_cells_without_counts": tallies.n_empty_modelled,  # in the modelled genes: decoded from nothing
        "layers": layer_entries(bound),
        "params": {**params, "counts": bound.source, "counts_layer": bound.counts_layer or "X", "scale": trained.scale,
                   "model": dict(trained.module.hparams["model"])},
        "options_not_applied": skipped,
        "estimates": estimates.summary(batch_names(bound)),
    }
    if kind == "counts":
        info["log_transform"] = LOG_TRANSFORM
        info["n_observed_zeros"] = tallies.n_zeros
        info["n_zeros_made_positive"] = tallies.n_zeros_raised
        if tallies.checks is not None:  # scored by evaluate (batchfix.eval.matrix_scores) without the model
            modelled = bound.gene_sets[0]
            info["model_checks"] = tallies.checks.record(batch_names(bound),
                                                         list(np.asarray(trained.genes)[modelled.model_index]))
        if settings.regional_shift == "keep_input":
            info["regional_shift_note"] = ("keep_input splits the counts' log-mean shift against its mean over "
                                           "every input cell")
    if bound.batches is not None:
        info["params"]["batch_key"] = bound.batch_key
        info["unseen_batches_estimated"] = bound.batches.unseen
        small = "unseen_batches_uncorrected" if kind == "counts" else "unseen_batches_denoised"
        info[small] = bound.batches.denoised  # fewer than MIN_UNSEEN_CELLS cells: nothing estimated
        if kind != "counts":
            info["n_clipped_to_zero"] = tallies.n_clipped
    return info


def batch_names(bound) -> list[str]:
    """Each batch code's name (training batches, then the unseen ones); none for the denoised output."""
    if bound.batches is None:
        return []
    return [bound.batch_name(code) for code in range(bound.batches.n_training + len(bound.batches.unseen))]


def for_hdf5(value):
    """uns values as anndata writes them back exactly (an empty list would come back as floats)."""
    if isinstance(value, dict):
        return {k: for_hdf5(v) for k, v in value.items()}
    if isinstance(value, list):
        return np.array(value, dtype=object)
    return value


def refuse_key_collisions(key_added: str, layers: Iterable[str], obsm: Iterable[str], var_columns: Iterable[str],
                          uns: Mapping) -> None:
    """Refuse (InputError) a key_added whose outputs would replace what the input holds and batchfix did not write: a
    layer, obsm entry, var column or uns entry of that name. What an earlier correction under the same key wrote (its
    provenance in uns[key_added], naming its layers) may be replaced. `uns`: the input's uns, in memory or in the
    open file."""
    keys = OutputKeys(key_added)
    earlier = uns.get(keys.uns)
    ours = hasattr(earlier, "keys") and all(name in earlier for name in ("version", "checkpoint_sha256", "layers"))
    replaced = {"layers": {keys.layer, keys.counts}, "obsm": {keys.latent}, "var": {keys.modelled, keys.corrected}}
    if ours:
        replaced["layers"] -= set(earlier["layers"])
        replaced["obsm"] = replaced["var"] = set()
    found = {"layers": set(layers), "obsm": set(obsm), "var": set(var_columns)}
    clashes = [f"{where}['{name}']" for where, names in replaced.items() for name in sorted(names & found[where])]
    clashes += [] if ours or earlier is None else [f"uns['{keys.uns}']"]
    if clashes:
        raise InputError(f"correction.key_added={key_added} would replace the input's {', '.join(clashes)}, which "
                         "batchfix did not write; choose another key_added.")


def refuse_key_collisions_in_file(path: str | Path, key_added: str) -> None:
    """`refuse_key_collisions` for an .h5ad on disk (read-only, the names alone)."""
    with ondisk.open_anndata(path) as f:
        refuse_key_collisions(key_added, f.get("layers", {}), f.get("obsm", {}), ondisk.read_var_frame(f).columns,
                              f.get("uns", {}))
