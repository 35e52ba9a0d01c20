"""The scores of a corrected matrix that gene-level fidelity cannot see (batchfix.eval.detection), as one registry.

`SCORES` lists (name, function, applies to); `evaluate` and scripts/benchmark.py both score every matrix with
`score_matrix`, so a new score is a row added there. Each function takes a `MatrixInput` and returns its columns.
A matrix is on the log scale (log1p of counts per 10k, or a method's own log output), so an entry is "detected"
where it is positive; it is scored against the raw counts of the same cells and genes (with labels, the share of
each label's between-batch spread of gene means it leaves: batchfix.eval.removal). Detection calibration
compares each (gene, label, batch) group's detected share with a reference model's, the same for every method
(by default detection.reference_nonzero, a batch-free NB at each cell's library). batchfix's corrected counts
also carry the checks of the model that corrected them, summed at correct time over a name-keyed sample of cells
(uns[key_added]['model_checks'], batchfix.correction.count_output.ModelChecks): the raw counts' PIT under the model
says which genes it misfits, and each (batch, state group)'s detected share is compared with the model's own
reference. Nothing here reruns a correction.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from batchfix.data.normalize import log_cp10k
from batchfix.eval import detection, metrics, removal

log = logging.getLogger(__name__)

# what a score applies to
ANY, LABELLED, MODELLED = "any matrix", "a matrix with labels", "a matrix with its model's checks"
DETECTION_WITHIN = "Detection within 0.05"
DETECTION_CEILING = "Detection within 0.05 (calibrated)"
DETECTION_SAMPLING = "Detection within 0.05 or sampling error"
DETECTION_SPREAD = "Detection spread"
DETECTION_SPREAD_RAW = "Detection spread (raw)"
ZEROS_RAISED = "Zeros raised"
BATCH_DE_CALLS = "Between-batch DE calls"
FALSE_DE_ZERO_RAW = "False DE (zero raw)"
PIT_FAILS = "PIT fails"
MODEL_DETECTION_WITHIN = "Model detection within 0.05"
MODEL_DETECTION_CEILING = "Model detection within 0.05 (calibrated)"
MODEL_DETECTION_SAMPLING = "Model detection within 0.05 or sampling error"
MODEL_DETECTION_RAW = "Model detection within 0.05 or sampling error (raw)"
MODEL_COLUMNS = [PIT_FAILS, MODEL_DETECTION_WITHIN, MODEL_DETECTION_CEILING, MODEL_DETECTION_SAMPLING,
                 MODEL_DETECTION_RAW]
# batchfix.eval.removal: the share of each label's between-batch spread of gene means left, by scale
BATCH_EFFECT_LEFT = {"left_log": "Batch effect left (log)", "left_mean": "Batch effect left (mean)",
                     "left_balanced": "Batch effect left (balanced)"}
PIT_LISTED = 10  # genes named per batch among those whose PIT fails
BATCH_FREE_REFERENCE = "batch-free NB (per label rate at each cell's library, theta by moments)"


@dataclass
class MatrixInput:
    """One corrected log matrix (cells x genes) with the raw counts of the same cells and genes, the cells'
    labels (or None) and batches, and the expected nonzero probabilities (cells x genes, or None) with the name
    of the reference model that gave them; `checks`: the model checks the method stored with its matrix (the
    ModelChecks record of uns[key_added]['model_checks']), or None."""

    log_values: np.ndarray | sp.spmatrix
    raw: np.ndarray | sp.spmatrix
    labels: np.ndarray | None
    batches: np.ndarray
    expected_nonzero: np.ndarray | None = None
    reference: str = BATCH_FREE_REFERENCE
    checks: Mapping | None = None

    @cached_property
    def pit_table(self):
        """detection.histogram_uniformity of the stored PIT histograms per (batch, gene), computed once for the
        score and the genes named."""
        return detection.histogram_uniformity(np.asarray(self.checks["pit_histograms"]),
                                              np.asarray(self.checks["batches"]).astype(str))


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


def removal_columns(matrix: MatrixInput) -> dict[str, float]:
    """The share of each label's between-batch spread of gene means the matrix leaves, against the raw counts'
    log1p(counts per 10k) (batchfix.eval.removal; NaN where no label has cells in two batches)."""
    left = removal.removal_scores(log_cp10k(sp.csr_matrix(matrix.raw)), matrix.log_values, matrix.batches,
                                  matrix.labels)
    return {column: np.nan if left[key] is None else left[key] for key, column in BATCH_EFFECT_LEFT.items()}


def pit_columns(matrix: MatrixInput) -> dict[str, float]:
    """The share of (batch, gene) whose PIT histogram fails uniformity (the model misfits those genes there)."""
    return {PIT_FAILS: float(matrix.pit_table["fails"].mean())}


def model_detection_columns(matrix: MatrixInput) -> dict[str, float]:
    """Detection calibration against the model's own reference, per (gene, batch, state group) of the checked
    cells (detection.summed_calibration of the stored sums), beside the raw counts' (their batch's detection)."""
    cells, expected, variance, drawn = (np.asarray(matrix.checks[name], dtype=np.float64) for name in (
        "pair_cells", "expected", "variance", "drawn"))
    corrected, raw = (detection.summed_calibration(cells, np.asarray(matrix.checks[name], dtype=np.float64), expected,
                                                   variance, drawn) for name in ("detected", "observed"))
    return {MODEL_DETECTION_WITHIN: corrected["within_tolerance"],
            MODEL_DETECTION_CEILING: corrected["calibrated_within"],
            MODEL_DETECTION_SAMPLING: corrected["within_sampling"], MODEL_DETECTION_RAW: raw["within_sampling"]}


SCORES: list[tuple[str, Callable[[MatrixInput], dict[str, float]], str]] = [
    ("detection calibration", detection_columns, LABELLED),
    ("zeros raised", zeros_raised_columns, ANY),
    ("false DE", false_de_columns, LABELLED),
    ("gene-level batch effect left", removal_columns, LABELLED),
    ("PIT uniformity", pit_columns, MODELLED),
    ("detection against the model", model_detection_columns, MODELLED),
]
COLUMNS = [DETECTION_WITHIN, DETECTION_CEILING, DETECTION_SAMPLING, DETECTION_SPREAD, DETECTION_SPREAD_RAW,
           ZEROS_RAISED, BATCH_DE_CALLS, FALSE_DE_ZERO_RAW, *BATCH_EFFECT_LEFT.values(), *MODEL_COLUMNS]


def score_matrix(matrix: MatrixInput) -> dict[str, float]:
    """Every score of SCORES that applies to the matrix, by column (NaN for those that do not apply)."""
    if matrix.labels is not None and matrix.expected_nonzero is None:
        matrix.expected_nonzero = detection.reference_nonzero(sp.csr_matrix(matrix.raw), np.asarray(matrix.labels))
    result = dict.fromkeys(COLUMNS, np.nan)
    given = {ANY: True, LABELLED: matrix.labels is not None, MODELLED: matrix.checks is not None}
    for _, function, applies in SCORES:
        if given[applies]:
            result.update(function(matrix))
    return result


def corrected_matrix_scores(adata, layer: str, genes: np.ndarray, batch_key: str, label_key: str | None,
                            counts_layer: str | None = None) -> dict:
    """`score_matrix` of layers[layer] on the columns `genes` (a boolean mask) against the raw counts (X or
    counts_layer) of the same genes, with the model checks uns[layer] holds (`stored_checks`); the result names
    the genes scored, the reference and the genes the model misfits, and counts the layer's NaN or infinite and
    negative values (`bad_values`, all genes)."""
    values = bad_values(adata.layers[layer], layer)
    raw = (adata.layers[counts_layer] if counts_layer else adata.X)[:, genes]
    if not metrics.is_integer_valued(raw):
        return {**dict.fromkeys(COLUMNS), "layer": layer, **values,
                "note": f"{counts_layer or 'X'} does not hold raw counts: the matrix scores were not computed."}
    labels = adata.obs[label_key].astype(str).to_numpy() if label_key else None
    checks, missing = stored_checks(adata.uns.get(layer, {}), layer)
    matrix = MatrixInput(adata.layers[layer][:, genes], raw, labels, adata.obs[batch_key].astype(str).to_numpy(),
                         checks=checks)
    scores = score_matrix(matrix)
    result = {**{k: None if np.isnan(v) else v for k, v in scores.items()},
              "layer": layer, "n_genes": int(np.count_nonzero(genes)), "reference": matrix.reference, **values}
    if missing:
        result["model_checks_missing"] = missing
    if checks is not None:
        result["pit_failing_genes"] = failing_genes(matrix)
        result["model_checks_cells"] = int(np.sum(checks["pair_cells"]))
    return result


def stored_checks(info: Mapping, layer: str) -> tuple[Mapping | None, str | None]:
    """(the model checks uns[layer] holds, None) or (None, why there are none: a file of no batchfix counts, or one
    corrected before the checks were stored)."""
    if "log_transform" not in info:
        return None, None  # no corrected counts of batchfix: nothing to say
    if "model_checks" not in info:
        why = (f"uns['{layer}'] holds no model checks (corrected by batchfix {info.get('version', '?')}, before they "
               "were stored at correct time): correct the file again for the PIT and the model's detection")
        log.warning("%s.", why)
        return None, why
    return info["model_checks"], None


def failing_genes(matrix: MatrixInput) -> dict[str, list[str]]:
    """Per batch, the genes whose PIT fails uniformity, worst first (at most PIT_LISTED)."""
    table, names = matrix.pit_table, np.asarray(matrix.checks["genes"]).astype(str)
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
