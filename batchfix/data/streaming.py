"""Training data that stays on disk: an .h5ad scanned in row chunks instead of read whole.

`prepare_streamed` gives the same `PreparedData` as `batchfix.data.prepare.prepare` on a file read into
memory, without the matrix (its `disk` says where the cells are), in two passes over the file:

1. every gene: the values checked (as `batchfix.data.io` does), empty cells and genes counted, and a
   subsample of at most `data.hvg_max_cells` cells, stratified by batch, kept in memory;
2. HVGs ranked on that subsample with the in-memory code (`batchfix.data.select`: scanpy's seurat_v3),
   genes placed and put in genomic order;
3. the modelled genes only: the encoder's standardisation statistics over every cell (exact).

HVGs come from a subsample rather than a streaming pass because scanpy's batch-aware seurat_v3 (a
loess per batch, clipped variances, rank merging) would have to be re-implemented to run on chunks,
and the top-ranked genes are already stable on tens of thousands of cells; a file with no more cells
than `data.hvg_max_cells` gets exactly the genes of the in-memory route. Memory is bounded by the
pass chunk (`data.chunk_cells`, or fewer cells for wide files) and the subsample, never by the file.
"""
from __future__ import annotations

import logging
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

try:  # anndata >= 0.11
    from anndata.io import read_elem
except ImportError:  # pragma: no cover - older anndata
    from anndata.experimental import read_elem

from batchfix import signals
from batchfix.config import DataConfig
from batchfix.data import ondisk
from batchfix.data.io import (
    check_batches,
    check_h5ad_path,
    check_values,
    duplicate_genes_error,
    missing_obs_column,
    obs_strings,
    repeated,
)
from batchfix.data.normalize import log_cp10k
from batchfix.data.prepare import DiskCells, PreparedData, model_genes, standardization
from batchfix.data.select import highly_variable_genes
from batchfix.data.subsample import stratified_rows
from batchfix.errors import InputError

log = logging.getLogger(__name__)

PASS_VALUES = 1 << 24  # a pass reads at most this many matrix entries (rows x genes) at a time


def stored_matrix_bytes(path: str, counts_layer: str | None) -> int | None:
    """Uncompressed size of the counts matrix as stored, or None when the file cannot be streamed."""
    try:
        with ondisk.open_anndata(path) as f:
            elem = ondisk.matrix_element(f, counts_layer, "data.counts_layer")
            parts = [elem] if isinstance(elem, h5py.Dataset) else [elem[k] for k in ("data", "indices") if k in elem]
            return int(sum(part.size * part.dtype.itemsize for part in parts))
    except (OSError, InputError, KeyError):
        return None  # the in-memory route reports what is wrong with the file


def use_streaming(data: DataConfig, path: str) -> bool:
    """data.stream, with auto deciding by the size of the counts matrix against data.stream_above_gb."""
    if data.stream != "auto":
        return data.stream == "true"
    size = stored_matrix_bytes(path, data.counts_layer)
    if size is None or size <= data.stream_above_gb * 1e9:
        return False
    log.info("The counts matrix holds %.1f GB uncompressed (> data.stream_above_gb=%g): training streams it "
             "from disk.", size / 1e9, data.stream_above_gb)
    return True


def required_obs_column(f: h5py.File, key: str, what: str, option: str, hint: str = "") -> np.ndarray:
    """One obs column as strings, without reading the others; a missing one is an error naming those there are."""
    values = ondisk.read_obs_column(f, key)
    if values is None:
        raise missing_obs_column(key, ondisk.obs_columns(f), what, option, hint)
    return obs_strings(values, key)


def read_var(f: h5py.File) -> pd.DataFrame:
    var = read_elem(f["var"])
    var.index = var.index.astype(str)
    genes = repeated(var.index)
    if genes:
        raise duplicate_genes_error(genes, "var_names")
    return var


def pass_rows(n_rows: int, n_vars: int, chunk_cells: int) -> list[tuple[int, int]]:
    """Row ranges of a pass: at most chunk_cells rows and PASS_VALUES entries each."""
    step = max(1, min(chunk_cells, PASS_VALUES // max(n_vars, 1)))
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def as_csr(chunk) -> sp.csr_matrix:
    """A chunk of rows as float32 CSR without explicit zeros (they do not make a cell or gene non-empty)."""
    chunk = sp.csr_matrix(chunk, dtype=np.float32)
    chunk.eliminate_zeros()
    return chunk


class Scan:
    """Pass 1: values checked, non-empty cells and genes, and the rows of the HVG subsample."""

    def __init__(self, reader, scale: str, sample: np.ndarray | None, chunk_cells: int):
        n_rows, n_vars = reader.shape
        self.cell_values = np.zeros(n_rows, dtype=np.int64)
        self.gene_values = np.zeros(n_vars, dtype=np.int64)
        sampled = []
        for start, stop in pass_rows(n_rows, n_vars, chunk_cells):
            signals.raise_pending()
            chunk = as_csr(reader.rows(start, stop))
            check_values(chunk.data, scale)
            self.cell_values[start:stop] = np.diff(chunk.indptr)
            self.gene_values += np.bincount(chunk.indices, minlength=n_vars)
            if sample is not None:
                sampled.append(chunk[sample[(sample >= start) & (sample < stop)] - start])
        self.sample = sample
        self.sample_counts = sp.vstack(sampled, format="csr") if sampled else None

    @property
    def cells(self) -> np.ndarray:
        return self.cell_values > 0

    @property
    def genes(self) -> np.ndarray:
        return self.gene_values > 0


def selected_genes(scan: Scan, batch: np.ndarray, data: DataConfig, scale: str) -> np.ndarray:
    """Positions among the non-empty genes of the HVGs, ranked on the subsample's non-empty cells."""
    n_genes = int(scan.genes.sum())
    if scan.sample_counts is None:
        return np.arange(n_genes)
    keep = scan.cells[scan.sample]
    counts = scan.sample_counts[keep][:, np.flatnonzero(scan.genes)]
    log.info("Ranking highly variable genes on %d of %d cells (data.hvg_max_cells, stratified by batch).",
             counts.shape[0], int(scan.cells.sum()))
    return np.flatnonzero(highly_variable_genes(counts, batch[scan.sample][keep], data.n_top_genes, scale))


def gene_statistics(reader, rows: np.ndarray, columns: np.ndarray, scale: str,
                    chunk_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Pass 2: the encoder's standardisation statistics of the modelled genes over the cells `rows`."""
    total, total_sq = np.zeros(len(columns)), np.zeros(len(columns))
    n_rows, n_vars = reader.shape
    for start, stop in pass_rows(n_rows, n_vars, chunk_cells):
        signals.raise_pending()
        inside = rows[(rows >= start) & (rows < stop)]
        chunk = sp.csr_matrix(reader.take(inside), dtype=np.float32)[:, columns]
        values = log_cp10k(chunk) if scale == "counts" else chunk  # what BatchfixNet.log_expression sees
        total += np.asarray(values.sum(axis=0, dtype=np.float64)).ravel()
        total_sq += np.asarray(values.multiply(values).sum(axis=0, dtype=np.float64)).ravel()
    return standardization(total / len(rows), total_sq / len(rows))


def prepare_streamed(path: str, data: DataConfig) -> PreparedData:
    """The PreparedData of an .h5ad file left on disk (see the module docstring)."""
    source = check_h5ad_path(path)
    with ondisk.open_anndata(source) as f:
        elem = ondisk.matrix_element(f, data.counts_layer, "data.counts_layer")
        reader, element = ondisk.open_rows(elem), elem.name
        batch = required_obs_column(f, data.batch_key, "Batch", "data.batch_key")
        if data.label_key:
            required_obs_column(f, data.label_key, "Label", "data.label_key", "; data.label_key=null trains without labels")
        var = read_var(f)
        n_rows, n_vars = reader.shape
        ranks = data.n_top_genes is not None and data.n_top_genes < n_vars
        sample = stratified_rows([batch], data.hvg_max_cells) if ranks else None
        scan = Scan(reader, data.scale, sample, data.chunk_cells)
        if not scan.cells.any() or not scan.genes.any():
            raise InputError(f"{source} has no non-empty cells or genes ({n_rows} x {n_vars}).")
        log_dropped(scan)
        check_batches(batch, scan.cells, data.batch_key)
        kept_genes = np.flatnonzero(scan.genes)
        columns, coordinates = model_genes(var.iloc[kept_genes], selected_genes(scan, batch, data, data.scale), data)
        file_columns = kept_genes[columns]
        rows = np.flatnonzero(scan.cells)
        gene_mean, gene_std = gene_statistics(reader, rows, file_columns, data.scale, data.chunk_cells)
    categories = sorted(pd.unique(batch[rows]).tolist())
    return PreparedData(
        counts=None,
        batch_index=np.searchsorted(categories, batch[rows]).astype(np.int64),
        batch_categories=categories,
        genes=var.index[file_columns].tolist(),
        coordinates=coordinates,
        gene_mean=gene_mean,
        gene_std=gene_std,
        disk=DiskCells(str(Path(source)), element, rows, file_columns, data.chunk_cells),
    )


def log_dropped(scan: Scan) -> None:
    for what, kept in (("cells", scan.cells), ("genes", scan.genes)):
        if (~kept).any():
            log.info("Dropped %d empty %s (no non-zero values) of %d.", int((~kept).sum()), what, len(kept))
