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

- layers[key]: corrected log1p(expression per 10k counts), float32 CSR of the data's full width
  (n_obs x n_vars, as anndata requires) that stores only the columns of the modelled genes:
  every modelled gene has a value in every cell, and genes the model did not model hold no
  entries (they read as 0). var[f'{key}_modelled'] marks the modelled genes; subset to them
  (adata[:, adata.var[f'{key}_modelled']]) before analysing the layer. Compared with a dense
  full-width layer this stores n_modelled instead of n_vars values per cell (2,000 instead of
  11,533 for the bundled data), and for an uncorrected value in an uncorrected gene there is no
  honest corrected number to store.
- obsm[f'X_{key}']: the latent (posterior mean), float32 (n_obs, latent_dim).
- uns[key]: provenance (package version, checkpoint path and sha256, reference batch, training
  batches, modelled and missing genes, correction and model parameters).

Modelled genes are matched to the input by var_names. Missing ones enter the model as zero counts
and are reported (log and uns[key]['missing_genes']); past `max_missing_fraction` the correction
stops with an error. The encoder does not see the batch, so cells of batches the model never saw
are corrected like any other.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

import batchfix
from batchfix import ondisk
from batchfix.config import CorrectionSettings
from batchfix.errors import InputError
from batchfix.io import OutputKeys, atomic_output, check_h5ad_path, check_values, output_exists, select_matrix
from batchfix.module import BatchfixModel

log = logging.getLogger(__name__)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def reference_index(trained: BatchfixModel, reference: str | None) -> int | None:
    """Decoder batch for correction: None = average over the training batches."""
    if reference in (None, "average"):
        return None
    if reference not in trained.batch_categories:
        raise InputError(f"Reference batch '{reference}' is not one the model was trained on: "
                         f"{trained.batch_categories} (or 'average').")
    return trained.batch_categories.index(reference)


def gene_columns(var_names: pd.Index, trained: BatchfixModel, max_missing_fraction: float) -> np.ndarray:
    """Column of each modelled gene in the file (-1 when missing), refusing past the allowed share."""
    var_names = pd.Index(var_names).astype(str)
    duplicated = var_names.duplicated()
    if duplicated.any():
        repeated = set(var_names[duplicated]) & set(trained.genes)
        if repeated:
            log.warning("%d modelled genes appear more than once in var_names (e.g. %s): the first column of "
                        "each is used.", len(repeated), sorted(repeated)[:3])
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
    """A trained model bound to one input's genes: row chunk of the input -> (latent, corrected values).

    Corrected values come in output order: one column per modelled gene present in the input,
    sorted by its column in the input (`out_columns`), ready to be the CSR indices of a row.
    """

    def __init__(self, trained: BatchfixModel, var_names: pd.Index, settings: CorrectionSettings,
                 source: str = "X"):
        self.trained = trained
        self.net = int8_network(trained.net) if settings.int8 else trained.net
        self.settings = settings
        self.batch_size = settings.batch_size
        self.reference = reference_index(trained, settings.reference)
        self.reference_name = "average" if self.reference is None else str(settings.reference)
        self.source = source
        self.n_vars = len(var_names)
        columns = gene_columns(var_names, trained, settings.max_missing_fraction)
        self.missing_genes = [g for g, c in zip(trained.genes, columns) if c < 0]
        self.in_model = np.flatnonzero(columns >= 0)  # model genes fed from the input ...
        self.in_columns = columns[self.in_model]  # ... and their input columns
        # One output column per input column (a gene listed twice in the model is written once).
        self.out_columns, first = np.unique(self.in_columns, return_index=True)
        self.out_model = self.in_model[first]
        self.modelled_mask = np.zeros(self.n_vars, dtype=bool)
        self.modelled_mask[self.out_columns] = True

    @property
    def n_out(self) -> int:
        return len(self.out_columns)

    @property
    def latent_dim(self) -> int:
        return int(self.trained.module.model_config.latent_dim)

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
        x = self.model_input(chunk, first_cell)
        latent = np.empty((x.shape[0], self.latent_dim), dtype=np.float32)
        values = np.empty((x.shape[0], self.n_out), dtype=np.float32)
        for start in range(0, x.shape[0], self.batch_size):
            stop = start + self.batch_size
            mu, expression = self.net.corrected(x[start:stop], self.reference)
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
            stop = min(start + chunk_size, n_obs)
            latent, values = corrector(rows.rows(start, stop), start)
            yield start, stop, latent, values
            bar.update(stop - start)
    seconds = time.perf_counter() - started
    log.info("Corrected %d cells x %d genes in %.1f s (%.0f cells/s).", n_obs, corrector.n_out, seconds,
             n_obs / max(seconds, 1e-9))


def provenance(corrector: Corrector) -> dict:
    """uns[key_added]: what produced the correction."""
    trained, settings = corrector.trained, corrector.settings
    keys = OutputKeys(settings.key_added)
    return {
        "version": batchfix.__version__,
        "checkpoint": str(trained.path.resolve()) if trained.path else "(in memory, not saved)",
        "checkpoint_sha256": file_sha256(trained.path) if trained.path else "",
        "reference_batch": corrector.reference_name,
        "training_batches": trained.batch_categories,
        "modelled_genes": trained.genes,
        "n_modelled_genes": len(trained.genes),
        "missing_genes": corrector.missing_genes,
        "n_missing_genes": len(corrector.missing_genes),
        "layer": f"layers['{keys.layer}']: corrected log1p(expression per 10k counts); only the genes marked in "
                 f"var['{keys.modelled}'] are stored, other genes read as 0",
        "params": {
            "counts": corrector.source,
            "scale": trained.scale,
            "chunk_size": settings.chunk_size,
            "batch_size": settings.batch_size,
            "max_missing_fraction": float(settings.max_missing_fraction),
            "int8": bool(settings.int8),
            "model": dict(trained.module.hparams["model"]),
        },
    }


def _for_hdf5(value):
    """uns values as anndata writes them back exactly (an empty list would come back as floats)."""
    if isinstance(value, dict):
        return {k: _for_hdf5(v) for k, v in value.items()}
    if isinstance(value, list):
        return np.array(value, dtype=object)
    return value


def source_name(counts_layer: str | None) -> str:
    return "X" if counts_layer is None else f"layers['{counts_layer}']"


def correct_adata(adata: ad.AnnData, trained: BatchfixModel, settings: CorrectionSettings,
                  counts_layer: str | None = None, copy: bool = False, progress: bool = False) -> ad.AnnData | None:
    """Add corrected expression to an in-memory AnnData, scanpy style.

    Adds layers[key_added] (CSR, corrected log1p expression per 10k; only modelled genes stored),
    var[f'{key_added}_modelled'], obsm[f'X_{key_added}'] (latent) and uns[key_added] (provenance).
    `adata` is left unchanged when an error is raised. Returns the corrected copy when copy=True,
    else None.
    """
    matrix = select_matrix(adata, counts_layer, option="counts_layer")
    corrector = Corrector(trained, adata.var_names, settings, source=source_name(counts_layer))
    n_obs, k = adata.n_obs, corrector.n_out
    latent = np.empty((n_obs, corrector.latent_dim), dtype=np.float32)
    data = np.empty(n_obs * k, dtype=np.float32)
    for start, stop, mu, values in corrected_chunks(corrector, ondisk.InMemoryRows(matrix), n_obs,
                                                    settings.chunk_size, progress):
        latent[start:stop] = mu
        data[start * k:stop * k] = values.ravel()
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


def correct_file(input_path: str | Path, output_path: str | Path, trained: BatchfixModel,
                 settings: CorrectionSettings, counts_layer: str | None = None, overwrite: bool = False,
                 progress: bool = True) -> Path:
    """Correct an .h5ad into a new .h5ad, streaming chunks of cells (memory bounded by chunk_size).

    The output is the input's content (X, layers, obs, var, obsm, obsp, varm, varp, uns, raw: copied
    with h5py, storage settings kept) plus what `correct_adata` adds, written into a temporary file
    beside `output_path` and renamed into place when complete. An existing output is refused
    unless overwrite=True. The input is opened read-only.
    """
    source = check_h5ad_path(input_path)
    target = Path(output_path).expanduser()
    if target.exists() and target.samefile(source):
        raise InputError(f"The output {target} is the input file; write the corrected file elsewhere.")
    if target.is_dir():
        raise InputError(f"The output {target} is a folder; name an .h5ad file.")
    if target.exists() and not overwrite:
        raise output_exists(target)
    keys = OutputKeys(settings.key_added)

    try:
        src = h5py.File(source, "r")
    except OSError as err:
        raise InputError(f"Cannot open {source} as HDF5: {err}") from err
    with src:
        ondisk.check_anndata_file(src, source)
        var_names = ondisk.read_var_names(src)
        n_obs = ondisk.n_obs_of(src)
        rows = ondisk.open_rows(ondisk.matrix_element(src, counts_layer))
        if rows.shape != (n_obs, len(var_names)):
            raise InputError(f"{source}: the matrix is {rows.shape} but obs x var is {(n_obs, len(var_names))}.")
        corrector = Corrector(trained, var_names, settings, source=source_name(counts_layer))
        info = provenance(corrector)
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
            ondisk.write_uns_entry(dst, keys.uns, _for_hdf5(info))
    log.info("Wrote %s (%d cells; layers['%s'] with %d modelled genes, %d missing; reference: %s).", target,
             n_obs, keys.layer, k, len(corrector.missing_genes), corrector.reference_name)
    return target
