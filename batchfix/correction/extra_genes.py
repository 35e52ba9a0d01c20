"""The genes the encoder does not read: a second NB decoder, fitted after the main fit with the encoder frozen.

Only the highly variable genes are tokens of the encoder; every other gene detected in at least MIN_CELLS cells
of the training file is corrected too, through a decoder of its own: (latent, batch) -> NB mean fractions of those
genes' library (their counts' sum in the cell) and a dispersion per gene. The latent and the modelled genes'
outputs stay as they are: the encoder's latents are computed once (no gradient) and only the new decoder learns.
Its per-batch dispersions are then calibrated as the main decoder's are (batchfix.correction.counts). Genes
detected in fewer cells keep their uncorrected counts; the output flags them (var[f'{key}_corrected']).
"""
from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from batchfix.correction import counts
from batchfix.correction.calibration import CALIBRATION_CELLS_PER_BATCH, calibration_cells, store_count_tables
from batchfix.data import ondisk
from batchfix.data.io import input_path, select_matrix
from batchfix.data.prepare import PreparedData, in_order
from batchfix.nn.attention import fused_attention
from batchfix.nn.network import negative_binomial_log_likelihood
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)

MIN_CELLS = 3  # a gene detected in fewer cells of the training file is not corrected
MAX_STEPS = 600  # optimizer steps of the extra decoder's fit at most (the latents are fixed: a small problem)
BATCH_SIZE = 256
LEARNING_RATE = 1e-2
# Early stopping: the fit holds out a share of its cells and keeps the decoder of the lowest held-out NB loss,
# checked every CHECK_EVERY steps, stopping after PATIENCE checks without a lower one. Measured on the bundled
# data (1,021 cells): a fixed 600 steps overfits (held-out loss 13,135 per cell against 12,754 at 150 steps).
HELD_OUT_SHARE, MAX_HELD_OUT_CELLS = 0.1, 2000
CHECK_EVERY, PATIENCE = 25, 4


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


def held_out_split(n_cells: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(fitting rows, held-out rows) of n_cells: HELD_OUT_SHARE of them held out (none below 20 cells)."""
    order = torch.randperm(n_cells, generator=generator)
    n_held = min(int(n_cells * HELD_OUT_SHARE), MAX_HELD_OUT_CELLS) if n_cells >= 20 else 0
    return order[n_held:], order[:n_held]


class SparseCounts:
    """The fitting cells' extra-gene counts, kept sparse (tens of thousands of cells x genes would not fit dense):
    `matrix` (cells, extra genes) CSR float32 and `library` (cells, 1) each cell's sum."""

    def __init__(self, matrix):
        self.matrix = sp.csr_matrix(matrix, dtype=np.float32)
        self.library = torch.from_numpy(np.asarray(self.matrix.sum(axis=1), dtype=np.float32))

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), extra genes) dense counts of the cells at `rows`."""
        return torch.from_numpy(self.matrix[rows.numpy()].toarray())


def nb_loss(decoder, latents: torch.Tensor, codes: torch.Tensor, counts_dense: torch.Tensor,
            library: torch.Tensor) -> torch.Tensor:
    """Mean NB negative log-likelihood per cell of the decoder's means at each cell's extra-gene library."""
    mean = F.softmax(decoder(latents, codes).float(), dim=-1) * library  # (cells, extra genes)
    return -negative_binomial_log_likelihood(counts_dense, mean, decoder.log_theta).mean()


def fit_decoder(net, latents: torch.Tensor, codes: torch.Tensor, extra_counts: SparseCounts,
                seed: int) -> tuple[float, int]:
    """Fit net.extra_decoder on (latent, batch) -> counts (cells, extra genes), stopped early on held-out cells;
    returns the kept decoder's held-out loss per cell (its last training loss where no cell is held out) and the
    steps taken."""
    generator = torch.Generator().manual_seed(seed)
    decoder = net.extra_decoder
    optimizer = torch.optim.Adam(decoder.parameters(), lr=LEARNING_RATE)
    library = extra_counts.library
    fitting, held = held_out_split(len(latents), generator)
    held_counts = extra_counts.rows(held)
    best, best_state, checks_since_best = float("inf"), None, 0
    loss, step = torch.zeros(()), 0
    with torch.enable_grad():
        for step in range(1, MAX_STEPS + 1):
            decoder.train()
            rows = fitting[torch.randint(len(fitting), (min(BATCH_SIZE, len(fitting)),), generator=generator)]
            loss = nb_loss(decoder, latents[rows], codes[rows], extra_counts.rows(rows), library[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if len(held) == 0 or step % CHECK_EVERY:
                continue
            decoder.eval()
            with torch.no_grad():
                held_loss = float(nb_loss(decoder, latents[held], codes[held], held_counts, library[held]))
            if held_loss < best:
                best, checks_since_best = held_loss, 0
                best_state = {name: value.clone() for name, value in decoder.state_dict().items()}
            else:
                checks_since_best += 1
                if checks_since_best >= PATIENCE:
                    break
    decoder.eval()
    if best_state is None:
        return float(loss.detach()), step
    decoder.load_state_dict(best_state)
    return best, step


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
