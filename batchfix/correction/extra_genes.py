"""The genes the encoder does not read: a second NB decoder, fitted after the main fit with the encoder frozen.

Only the highly variable genes are tokens of the encoder; every other gene detected in at least MIN_CELLS cells
of the training file is corrected too, through a decoder of its own: (latent, batch) -> NB mean fractions of those
genes' library (their counts' sum in the cell) and a dispersion per gene. The latent and the modelled genes'
outputs stay as they are: the encoder's latents are computed once (no gradient) and only the new decoder learns (its
fit: batchfix.training.extra_decoder). Its per-batch dispersions are then calibrated as the main decoder's are
(batchfix.correction.counts). Genes detected in fewer cells keep their uncorrected counts; the output flags them
(var[f'{key}_corrected']).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from batchfix.correction import counts
from batchfix.correction.calibration import CALIBRATION_CELLS_PER_BATCH, calibration_cells, store_count_tables
from batchfix.data import ondisk
from batchfix.data.io import input_path, select_matrix
from batchfix.data.prepare import PreparedData, in_order
from batchfix.nn.attention import fused_attention
from batchfix.training.extra_decoder import SparseCounts, fit_decoder
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)

MIN_CELLS = 3  # a gene detected in fewer cells of the training file is not corrected
def detected_cells(rows, n_obs: int, chunk_size: int = 4096) -> np.ndarray:
    """(genes,) the number of cells with a nonzero count in each gene, over a row reader."""
    detected = np.zeros(rows.shape[1], dtype=np.int64)
    for start in range(0, n_obs, chunk_size):
        chunk = rows.rows(start, min(start + chunk_size, n_obs))
        detected += np.asarray((chunk != 0).sum(axis=0)).ravel()
    return detected


@torch.no_grad()
def latents_and_codes(model: BatchfixModel, prepared: PreparedData, cells: np.ndarray) -> tuple[torch.Tensor, ...]:
    """(latent means (cells, latent), batch codes (cells,)) of the prepared cells at `cells` (sorted)."""
    net = model.net
    net.eval()
    latents, codes = [], []
    with fused_attention(net):
        for x, batch in in_order(prepared, 256, cells):
            latents.append(net.encode(x)[0])
            codes.append(torch.from_numpy(batch))
    return torch.cat(latents), torch.cat(codes)


@torch.no_grad()
def calibrate_dispersion(net, tables, latents: torch.Tensor, codes: torch.Tensor, extra_counts: SparseCounts) -> None:
    """Each training batch's dispersion and ratio of the extra genes around the fitted means (tables.extra_count_*)."""
    shared = net.extra_decoder.log_theta.double().exp().numpy()
    sums = [counts.CountSums(extra_counts.matrix.shape[1]) for _ in range(net.n_batches)]
    for start in range(0, len(latents), 1024):
        part = slice(start, start + 1024)
        mean = (net.mean_fractions(latents[part], codes[part], extra=True) * extra_counts.library[part]).numpy()
        observed = extra_counts.matrix[start:start + 1024].toarray()
        for b in np.unique(codes[part].numpy()):
            chosen = (codes[part] == b).numpy()
            sums[b].add(observed[chosen], mean[chosen])
    store_count_tables(tables.extra_count_theta, tables.extra_count_ratio, sums, shared)


def add_extra_genes(model: BatchfixModel, prepared: PreparedData, rows, var_names, seed: int = 0) -> dict:
    """Fit the extra genes' decoder into `model` (NB models only) from the training file's counts (`rows`, a row
    reader of the whole file with columns `var_names`; the extra genes go into the checkpoint's hyperparameters);
    returns the run summary's counts: {'modelled', 'extra', 'uncorrected'} genes."""
    summary = {"modelled": len(model.genes), "extra": 0, "uncorrected": len(var_names) - len(model.genes)}
    if model.config.likelihood != "nb":
        return summary
    var_names = np.asarray(var_names).astype(str)
    detected = detected_cells(rows, rows.shape[0])
    modelled = np.isin(var_names, model.genes)
    _, first = np.unique(var_names, return_index=True)
    unique = np.zeros(len(var_names), dtype=bool)
    unique[first] = True
    columns = np.flatnonzero((detected >= MIN_CELLS) & ~modelled & unique)
    summary["uncorrected"] = int(((detected < MIN_CELLS) & ~modelled).sum())
    if len(columns) == 0:
        return summary
    cells = calibration_cells(prepared.batch_index, len(prepared.batch_categories), CALIBRATION_CELLS_PER_BATCH)
    taken = rows.take(prepared.file_rows[cells])[:, columns]
    extra_counts = SparseCounts(taken)
    latents, codes = latents_and_codes(model, prepared, cells)
    torch.manual_seed(seed)
    model.net.add_extra_genes(len(columns))
    model.tables.add_extra_genes(len(columns))
    loss, steps = fit_decoder(model.net, latents, codes, extra_counts, seed)
    calibrate_dispersion(model.net, model.tables, latents, codes, extra_counts)
    genes = var_names[columns].tolist()
    model.module.hparams["extra_genes"] = genes
    log.info("Corrected beyond the %d modelled genes: %d more genes detected in >= %d cells, through a second "
             "decoder fitted on %d cells in %d steps (NB loss %.1f per held-out cell); %d genes detected in fewer "
             "cells keep their counts.", len(model.genes), len(genes), MIN_CELLS, len(cells), steps, loss,
             summary["uncorrected"])
    return {**summary, "extra": len(genes)}


def add_extra_genes_from(model: BatchfixModel, prepared: PreparedData, data, adata=None, seed: int = 0) -> dict:
    """`add_extra_genes` from the training data: `adata` in memory, else the file data.path (read by chunks)."""
    if adata is not None:
        rows = ondisk.InMemoryRows(select_matrix(adata, data.counts_layer))
        return add_extra_genes(model, prepared, rows, adata.var_names, seed)
    with ondisk.open_anndata(input_path(data.path)) as f:
        rows = ondisk.open_rows(ondisk.matrix_element(f, data.counts_layer))
        return add_extra_genes(model, prepared, rows, ondisk.read_var_names(f), seed)
