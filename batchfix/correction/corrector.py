"""Inference: the latent and the corrected output of any cells, with a trained checkpoint.

`Corrector` binds a trained model to one input's genes (and, for the counterfactual output, its cells' batches)
and turns a row chunk of the input into (latent, output layers); `corrected_chunks` runs it over a file chunk by
chunk. The writers (batchfix.correction.writers) put the layers into an AnnData or a new .h5ad, so the in-memory
and the streamed outputs are the same numbers.

Modelled genes are matched to the input by var_names (a modelled gene named twice is refused: which column is
meant is ambiguous). Missing ones enter the encoder as zero counts, get no output column, and are reported (log
and uns[key]['missing_genes']); past `max_missing_fraction` the correction stops with an error. The
counterfactual output reads each cell's batch from obs[batch_key]; the denoised output does not need it. The
encoder does not see the batch, so cells of batches the model never saw get a latent like any other; for the
counterfactual output their batch effect is estimated from their own cells first (`Corrector.prepare`,
batchfix.correction.estimates).
"""
from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

from batchfix import signals
from batchfix.config import CorrectionSettings
from batchfix.correction import calibration, count_output, counterfactual, counts, estimates, layers
from batchfix.data.io import (
    check_values,
    duplicate_genes_error,
    repeated,
)
from batchfix.errors import InputError
from batchfix.nn.attention import fused_attention
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


def int8_network(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of the network whose linear layers run in int8 (weights quantized once, activations per batch).

    CPU only; the gene weights, the attention products and the extra genes' decoder stay in float32 (int8 there
    moved 13 % of those genes' corrected counts, some by tens).
    """
    quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(net), {torch.nn.Linear}, dtype=torch.qint8)
    if getattr(net, "extra_decoder", None) is not None:
        quantized.extra_decoder = copy.deepcopy(net.extra_decoder)
    return quantized


class Corrector:
    """A trained model bound to one input's genes (and, for the counterfactual output, its cells' batches):
    row chunk of the input -> (latent, corrected values).

    Corrected values come in output order: one column per modelled gene present in the input,
    sorted by its column in the input (`out_columns`), ready to be the CSR indices of a row.
    """

    def __init__(self, trained: BatchfixModel, var_names: pd.Index, settings: CorrectionSettings,
                 source: str = "X", batch: np.ndarray | None = None, batch_key: str | None = None,
                 obs_names: pd.Index | None = None, normal: np.ndarray | None = None):
        self.trained = trained
        self.normal = normal  # (cells,) bool: reference cells (correction.normal_key), or None
        self.net = int8_network(trained.net) if settings.int8 else trained.net
        self.batch_key = batch_key
        self.settings = settings
        self.batch_size = settings.batch_size
        self.reference = reference_index(trained.batch_categories, settings.reference)
        self.reference_name = "average" if self.reference is None else str(settings.reference)
        self.source = source
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
        self.n_clipped = 0
        self.n_empty = 0  # cells with no counts in any gene of the input
        self.n_empty_modelled = 0  # cells with no counts in the modelled genes (the empty ones among them)
        self.batches = None if batch is None else counterfactual.batch_codes(batch, trained.batch_categories)
        self.statistics = None
        self.regional = None  # regional.RegionalShift, estimated by `prepare` unless regional_shift=apply
        self.state = None  # counterfactual.StateShrink, estimated by `prepare` when state_dependence < 1
        self.latents = None  # (cells, latent) encoded by that estimate, reused by the correction
        # The NB model's counterfactual output is corrected counts (and their log layer): `estimates` sets the
        # dispersion of each batch code (theta, (codes, G)), the reference's and the unseen batches' ratios.
        self.counts_output = settings.output_mode == "counterfactual" and trained.config.likelihood == "nb"
        self.n_zeros = self.n_zeros_raised = 0  # observed zeros of the output's genes, and those made positive
        self.gene_sets: list[count_output.GeneSet] = []  # the counts' modelled genes, then the extra genes
        self.corrected_mask = self.modelled_mask.copy()  # genes whose values the output changes
        if self.counts_output:
            self.set_count_genes(var_names, obs_names if obs_names is not None else range(len(batch)))
        if settings.output_mode == "counterfactual":
            calibration.training_statistics(trained.net)  # refuses an uncalibrated checkpoint before any work
            self.log_batches()

    def set_count_genes(self, var_names: pd.Index, obs_names) -> None:
        """The gene sets of the corrected counts (modelled genes; the extra genes held by the input) and the keys
        of the randomised quantiles (the cells' and the genes' names)."""
        names = pd.Index(var_names).astype(str)
        modelled = count_output.GeneSet(False, self.out_model, self.out_columns, self.present,
                                        counts.name_keys(names[self.out_columns]))
        extra = count_output.gene_set(self.trained.extra_genes, names, extra=True)
        if extra is not None:  # an extra gene the model also reads (a repeated name) stays the modelled one's
            keep = ~self.modelled_mask[extra.columns]
            extra.model_index, extra.columns, extra.keys = (extra.model_index[keep], extra.columns[keep],
                                                           extra.keys[keep])
            self.corrected_mask[extra.columns] = True
        self.gene_sets = [modelled] + ([extra] if extra is not None and len(extra.columns) else [])
        self.cell_keys = counts.name_keys(obs_names)

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

    def prepare(self, rows, n_obs: int) -> None:
        """Before correcting: estimate the unseen batches' location and spread (one pass over their cells) and,
        for the regional shift (unless regional_shift=apply or no modelled gene is placed on the genome) or
        state_dependence < 1, every batch's mean shift (one pass over all cells)."""
        if self.settings.output_mode != "counterfactual":
            return
        regional = self.settings.regional_shift != "apply"
        if regional and all(c is None for c in self.trained.module.hparams.chromosome):
            log.info("regional_shift=%s: no modelled gene has genomic coordinates, so no part of the shift is "
                     "regional: all of it is removed (as with regional_shift=apply).", self.settings.regional_shift)
            regional = False
        with fused_attention(self.net):
            estimates.estimate_unseen(self, rows, n_obs)
            if regional or self.settings.state_dependence < 1:
                estimates.estimate_mean_shift(self, rows, n_obs, regional)

    def batch_name(self, code: int) -> str:
        n_training = self.batches.n_training
        return self.trained.batch_categories[code] if code < n_training else self.batches.unseen[code - n_training]

    def model_input(self, chunk, first_cell: int = 0) -> torch.Tensor:
        """(cells, model genes) float32 tensor in the model's gene order; missing genes are zeros."""
        selected = chunk[:, self.in_columns]
        selected = selected.toarray() if sp.issparse(selected) else np.asarray(selected)
        values = np.zeros((selected.shape[0], len(self.trained.genes)), dtype=np.float32)
        values[:, self.in_model] = selected
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

    @torch.inference_mode()
    def __call__(self, chunk, first_cell: int = 0) -> tuple[np.ndarray, dict[str, sp.csr_matrix]]:
        with fused_attention(self.net):
            return self.corrected(chunk, first_cell)

    def count_empty(self, chunk, x: torch.Tensor) -> None:
        """Count the chunk's cells without counts, in every gene and in the modelled genes."""
        nonzero_per_cell = (chunk != 0).sum(axis=1)
        self.n_empty += int((np.asarray(nonzero_per_cell).ravel() == 0).sum())
        self.n_empty_modelled += int((x == 0).all(dim=1).sum())

    def check_empty_cells(self, n_obs: int) -> None:
        """After the last chunk: refuse an input whose every cell is empty in the modelled genes (nothing to
        correct); warn with the count when some are."""
        if n_obs and self.n_empty_modelled == n_obs:
            what = "in any gene" if self.n_empty == n_obs else f"in any of the model's {len(self.trained.genes)} genes"
            raise InputError(f"All {n_obs} cells of the input ({self.source}) have no counts {what}: there is no "
                             "expression to correct. Is this the right file (and counts_layer)?")
        if self.n_empty_modelled:
            log.warning("%d of %d cells have no counts in any of the model's genes (%d of them in no gene at all): "
                        "their corrected values are what the model decodes from an empty cell (the same for every "
                        "such cell of a batch), not a measurement. Remove them first, e.g. "
                        "scanpy.pp.filter_cells(adata, min_counts=1).", self.n_empty_modelled, n_obs, self.n_empty)

    def corrected(self, chunk, first_cell: int) -> tuple[np.ndarray, dict[str, sp.csr_matrix]]:
        """(latent (cells, latent_dim), the output layers of the chunk's rows by kind: 'counts' and 'log' for the
        corrected counts, 'log' alone for the denoised and the log-scale outputs (`layers`))."""
        x = self.model_input(chunk, first_cell)
        self.count_empty(chunk, x)
        if self.counts_output:
            return self.corrected_counts(chunk, x, first_cell)
        latent = np.empty((x.shape[0], self.latent_dim), dtype=np.float32)
        values = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        for start in range(0, x.shape[0], self.batch_size):
            stop = start + self.batch_size
            if self.settings.output_mode == "denoised":
                mu, expression = self.net.corrected(x[start:stop], self.reference)
            else:
                mu, expression = self.counterfactual_batch(x[start:stop], first_cell + start)
            latent[start:stop] = mu.numpy()
            values[start:stop] = expression.numpy()[:, self.out_model]
        return latent, {"log": layers.modelled_layer(values, self.out_columns, self.n_vars)}

    def latents_of(self, x: torch.Tensor, cells: np.ndarray) -> torch.Tensor:
        """(B, latent) the latent means of the cells at `cells`: kept from `prepare`, else encoded now."""
        return self.net.encode(x)[0] if self.latents is None else torch.from_numpy(self.latents[cells])

    def counterfactual_batch(self, x: torch.Tensor, first_cell: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent mean, the log-scale counterfactual output (B, model genes)) of one forward batch."""
        if self.statistics is None:
            raise RuntimeError("Corrector.prepare(rows, n_obs) must run before the counterfactual output.")
        cells = np.arange(first_cell, first_cell + x.shape[0])
        codes = torch.from_numpy(self.batches.codes[cells])
        mu, expression, n_clipped = counterfactual.corrected(self.net, x, codes, self.reference, self.statistics,
                                                             self.present, self.regional, self.state,
                                                             mu=self.latents_of(x, cells))
        self.n_clipped += n_clipped
        return mu, expression

    def count_batches(self, x: torch.Tensor, first_cell: int) -> Iterator[tuple[slice, np.ndarray, torch.Tensor,
                                                                                  torch.Tensor]]:
        """(rows of the chunk `x`, their cells' indices, batch codes, latents) for each forward batch of it."""
        if self.gene_sets[0].theta is None:
            raise RuntimeError("Corrector.prepare(rows, n_obs) must run before the corrected counts.")
        for start in range(0, x.shape[0], self.batch_size):
            part = slice(start, start + self.batch_size)
            cells = np.arange(first_cell + start, first_cell + min(start + self.batch_size, x.shape[0]))
            yield part, cells, torch.from_numpy(self.batches.codes[cells]), self.latents_of(x[part], cells)

    def corrected_counts(self, chunk, x: torch.Tensor, first_cell: int) -> tuple[np.ndarray, dict]:
        """(latent, {'counts', 'log'}) of a chunk: each observed count of every corrected gene moved from its
        batch's NB to the reference's (batchfix.correction.counts; the cell's library kept, the shift after every
        option), each gene set with its decoder (count_output)."""
        inputs = [x] + [genes.observed(chunk) for genes in self.gene_sets[1:]]
        latent = np.empty((x.shape[0], self.latent_dim), dtype=np.float32)
        mapped = [np.empty((x.shape[0], len(genes.columns))) for genes in self.gene_sets]
        for part, cells, codes, mu in self.count_batches(x, first_cell):
            latent[part] = mu.numpy()
            for genes, values, out in zip(self.gene_sets, inputs, mapped):
                observed, out[part] = count_output.mapped_counts(
                    self.net, genes, values[part], mu, codes, self.cell_keys[cells], self.reference,
                    self.settings.quantile_seed, self.state, self.regional)
                self.n_zeros += int((observed == 0).sum())
                self.n_zeros_raised += int(((observed == 0) & (out[part] > 0)).sum())
        columns = np.concatenate([genes.columns for genes in self.gene_sets])
        order = np.argsort(columns, kind="stable")
        return latent, layers.count_layers(chunk, np.hstack(mapped)[:, order], columns[order], self.corrected_mask)

    @torch.inference_mode()
    def model_checks(self, chunk, first_cell: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the modelled genes' corrected counts: (their input columns (ascending), (cells, genes) float32
        P(count > 0) under each cell's reference NB, the detection the corrected counts should show, and (cells,
        genes) float32 the randomised PIT of each observed count under its own batch's NB, uniform where the model
        fits), for batchfix.eval.detection. The PIT's draws are keyed by (quantile_seed + 1, cell, gene)."""
        genes = self.gene_sets[0]
        x = self.model_input(chunk, first_cell)
        expected = np.empty((x.shape[0], len(genes.columns)), dtype=np.float32)
        pit = np.empty_like(expected)
        with fused_attention(self.net):
            for part, cells, codes, mu in self.count_batches(x, first_cell):
                nb = count_output.count_distributions(self.net, genes, x[part], mu, codes, self.reference,
                                                      self.state, self.regional)
                expected[part] = nb.reference_nonzero()
                draws = counts.counter_uniform(self.settings.quantile_seed + 1, self.cell_keys[cells], genes.keys)
                pit[part] = nb.own_pit(draws)
        return genes.columns, expected, pit


def corrected_chunks(corrector: Corrector, rows, n_obs: int, chunk_size: int,
                     progress: bool) -> Iterator[tuple[int, int, np.ndarray, dict[str, sp.csr_matrix]]]:
    """(start, stop, latent, the chunk's output layers) for consecutive chunks of cells, with a cells/s progress
    bar."""
    started = time.perf_counter()
    with tqdm(total=n_obs, unit="cell", unit_scale=True, desc="batchfix correct", disable=not progress,
              mininterval=1.0, smoothing=0.1) as bar:
        for start in range(0, n_obs, chunk_size):
            signals.raise_pending()
            stop = min(start + chunk_size, n_obs)
            latent, chunk_layers = corrector(rows.rows(start, stop), start)
            yield start, stop, latent, chunk_layers
            bar.update(stop - start)
    seconds = time.perf_counter() - started
    log.info("Corrected %d cells x %d genes in %.1f s (%.0f cells/s).", n_obs, int(corrector.corrected_mask.sum()),
             seconds, n_obs / max(seconds, 1e-9))
