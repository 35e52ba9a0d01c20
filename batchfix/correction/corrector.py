"""Inference: corrected expression and latent for any cells, with a trained checkpoint.

Two entry points share one chunked core (`Corrector` + `corrected_chunks`), so they give the
same numbers:

- `correct_file` (the CLI, and `train`'s corrected.h5ad): .h5ad in, new .h5ad out, streamed.
  The input is read a chunk of cells at a time (X or a layer, dense or CSR) and the new entries
  are written chunk by chunk into a copy of the input's other groups, so memory stays bounded
  by the chunk size whatever the file size. The input is opened read-only and never modified;
  the output appears (atomically) only once complete.
- `correct_adata` (the notebook API, `batchfix.correct`): an in-memory AnnData, scanpy style.

What is added (key = key_added, default 'batchfix'):

- layers[key]: corrected expression on the log1p(counts per 10k) scale, float32 CSR of the data's
  full width (n_obs x n_vars, as anndata requires) that stores only the columns of the modelled
  genes: every modelled gene has a value in every cell, and genes the model did not model hold no
  entries (they read as 0). var[f'{key}_modelled'] marks the modelled genes; subset to them
  (adata[:, adata.var[f'{key}_modelled']]) before analysing the layer. Compared with a dense
  full-width layer this stores n_modelled instead of n_vars values per cell (2,000 instead of
  11,533 for the bundled data), and for an uncorrected value in an uncorrected gene there is no
  honest corrected number to store. What the values are depends on `output_mode`:
  counterfactual (each cell's own expression with only what its batch explains removed; see
  batchfix.correction.counterfactual) or denoised (every cell decoded from its latent as the reference).
- obsm[f'X_{key}']: the latent (posterior mean), float32 (n_obs, latent_dim).
- uns[key]: provenance (package version, checkpoint path and sha256, output mode, reference batch,
  training batches, unseen batches and how they were treated, modelled and missing genes, values
  raised to 0, correction and model parameters).

Modelled genes are matched to the input by var_names (a modelled gene named twice is refused: which
column is meant is ambiguous). Missing ones enter the encoder as zero counts, get no output column,
and are reported (log and uns[key]['missing_genes']); past `max_missing_fraction` the correction
stops with an error. The counterfactual output reads each cell's batch from obs[batch_key] (an error
names the obs columns when it is absent; the denoised output does not need it). The encoder does not
see the batch, so cells of batches the model never saw get a latent like any other; for the
counterfactual output their batch effect is estimated from their own cells in a first pass over them
(`Corrector.prepare`).
"""
from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

import batchfix
from batchfix import signals
from batchfix.config import CorrectionSettings
from batchfix.correction import calibration, counterfactual
from batchfix.correction.regional import RegionalShift, genome_smoother
from batchfix.data import ondisk
from batchfix.data.atomic import atomic_output, output_exists
from batchfix.data.io import (
    OutputKeys,
    check_h5ad_path,
    check_values,
    duplicate_genes_error,
    repeated,
    select_matrix,
)
from batchfix.errors import InputError
from batchfix.nn.attention import fused_attention
from batchfix.training.module import BatchfixModel

log = logging.getLogger(__name__)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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

    CPU only; the gene weights and the attention products stay in float32.
    """
    return torch.ao.quantization.quantize_dynamic(copy.deepcopy(net), {torch.nn.Linear}, dtype=torch.qint8)


class Corrector:
    """A trained model bound to one input's genes (and, for the counterfactual output, its cells' batches):
    row chunk of the input -> (latent, corrected values).

    Corrected values come in output order: one column per modelled gene present in the input,
    sorted by its column in the input (`out_columns`), ready to be the CSR indices of a row.
    """

    def __init__(self, trained: BatchfixModel, var_names: pd.Index, settings: CorrectionSettings,
                 source: str = "X", batch: np.ndarray | None = None, batch_key: str | None = None):
        self.trained = trained
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
        if settings.output_mode == "counterfactual":
            calibration.training_statistics(trained.net)  # refuses an uncalibrated checkpoint before any work
            self.log_batches()

    @property
    def n_out(self) -> int:
        return len(self.out_columns)

    @property
    def latent_dim(self) -> int:
        return int(self.trained.module.model_config.latent_dim)

    def log_batches(self) -> None:
        if self.batches.unseen:
            log.warning("Batches the model was not trained on: %s. Their batch effect is estimated from their own "
                        "cells (a per-gene location and a spread against the average decoder).", self.batches.unseen)
        if self.batches.denoised:
            log.warning("Batches the model was not trained on, with fewer than %d cells: %s. Their cells get the "
                        "denoised output.", calibration.MIN_UNSEEN_CELLS, self.batches.denoised)

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
            self.estimate_unseen(rows, n_obs)
            if regional or self.settings.state_dependence < 1:
                self.estimate_mean_shift(rows, n_obs, regional)

    @torch.no_grad()
    def estimate_mean_shift(self, rows, n_obs: int, regional: bool) -> None:
        """Each batch code's mean decoder term decoded_ref - k_b decoded_b over its cells (for state_dependence,
        counterfactual.StateShrink) and, with `regional`, the mean that regional_shift splits against
        (RegionalShift): of the decoder term over the batch's cells (keep) or over all cells
        (keep_all), or of the whole change over all cells (keep_input). The cells' latents are kept (`latents`),
        so the correction decodes them without encoding again."""
        n_codes = self.batches.n_training + len(self.batches.unseen)
        mode = self.settings.regional_shift if regional else "apply"
        decoder_sums = np.zeros((n_codes, len(self.trained.genes)))
        change_sums = np.zeros((n_codes, len(self.trained.genes)))  # keep_input only
        counts = np.zeros(n_codes, dtype=np.int64)
        self.latents = np.empty((n_obs, self.latent_dim), dtype=np.float32)
        for start in range(0, n_obs, self.settings.chunk_size):
            stop = min(start + self.settings.chunk_size, n_obs)
            x = self.model_input(rows.rows(start, stop), start)
            for begin in range(0, stop - start, self.batch_size):
                codes = self.batches.codes[start + begin:start + min(begin + self.batch_size, stop - start)]
                part = x[begin:begin + len(codes)]
                mu, _ = self.net.encode(part)  # (B, latent)
                self.latents[start + begin:start + begin + len(codes)] = mu.numpy()
                values, decoder, observed, _ = counterfactual.output_terms(
                    self.net, part, mu, torch.from_numpy(codes), self.reference, self.statistics, self.present)
                decoder = decoder.numpy()
                change = (values.clamp_min(0.0) - observed).numpy() if mode == "keep_input" else None
                for code in np.unique(codes[codes >= 0]):
                    decoder_sums[code] += decoder[codes == code].sum(axis=0)
                    if change is not None:
                        change_sums[code] += change[codes == code].sum(axis=0)
                    counts[code] += int((codes == code).sum())
        estimated = counts >= calibration.MIN_UNSEEN_CELLS
        small = [self.batch_name(c) for c in np.flatnonzero(~estimated & (counts > 0))]
        unmet = [what for what, needed in (
            ("keep no regional part of their shift (regional_shift=keep)", mode == "keep"),
            ("get all of its state dependence (state_dependence < 1)", self.settings.state_dependence < 1)) if needed]
        if small and unmet:
            log.warning("Batches with fewer than %d cells in the input have no mean shift of their own; their cells "
                        "%s: %s", calibration.MIN_UNSEEN_CELLS, " and ".join(unmet), small)
        batch_mean = decoder_sums / np.maximum(counts, 1)[:, None]  # (codes, G)
        as_tensor = partial(torch.as_tensor, dtype=torch.float32)
        if self.settings.state_dependence < 1:
            self.state = counterfactual.StateShrink(float(self.settings.state_dependence), as_tensor(batch_mean),
                                                    as_tensor(estimated))
        if not regional:
            return
        if mode == "keep":
            mean_shift = batch_mean
        else:  # one mean over every cell, for every batch
            sums = change_sums if mode == "keep_input" else decoder_sums
            mean_shift = np.repeat(sums.sum(axis=0, keepdims=True) / max(counts.sum(), 1), n_codes, axis=0)
            estimated = np.full(n_codes, counts.sum() >= calibration.MIN_UNSEEN_CELLS)
        smoother = genome_smoother(list(self.trained.module.hparams.chromosome),
                                                  self.settings.regional_order, self.settings.regional_window,
                                                  self.settings.regional_seed)
        self.regional = RegionalShift(smoother, as_tensor(mean_shift), as_tensor(estimated),
                                                     whole=mode == "keep_input")

    def batch_name(self, code: int) -> str:
        n_training = self.batches.n_training
        return self.trained.batch_categories[code] if code < n_training else self.batches.unseen[code - n_training]

    def estimate_unseen(self, rows, n_obs: int) -> None:
        n_training = self.batches.n_training
        sums = [calibration.ResidualSums(len(self.trained.genes)) for _ in self.batches.unseen]
        for start in range(0, n_obs if sums else 0, self.settings.chunk_size):
            stop = min(start + self.settings.chunk_size, n_obs)
            codes = self.batches.codes[start:stop]
            picked = np.flatnonzero(codes >= n_training)
            if len(picked):
                x = self.model_input(rows.rows(start, stop)[picked], start)
                for begin in range(0, len(picked), self.batch_size):
                    part = slice(begin, begin + self.batch_size)
                    r = calibration.residual(self.net, x[part], None, self.present).numpy()
                    for code in np.unique(codes[picked[part]]):
                        sums[code - n_training].add(r[codes[picked[part]] == code])
        self.statistics = calibration.Statistics(self.trained.net, self.reference, sums, self.present.numpy(),
                                                    self.settings.spread, self.settings.residual_weight)

    def model_input(self, chunk, first_cell: int = 0) -> torch.Tensor:
        """(cells, model genes) float32 tensor in the model's gene order; missing genes are zeros."""
        selected = chunk[:, self.in_columns]
        selected = selected.toarray() if sp.issparse(selected) else np.asarray(selected)
        values = np.zeros((selected.shape[0], len(self.trained.genes)), dtype=np.float32)
        values[:, self.in_model] = selected
        self.check(values, first_cell)
        return torch.from_numpy(values)

    def check(self, values: np.ndarray, first_cell: int) -> None:
        cells = f"cells {first_cell}-{first_cell + len(values) - 1}"
        check_values(values, self.trained.scale, where=f"The input ({self.source}), in the modelled genes of {cells},",
                     hint="The model was trained on counts: point counts_layer at a layer of raw counts.")

    @torch.inference_mode()
    def __call__(self, chunk, first_cell: int = 0) -> tuple[np.ndarray, np.ndarray]:
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

    def corrected(self, chunk, first_cell: int) -> tuple[np.ndarray, np.ndarray]:
        x = self.model_input(chunk, first_cell)
        self.count_empty(chunk, x)
        latent = np.empty((x.shape[0], self.latent_dim), dtype=np.float32)
        values = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        for start in range(0, x.shape[0], self.batch_size):
            stop = start + self.batch_size
            if self.settings.output_mode == "denoised":
                mu, expression = self.net.corrected(x[start:stop], self.reference)
            else:
                if self.statistics is None:
                    raise RuntimeError("Corrector.prepare(rows, n_obs) must run before the counterfactual output.")
                cells = slice(first_cell + start, first_cell + min(stop, x.shape[0]))
                codes = torch.from_numpy(self.batches.codes[cells])
                mu = None if self.latents is None else torch.from_numpy(self.latents[cells])
                mu, expression, n_clipped = counterfactual.corrected(self.net, x[start:stop], codes,
                                                                     self.reference, self.statistics, self.present,
                                                                     self.regional, self.state, mu=mu)
                self.n_clipped += n_clipped
            latent[start:stop] = mu.numpy()
            values[start:stop] = expression.numpy()[:, self.out_model]
        return latent, values


def corrected_chunks(corrector: Corrector, rows, n_obs: int, chunk_size: int,
                     progress: bool) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """(start, stop, latent, corrected values) for consecutive chunks of cells, with a cells/s progress bar."""
    started = time.perf_counter()
    with tqdm(total=n_obs, unit="cell", unit_scale=True, desc="batchfix correct", disable=not progress,
              mininterval=1.0, smoothing=0.1) as bar:
        for start in range(0, n_obs, chunk_size):
            signals.raise_pending()
            stop = min(start + chunk_size, n_obs)
            latent, values = corrector(rows.rows(start, stop), start)
            yield start, stop, latent, values
            bar.update(stop - start)
    seconds = time.perf_counter() - started
    log.info("Corrected %d cells x %d genes in %.1f s (%.0f cells/s).", n_obs, corrector.n_out, seconds,
             n_obs / max(seconds, 1e-9))


LAYER_MEANING = {
    "counterfactual": "each cell's own log1p(expression per 10k counts) with only what its batch explains removed "
                      "(batchfix.correction.counterfactual)",
    "denoised": "every cell decoded from its latent as the reference batch, log1p(expression per 10k counts)",
}


def provenance(corrector: Corrector) -> dict:
    """uns[key_added]: what produced the correction (after the last chunk: it counts the clipped values)."""
    trained, settings = corrector.trained, corrector.settings
    keys = OutputKeys(settings.key_added)
    info = {
        "version": batchfix.__version__,
        "checkpoint": str(trained.path.resolve()) if trained.path else "(in memory, not saved)",
        "checkpoint_sha256": file_sha256(trained.path) if trained.path else "",
        "output_mode": settings.output_mode,
        "reference_batch": corrector.reference_name,
        "training_batches": trained.batch_categories,
        "modelled_genes": trained.genes,
        "n_modelled_genes": len(trained.genes),
        "missing_genes": corrector.missing_genes,
        "n_missing_genes": len(corrector.missing_genes),
        "n_cells_without_counts": corrector.n_empty_modelled,  # in the modelled genes: decoded from nothing
        "layer": f"layers['{keys.layer}']: {LAYER_MEANING[settings.output_mode]}; only the genes marked in "
                 f"var['{keys.modelled}'] are stored, other genes read as 0",
        "params": {
            "output_mode": settings.output_mode,
            "spread": settings.spread,
            "counts": corrector.source,
            "scale": trained.scale,
            "chunk_size": settings.chunk_size,
            "batch_size": settings.batch_size,
            "max_missing_fraction": float(settings.max_missing_fraction),
            "int8": bool(settings.int8),
            "regional_shift": settings.regional_shift,
            "regional_window": int(settings.regional_window),
            "regional_order": settings.regional_order,
            "regional_seed": int(settings.regional_seed),
            "state_dependence": float(settings.state_dependence),
            "residual_weight": float(settings.residual_weight),
            "model": dict(trained.module.hparams["model"]),
        },
    }
    if corrector.batches is not None:
        info["params"]["batch_key"] = corrector.batch_key
        info["unseen_batches_estimated"] = corrector.batches.unseen
        info["unseen_batches_denoised"] = corrector.batches.denoised
        info["n_clipped_to_zero"] = corrector.n_clipped
    return info


def _for_hdf5(value):
    """uns values as anndata writes them back exactly (an empty list would come back as floats)."""
    if isinstance(value, dict):
        return {k: _for_hdf5(v) for k, v in value.items()}
    if isinstance(value, list):
        return np.array(value, dtype=object)
    return value


def source_name(counts_layer: str | None) -> str:
    return "X" if counts_layer is None else f"layers['{counts_layer}']"


def data_keys(trained: BatchfixModel, batch_key: str | None, counts_layer: str | None) -> tuple[str, str | None]:
    """(batch_key, counts_layer) to correct with: the caller's, else those the model was trained with
    (counts_layer 'X' names the X matrix)."""
    saved = trained.data_options
    batch_key = saved["batch_key"] if batch_key is None else batch_key
    counts_layer = saved["counts_layer"] if counts_layer is None else counts_layer
    return batch_key, None if counts_layer == "X" else counts_layer


def cell_batches(values: pd.Series | None, batch_key: str, columns: list[str], training_batches: list[str],
                 all_batches_new: bool = False) -> np.ndarray:
    """Each cell's batch (strings) for the counterfactual output, or an error naming the obs columns; an input
    none of whose batches the model was trained on is refused (a wrong column?) unless all_batches_new."""
    if values is None:
        raise InputError(f"output_mode=counterfactual needs each cell's batch, but obs has no column '{batch_key}'. "
                         f"Columns present: {columns or '(none)'}. Set batch_key=<column>, or use "
                         "output_mode=denoised (which does not need it).")
    if values.isna().any():
        raise InputError(f"obs column '{batch_key}' has {int(values.isna().sum())} missing values; every cell needs "
                         "its batch for output_mode=counterfactual.")
    batch = values.astype(str).to_numpy()
    found = pd.unique(batch)
    if not all_batches_new and len(found) and not set(found) & set(training_batches):
        raise InputError(f"None of the {len(found)} values of obs column '{batch_key}' (e.g. {sorted(found)[:3]}) is "
                         f"a batch the model was trained on ({training_batches}). Is batch_key the column of the "
                         f"batches? obs columns: {columns}. If every batch is new to the model, set "
                         "all_batches_new=true.")
    return batch


def correct_adata(adata: ad.AnnData, trained: BatchfixModel, settings: CorrectionSettings,
                  counts_layer: str | None = None, batch_key: str | None = None, copy: bool = False,
                  progress: bool = False, all_batches_new: bool = False) -> ad.AnnData | None:
    """Add corrected expression to an in-memory AnnData, scanpy style.

    Adds layers[key_added] (CSR, corrected log1p expression per 10k; only modelled genes stored),
    var[f'{key_added}_modelled'], obsm[f'X_{key_added}'] (latent) and uns[key_added] (provenance).
    obs[batch_key] is read for output_mode=counterfactual; batch_key and counts_layer default to the
    model's (`data_keys`). `adata` is left unchanged when an error is raised. Returns the corrected copy
    when copy=True, else None.
    """
    batch_key, counts_layer = data_keys(trained, batch_key, counts_layer)
    matrix = select_matrix(adata, counts_layer, option="counts_layer")
    batch = None
    if settings.output_mode == "counterfactual":
        batch = cell_batches(adata.obs[batch_key] if batch_key in adata.obs else None, batch_key,
                             list(map(str, adata.obs.columns)), trained.batch_categories, all_batches_new)
    corrector = Corrector(trained, adata.var_names, settings, source_name(counts_layer), batch, batch_key)
    rows = ondisk.InMemoryRows(matrix)
    n_obs, k = adata.n_obs, corrector.n_out
    corrector.prepare(rows, n_obs)
    latent = np.empty((n_obs, corrector.latent_dim), dtype=np.float32)
    data = np.empty(n_obs * k, dtype=np.float32)
    for start, stop, mu, values in corrected_chunks(corrector, rows, n_obs, settings.chunk_size, progress):
        latent[start:stop] = mu
        data[start * k:stop * k] = values.ravel()
    corrector.check_empty_cells(n_obs)
    dtype = ondisk.index_dtype(data.size, adata.n_vars)
    layer = sp.csr_matrix((data, np.tile(corrector.out_columns.astype(dtype), n_obs),
                           np.arange(n_obs + 1, dtype=dtype) * k), shape=adata.shape, copy=False)
    info = provenance(corrector)

    keys = OutputKeys(settings.key_added)
    adata = adata.copy() if copy else adata
    adata.layers[keys.layer] = layer
    adata.obsm[keys.latent] = latent
    adata.var[keys.modelled] = corrector.modelled_mask
    adata.uns[keys.uns] = info
    return adata if copy else None


def open_input(input_path: str | Path, output_path: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """(input, output) paths, checked: the input an .h5ad, the output neither the input, a folder nor (unless
    overwrite) an existing file."""
    source = check_h5ad_path(input_path)
    target = Path(output_path).expanduser()
    if target.exists() and target.samefile(source):
        raise InputError(f"The output {target} is the input file; write the corrected file elsewhere.")
    if target.is_dir():
        raise InputError(f"The output {target} is a folder; name an .h5ad file.")
    if target.exists() and not overwrite:
        raise output_exists(target)
    return source, target


def correct_file(input_path: str | Path, output_path: str | Path, trained: BatchfixModel,
                 settings: CorrectionSettings, counts_layer: str | None = None, batch_key: str | None = None,
                 overwrite: bool = False, progress: bool = True, all_batches_new: bool = False) -> Path:
    """Correct an .h5ad into a new .h5ad, streaming chunks of cells (memory bounded by chunk_size).

    The output is the input's content (X, layers, obs, var, obsm, obsp, varm, varp, uns, raw: copied
    with h5py, storage settings kept) plus what `correct_adata` adds, written into a temporary file
    beside `output_path` and renamed into place when complete. An existing output is refused
    unless overwrite=True. The input is opened read-only.
    """
    source, target = open_input(input_path, output_path, overwrite)
    batch_key, counts_layer = data_keys(trained, batch_key, counts_layer)
    keys = OutputKeys(settings.key_added)
    with ondisk.open_anndata(source) as src:
        var_names = ondisk.read_var_names(src)
        n_obs = ondisk.n_obs_of(src)
        rows = ondisk.open_rows(ondisk.matrix_element(src, counts_layer))
        if rows.shape != (n_obs, len(var_names)):
            raise InputError(f"{source}: the matrix is {rows.shape} but obs x var is {(n_obs, len(var_names))}.")
        batch = None
        if settings.output_mode == "counterfactual":
            batch = cell_batches(ondisk.read_obs_column(src, batch_key), batch_key, ondisk.obs_columns(src),
                                 trained.batch_categories, all_batches_new)
        corrector = Corrector(trained, var_names, settings, source_name(counts_layer), batch, batch_key)
        corrector.prepare(rows, n_obs)
        k = corrector.n_out
        with atomic_output(target, overwrite) as tmp, h5py.File(tmp, "w") as dst:
            ondisk.copy_file_except(src, dst, top_skip={"var"},
                                    skip={"layers": {keys.layer}, "obsm": {keys.latent}, "uns": {keys.uns}})
            ondisk.replace_var_column(src, dst, keys.modelled, corrector.modelled_mask)
            data, indices, indptr = ondisk.create_csr(dst["layers"], keys.layer, (n_obs, len(var_names)), n_obs * k)
            latent = ondisk.create_array(dst["obsm"], keys.latent, (n_obs, corrector.latent_dim))
            row_indices = corrector.out_columns.astype(indices.dtype)
            for start, stop, mu, values in corrected_chunks(corrector, rows, n_obs, settings.chunk_size, progress):
                latent[start:stop] = mu
                data[start * k:stop * k] = values.ravel()
                indices[start * k:stop * k] = np.tile(row_indices, stop - start)
                indptr[start + 1:stop + 1] = np.arange(start + 1, stop + 1, dtype=indptr.dtype) * k
            indptr[0] = 0
            corrector.check_empty_cells(n_obs)  # an input of empty cells leaves no output
            ondisk.write_uns_entry(dst, keys.uns, _for_hdf5(provenance(corrector)))
    log.info("Wrote %s (%d cells; layers['%s'] (%s) with %d modelled genes, %d missing; reference: %s).", target,
             n_obs, keys.layer, settings.output_mode, k, len(corrector.missing_genes), corrector.reference_name)
    return target
