"""A trained model bound to one input: the first step of a correction (bind, estimate, apply).

`BoundModel` matches a trained model to one input's genes (and, for the counterfactual output, its cells'
batches). The estimate pass (batchfix.correction.estimates) reduces from all cells what the correction needs into
a frozen `Estimates`; an output kind (batchfix.correction.outputs) then turns any row range of the input into its
latent and layers from the bound model, the estimates and those rows alone. The writers
(batchfix.correction.writers) put the layers into an AnnData or a new .h5ad, so the in-memory and the streamed
outputs are the same numbers.

Modelled genes are matched to the input by var_names (a modelled gene named twice is refused: which column is
meant is ambiguous). Missing ones enter the encoder as zero counts, get no output column, and are reported (log
and uns[key]['missing_genes']); past `max_missing_fraction` the correction stops with an error. The
counterfactual output reads each cell's batch from obs[batch_key]; the denoised output does not need it. The
encoder does not see the batch, so cells of batches the model never saw get a latent like any other; for the
counterfactual output their batch effect is estimated from their own cells first (batchfix.correction.estimates).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from batchfix.config import ResolvedCorrection
from batchfix.correction import calibration, count_output, counterfactual, counts, provenance
from batchfix.correction.stages import StageClock
from batchfix.data import ondisk
from batchfix.data.io import check_values, duplicate_genes_error, repeated
from batchfix.errors import InputError
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)

SCALE_NAMES = {"counts": "raw counts", "log": "log1p values"}  # a model's data.scale, in its error hints


def reference_index(batch_categories: list[str], reference: str | None) -> int | None:
    """Decoder batch for correction: None = average over the training batches."""
    if reference in (None, "average"):
        return None
    if reference not in batch_categories:
        raise InputError(f"Reference batch '{reference}' is not one the model was trained on: "
                         f"{batch_categories} (or 'average').")
    return batch_categories.index(reference)


def gene_columns(var_names: pd.Index, trained: BatchfixModel, max_missing_fraction: float) -> np.ndarray:
    """Column of each modelled gene in the file (-1 when missing), refusing past the allowed share."""
    var_names = pd.Index(var_names).astype(str)
    ambiguous = sorted(set(repeated(var_names)) & set(trained.genes))
    if ambiguous:
        raise duplicate_genes_error(ambiguous, "var_names, in genes the model corrects,")
    duplicated = var_names.duplicated()  # genes the model does not use may repeat: they are copied as they are
    position = pd.Series(np.arange(len(var_names)), index=var_names)[~duplicated]
    columns = position.reindex(trained.genes).fillna(-1).to_numpy(dtype=np.int64)
    n_missing = int((columns < 0).sum())
    share = n_missing / len(columns)
    if share > max_missing_fraction or n_missing == len(columns):
        raise InputError(
            f"{n_missing} of the model's {len(columns)} genes ({share:.0%}) are missing from the input, more than "
            f"max_missing_fraction={max_missing_fraction:g}. Is this the right checkpoint, and are var_names the "
            f"same kind of gene identifier (e.g. {trained.genes[:3]})?"
        )
    if n_missing:
        missing = [g for g, c in zip(trained.genes, columns) if c < 0]
        log.warning("%d of %d modelled genes missing from the input (%.1f%%, e.g. %s): filled with zeros.",
                    n_missing, len(columns), 100 * share, missing[:5])
    return columns


class BoundModel:
    """A trained model bound to one input's genes (and, for the counterfactual output, its cells' batches): what
    every step of a correction reads and none changes.

    Output columns: one per modelled gene present in the input, sorted by its column in the input
    (`out_columns`), ready to be the CSR indices of a row. The estimate pass (batchfix.correction.estimates)
    reduces what the correction needs from all cells; an output kind (batchfix.correction.outputs) then turns
    any row range into its layers.
    """

    def __init__(self, trained: BatchfixModel, var_names: pd.Index, settings: ResolvedCorrection,
                 counts_layer: str | None = None, batch: np.ndarray | None = None, batch_key: str | None = None,
                 obs_names: pd.Index | None = None, normal: np.ndarray | None = None,
                 sex_linked: list[np.ndarray] | None = None):
        self.trained = trained
        self.clock = StageClock()  # where this correction's time goes (batchfix.correction.stages)
        self.sex_linked = sex_linked or []  # input columns of each sex-linked gene set (correction.lacking_genes)
        self.normal = normal  # (cells,) bool: reference cells (regional_shift=reference_cells), or None
        self.net = trained.net
        self.batch_key = batch_key
        self.settings = settings
        self.batch_size = settings.batch_size
        self.reference = reference_index(trained.batch_categories, settings.reference)
        self.reference_name = "average" if self.reference is None else str(settings.reference)
        self.counts_layer = counts_layer  # the layer holding the input's counts; None = X
        self.source = "X" if counts_layer is None else f"layers['{counts_layer}']"  # as messages name it
        self.n_vars = len(var_names)
        columns = gene_columns(var_names, trained, settings.max_missing_fraction)
        self.missing_genes = [g for g, c in zip(trained.genes, columns) if c < 0]
        self.present = torch.from_numpy(columns >= 0)  # (model genes,): held by the input
        self.in_model = np.flatnonzero(columns >= 0)  # model genes fed from the input ...
        self.in_columns = columns[self.in_model]  # ... and their input columns
        # One output column per input column (a gene listed twice in the model is written once).
        self.out_columns, first = np.unique(self.in_columns, return_index=True)
        self.out_model = self.in_model[first]
        self.modelled_mask = np.zeros(self.n_vars, dtype=bool)
        self.modelled_mask[self.out_columns] = True
        self.batches = None if batch is None else counterfactual.batch_codes(batch, trained.batch_categories)
        # The NB model's counterfactual output is corrected counts (and their log layer)
        self.counts_output = self.kind == "counts"
        self.gene_sets: list[count_output.GeneSet] = []  # the counts' modelled genes, then the extra genes
        self.corrected_mask = self.modelled_mask.copy()  # genes whose values the output changes
        # The cells' name keys: the counts' quantile draws and the state groups' sample (batchfix.correction.counts)
        self.cell_keys = None if batch is None else counts.name_keys(obs_names if obs_names is not None
                                                                     else range(len(batch)))
        if self.counts_output:
            self.set_count_genes(var_names, obs_names if obs_names is not None else range(len(batch)))
        if settings.output_mode == "counterfactual":
            calibration.training_statistics(trained.tables)  # refuses an uncalibrated checkpoint before any work
            self.log_batches()

    def set_count_genes(self, var_names: pd.Index, obs_names) -> None:
        """The gene sets of the corrected counts (modelled genes; the extra genes held by the input, each with the
        keys of its randomised quantiles: the genes' names)."""
        names = pd.Index(var_names).astype(str)
        modelled = count_output.GeneSet(False, self.out_model, self.out_columns, self.present,
                                        counts.name_keys(names[self.out_columns]))
        extra = count_output.gene_set(self.trained.extra_genes, names, extra=True)
        if extra is not None:  # an extra gene the model also reads (a repeated name) stays the modelled one's
            keep = ~self.modelled_mask[extra.columns]
            extra = count_output.GeneSet(True, extra.model_index[keep], extra.columns[keep], extra.present,
                                         extra.keys[keep])
            self.corrected_mask[extra.columns] = True
        self.gene_sets = [modelled] + ([extra] if extra is not None and len(extra.columns) else [])
        repeated_names = pd.Index(obs_names).duplicated().sum()
        if repeated_names:
            log.warning("%d cells share their obs_name with an earlier cell: cells of one name share their zeros' "
                        "random draws (keyed by name). Make the names unique first (adata.obs_names_make_unique(), "
                        "or prefix each batch's barcodes when concatenating).", repeated_names)

    def log_genes(self) -> count_output.GeneSet:
        """The log output's modelled genes as a GeneSet (decoder index and input column of each; no draws)."""
        return count_output.GeneSet(False, self.out_model, self.out_columns, self.present, np.empty(0, np.uint64))

    @property
    def kind(self) -> str:
        """counts (the NB model's counterfactual output) | log_counterfactual (log-scale input) | denoised."""
        return provenance.output_kind_name(self.settings.output_mode, self.trained.config.likelihood)

    @property
    def n_out(self) -> int:
        return len(self.out_columns)

    @property
    def latent_dim(self) -> int:
        return int(self.trained.module.model_config.latent_dim)

    def log_batches(self) -> None:
        estimated = "ratio and a dispersion" if self.counts_output else "location and a spread"
        if self.batches.unseen:
            log.warning("Batches the model was not trained on: %s. Their batch effect is estimated from their own "
                        "cells (a per-gene %s against the average decoder).", self.batches.unseen, estimated)
        if self.batches.denoised:
            log.warning("Batches the model was not trained on, with fewer than %d cells: %s. Their cells %s.",
                        calibration.MIN_UNSEEN_CELLS, self.batches.denoised,
                        "keep their counts" if self.counts_output else "get the denoised output")

    def batch_name(self, code: int) -> str:
        n_training = self.batches.n_training
        return self.trained.batch_categories[code] if code < n_training else self.batches.unseen[code - n_training]

    def model_input(self, chunk, first_cell: int = 0) -> torch.Tensor:
        """(cells, model genes) float32 tensor in the model's gene order; missing genes are zeros."""
        values = ondisk.placed_columns(chunk, self.in_columns, self.in_model, len(self.trained.genes))
        self.check(chunk, first_cell)
        return torch.from_numpy(values)

    def check(self, chunk, first_cell: int) -> None:
        """Refuse a chunk holding NaN or infinite values in any gene (they would spread through its cells' library
        to every corrected value), or, for a counts model, values that are not counts."""
        cells = f"cells {first_cell}-{first_cell + chunk.shape[0] - 1}"
        check_values(chunk.data if sp.issparse(chunk) else np.asarray(chunk), self.trained.scale,
                     where=f"The input ({self.source}), in {cells},",
                     hint=f"The model was trained on {SCALE_NAMES[self.trained.scale]}: point data.counts_layer at "
                          "such a layer.")

    def forward_batches(self, n_cells: int, first_cell: int) -> Iterator[tuple[slice, np.ndarray]]:
        """(rows of a chunk of `n_cells` cells, their cells' indices in the input) for each forward batch."""
        for start in range(0, n_cells, self.batch_size):
            stop = min(start + self.batch_size, n_cells)
            yield slice(start, stop), np.arange(first_cell + start, first_cell + stop)

    def chunks(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The input rows [start, stop) cut where a one-process run cuts its chunks (multiples of chunk_size)."""
        size = self.settings.chunk_size
        cuts = [start, *range((start // size + 1) * size, stop, size), stop] if stop > start else []
        return list(zip(cuts, cuts[1:]))

    def batch_index(self, first_cell: int) -> int:
        """The global index of the forward batch starting at `first_cell` among a one-process run's forward batches."""
        size = self.settings.chunk_size
        chunk, offset = divmod(first_cell, size)
        return chunk * -(-size // self.batch_size) + offset // self.batch_size
