"""The scores of a corrected matrix that gene-level fidelity cannot see (batchfix.eval.detection), as one registry.

`SCORES` lists (name, function, applies to); `evaluate` and scripts/benchmark.py both score every matrix with
`score_matrix`, so a new score is a row added there. Each function takes a `MatrixInput` and returns its columns.
A matrix is on the log scale (log1p of counts per 10k, or a method's own log output), so an entry is "detected"
where it is positive; it is scored against the raw counts of the same cells and genes. The expected nonzero
shares of detection calibration come from `MatrixInput.expected_nonzero`, and `MatrixInput.reference` names the
model that gave them (by default detection.reference_nonzero, a batch-free NB at each cell's library); where the
method's own model is at hand (`model_checks`), the raw counts' PIT under it says which genes it misfits.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from batchfix.config import CorrectionSettings, current_options
from batchfix.correction import writers
from batchfix.data.io import file_sha256
from batchfix.eval import detection, metrics
from batchfix.training.trained import load_trained

log = logging.getLogger(__name__)

# what a score applies to
ANY, LABELLED, MODELLED = "any matrix", "a matrix with labels", "a matrix with the PIT of its model"
DETECTION_WITHIN = "Detection within 0.05"
DETECTION_CEILING = "Detection within 0.05 (calibrated)"
DETECTION_SAMPLING = "Detection within 0.05 or sampling error"
DETECTION_SPREAD = "Detection spread"
DETECTION_SPREAD_RAW = "Detection spread (raw)"
ZEROS_RAISED = "Zeros raised"
BATCH_DE_CALLS = "Between-batch DE calls"
FALSE_DE_ZERO_RAW = "False DE (zero raw)"
PIT_FAILS = "PIT fails"
PIT_LISTED = 10  # genes named per batch among those whose PIT fails
BATCH_FREE_REFERENCE = "batch-free NB (per label rate at each cell's library, theta by moments)"


@dataclass
class MatrixInput:
    """One corrected log matrix (cells x genes) with the raw counts of the same cells and genes, the cells'
    labels (or None) and batches, and the expected nonzero probabilities (cells x genes, or None) with the name
    of the reference model that gave them; `pit` (cells x genes, or None): the raw counts' randomised PIT under
    the model of the method, where it has one."""

    log_values: np.ndarray | sp.spmatrix
    raw: np.ndarray | sp.spmatrix
    labels: np.ndarray | None
    batches: np.ndarray
    expected_nonzero: np.ndarray | None = None
    reference: str = BATCH_FREE_REFERENCE
    pit: np.ndarray | None = None

    @cached_property
    def pit_table(self):
        """detection.pit_uniformity of `pit` per (batch, gene), computed once for the score and the genes named."""
        return detection.pit_uniformity(self.pit, self.batches)


def detection_columns(matrix: MatrixInput) -> dict[str, float]:
    """Detection calibration: share of (gene, label, batch) groups within the tolerance (and the share perfectly
    calibrated counts reach), spread across batches."""
    summary, _ = detection.detection_calibration(matrix.log_values, matrix.raw, matrix.expected_nonzero,
                                                 matrix.labels, matrix.batches)
    return {DETECTION_WITHIN: summary["within_tolerance"], DETECTION_CEILING: summary["calibrated_within"],
            DETECTION_SAMPLING: summary["within_sampling"], DETECTION_SPREAD: summary["spread_corrected"],
            DETECTION_SPREAD_RAW: summary["spread_raw"]}


def zeros_raised_columns(matrix: MatrixInput) -> dict[str, float]:
    """Share of the raw zeros that are positive in the matrix."""
    return {ZEROS_RAISED: detection.zeros_raised(matrix.raw, matrix.log_values)}


def false_de_columns(matrix: MatrixInput) -> dict[str, float]:
    """DE calls between batches within each label, and those on genes with zero raw counts in both groups."""
    calls = detection.false_de(matrix.log_values, sp.csr_matrix(matrix.raw), matrix.labels, matrix.batches)
    if calls.empty:
        return {BATCH_DE_CALLS: np.nan, FALSE_DE_ZERO_RAW: np.nan}
    return {BATCH_DE_CALLS: float(calls["called"].sum()), FALSE_DE_ZERO_RAW: float(calls["called_zero_raw"].sum())}


def pit_columns(matrix: MatrixInput) -> dict[str, float]:
    """The share of (batch, gene) whose PIT histogram fails uniformity (the model misfits those genes there)."""
    return {PIT_FAILS: float(matrix.pit_table["fails"].mean())}


SCORES: list[tuple[str, Callable[[MatrixInput], dict[str, float]], str]] = [
    ("detection calibration", detection_columns, LABELLED),
    ("zeros raised", zeros_raised_columns, ANY),
    ("false DE", false_de_columns, LABELLED),
    ("PIT uniformity", pit_columns, MODELLED),
]
COLUMNS = [DETECTION_WITHIN, DETECTION_CEILING, DETECTION_SAMPLING, DETECTION_SPREAD, DETECTION_SPREAD_RAW,
           ZEROS_RAISED, BATCH_DE_CALLS, FALSE_DE_ZERO_RAW, PIT_FAILS]


def score_matrix(matrix: MatrixInput) -> dict[str, float]:
    """Every score of SCORES that applies to the matrix, by column (NaN for those that do not apply)."""
    if matrix.labels is not None and matrix.expected_nonzero is None:
        matrix.expected_nonzero = detection.reference_nonzero(sp.csr_matrix(matrix.raw), np.asarray(matrix.labels))
    result = dict.fromkeys(COLUMNS, np.nan)
    given = {ANY: True, LABELLED: matrix.labels is not None, MODELLED: matrix.pit is not None}
    for _, function, applies in SCORES:
        if given[applies]:
            result.update(function(matrix))
    return result


class NoModelChecks(Exception):
    """Why the checks of the model that corrected a file cannot run; `expected`: a file without batchfix's counts,
    where none are to be had."""

    def __init__(self, why: str, expected: bool = False):
        super().__init__(why)
        self.expected = expected


def model_checks(adata, key_added: str, genes: np.ndarray, trained=None, batch_key: str | None = None) -> dict:
    """The checks of the model that corrected the file, read from the checkpoint uns[key_added] names when that file
    is there unchanged (its sha256) and the output is corrected counts, on the genes of the mask `genes`: 'expected'
    (cells x genes P(count > 0) under each cell's reference NB), 'pit' (cells x genes, the observed counts'
    randomised PIT under their own batch's NB) and 'reference' (its name); else NoModelChecks says why not. The
    correction is rerun on these cells with the options uns records (on a subsample the state dependence's batch
    means come from it). `trained`: the model itself (a BatchfixModel), for a correction whose checkpoint was never
    saved; `batch_key`: evaluate's batch column, read where the one the correction read was renamed."""
    info = adata.uns.get(key_added, {})
    if "log_transform" not in info:
        raise NoModelChecks(f"uns['{key_added}'] records no corrected counts of batchfix", expected=True)
    trained = trained if trained is not None else saved_model(info)
    params = dict(info["params"])
    names = {f.name for f in fields(CorrectionSettings)}
    options = {k: (list(v) if isinstance(v, np.ndarray) else v) for k, v in params.items() if k in names}
    settings = CorrectionSettings(**current_options(options), preset=str(info.get("correction_preset")))
    source = params["counts"]
    # a file corrected before "counts_layer" was recorded names the layer only in the display string "counts"
    counts_layer = str(params["counts_layer"]) if "counts_layer" in params else (
        "X" if source == "X" else source[len("layers['"):-len("']")])
    if (adata.X is None) if counts_layer == "X" else (counts_layer not in adata.layers):
        # a subsample holds the counts evaluate compares with, not those the correction read
        raise NoModelChecks(f"the scored cells lack {source}, the counts the correction read")
    recorded = params.get("batch_key")
    # a file corrected already: batches the model was not trained on are accepted (all_batches_new)
    columns, expected, pit = writers.model_checks(adata, trained, settings, counts_layer,
                                                  recorded if recorded in adata.obs or batch_key is None else batch_key,
                                                  all_batches_new=True)
    position = pd.Series(np.arange(len(columns)), index=columns).reindex(np.flatnonzero(genes))
    where = trained.path.name if trained.path else "in memory"
    if position.isna().any():
        raise NoModelChecks(f"the model given ({where}) lacks {int(position.isna().sum())} of the {len(position)} "
                            "genes the file's model corrected: it is not the model that corrected the file")
    keep = position.to_numpy(dtype=np.int64)
    return {"expected": expected[:, keep], "pit": pit[:, keep],
            "reference": f"reference NB of the model that corrected the file ({where}, its options)"}


def saved_model(info: dict):
    """The checkpoint uns names, when it is there unchanged since it corrected the file."""
    path, digest = Path(str(info.get("checkpoint", ""))), str(info.get("checkpoint_sha256", ""))
    if not digest:
        raise NoModelChecks("the model that corrected the file was never saved: batchfix.evaluate(..., model=model) "
                            "takes it")
    if not path.is_file():
        raise NoModelChecks(f"the checkpoint that corrected the file is no longer at {path} (moved or deleted): "
                            "put it back, or pass it as batchfix.evaluate(..., model=PATH)")
    if file_sha256(path) != digest:
        raise NoModelChecks(f"the checkpoint {path} changed since it corrected the file")
    return load_trained(path)


def corrected_matrix_scores(adata, layer: str, genes: np.ndarray, batch_key: str, label_key: str | None,
                            counts_layer: str | None = None, trained=None) -> dict:
    """`score_matrix` of layers[layer] on the columns `genes` (a boolean mask) against the raw counts (X or
    counts_layer) of the same genes, detection against the correcting model's reference where
    `model_checks` finds it (else the batch-free NB); the result names the genes scored and the
    reference, and counts the layer's NaN or infinite and negative values (`bad_values`, all genes)."""
    values = bad_values(adata.layers[layer], layer)
    raw = (adata.layers[counts_layer] if counts_layer else adata.X)[:, genes]
    if not metrics.is_integer_valued(raw):
        return {**dict.fromkeys(COLUMNS), "layer": layer, **values,
                "note": f"{counts_layer or 'X'} does not hold raw counts: the matrix scores were not computed."}
    labels = adata.obs[label_key].astype(str).to_numpy() if label_key else None
    matrix = MatrixInput(adata.layers[layer][:, genes], raw, labels, adata.obs[batch_key].astype(str).to_numpy())
    try:
        model, skipped = model_checks(adata, layer, genes, trained, batch_key), None
        matrix.pit = model["pit"]
        if labels is not None:
            matrix.expected_nonzero, matrix.reference = model["expected"], model["reference"]
    except NoModelChecks as why:
        skipped = f"No model checks (PIT, detection against the correcting model): {why}."
        log.log(logging.INFO if why.expected else logging.WARNING, skipped)
    scores = score_matrix(matrix)
    result = {**{k: None if np.isnan(v) else v for k, v in scores.items()},
              "layer": layer, "n_genes": int(np.count_nonzero(genes)), "reference": matrix.reference, **values}
    if skipped:
        result["model_checks_skipped"] = skipped
    if matrix.pit is not None:
        result["pit_failing_genes"] = failing_genes(matrix, np.asarray(adata.var_names[genes]).astype(str))
    return result


def failing_genes(matrix: MatrixInput, names: np.ndarray) -> dict[str, list[str]]:
    """Per batch, the genes whose PIT fails uniformity, worst first (at most PIT_LISTED)."""
    table = matrix.pit_table
    failing = table[table["fails"]].sort_values("pvalue", kind="stable")
    return {str(batch): [str(names[g]) for g in group["gene"].head(PIT_LISTED)]
            for batch, group in failing.groupby("batch", sort=True)}


def bad_values(layer, name: str) -> dict[str, int]:
    """{'nonfinite_values', 'negative_values'}: the NaN or infinite and the negative entries of a corrected layer
    (cells x genes, dense or sparse), with a warning where there are any."""
    values = layer.data if sp.issparse(layer) else np.asarray(layer)
    counts = {"nonfinite_values": int((~np.isfinite(values)).sum()), "negative_values": int((values < 0).sum())}
    if any(counts.values()):
        log.warning("layers['%s'] holds %d NaN or infinite and %d negative values.", name,
                    counts["nonfinite_values"], counts["negative_values"])
    return counts
