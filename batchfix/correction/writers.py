"""Writers: an AnnData in memory (`correct_adata`, the notebook API) or an .h5ad streamed to a new file
(`correct_file`, the CLI and `train`'s corrected.h5ad), from one core (bind the model to the input, estimate from all
cells, apply chunk by chunk: batchfix.correction.corrector, estimates, outputs), so they give the same numbers.

What is added (key = key_added, default 'batchfix'; uns[key]['layers'] says what each layer holds):

- The NB model's counterfactual output (the default): layers[f'{key}_counts'], corrected counts of the full
  width (the modelled genes' counts moved to the reference's distribution, batchfix.correction.counts; every other
  gene's count as in the input), and layers[key], normalize_total over all genes + log1p of those counts, both CSR.
- The denoised output, and the counterfactual output of a log-scale model: layers[key] only, values in the
  modelled genes' columns (every modelled gene in every cell; other genes hold no entries).
- var[f'{key}_modelled'] (the genes the model reads) and var[f'{key}_corrected'] (the genes whose values the
  correction changed), var['highly_variable'] (the modelled genes) where the input has none, and the genes'
  coordinates as infercnvpy reads them (var['chromosome'] as 'chr1'..., 'start', 'end') unless var has them so,
  obsm[f'X_{key}'] (the latent, float32) and uns[key] (provenance: batchfix.correction.provenance).

The streamed writer reads the input a chunk of cells at a time (X or a layer, dense or CSR) and writes the new
entries chunk by chunk into a copy of the input's other groups, so memory stays bounded by the chunk size. The
input is opened read-only and never modified; the output appears (atomically) only once complete.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from batchfix.config import ResolvedCorrection
from batchfix.correction.corrector import BoundModel
from batchfix.correction.estimates import estimate
from batchfix.correction.lacking_genes import sex_linked_sets
from batchfix.correction.outputs import (
    ChunkOutput,
    OutputKind,
    Tallies,
    check_empty_cells,
    corrected_chunks,
    output_kind,
)
from batchfix.correction.provenance import for_hdf5, layer_entries, provenance
from batchfix.data import ondisk
from batchfix.data.atomic import atomic_output, refuse_existing
from batchfix.data.chunk_writer import ChunkedAppender
from batchfix.data.genome import infercnv_columns
from batchfix.data.io import OutputKeys, batch_level_columns, check_h5ad_path, select_matrix
from batchfix.errors import InputError
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)


def layer_names(keys: OutputKeys) -> dict[str, str]:
    """layers[...] key of each kind of layer the corrector makes."""
    return {"log": keys.layer, "counts": keys.counts}


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


def normal_cells(values: pd.Series | None, settings: ResolvedCorrection, columns: list[str]) -> np.ndarray | None:
    """(cells,) bool: the reference cells named by correction.normal_key / normal_values, None when unset; an
    error naming the obs columns, or the column's values, when none is found."""
    key, wanted = settings.normal_key, [str(v) for v in settings.normal_values]
    if key is None:
        return None
    if values is None:
        raise InputError(f"correction.normal_key={key!r}: obs has no such column. Columns present: {columns}.")
    labels = values.astype(str).to_numpy()
    normal = np.isin(labels, wanted)
    if not normal.any():
        present = sorted(pd.unique(labels))
        raise InputError(f"correction.normal_values={wanted}: no cell of obs column '{key}' has one of them. Its "
                         f"values: {present[:20]}{' ...' if len(present) > 20 else ''}.")
    found = set(labels[normal])
    unmatched = [value for value in wanted if value not in found]
    if unmatched:
        present = sorted(pd.unique(labels))
        log.warning("correction.normal_values %s match no cell of obs column '%s' (a typo?); the reference cells are "
                    "those of %s. Its values: %s%s.", unmatched, key, [v for v in wanted if v in found],
                    present[:20], " ..." if len(present) > 20 else "")
    return normal


def prepared_output(adata: ad.AnnData, trained: BatchfixModel, settings: ResolvedCorrection,
                    counts_layer: str | None, batch_key: str | None,
                    all_batches_new: bool = False) -> tuple[OutputKind, ondisk.InMemoryRows]:
    """The output kind of a model bound to an in-memory AnnData's genes and cells, with the estimates of all its
    cells, and its rows."""
    batch_key, counts_layer = data_keys(trained, batch_key, counts_layer)
    matrix = select_matrix(adata, counts_layer, option="counts_layer")
    batch = None
    if settings.output_mode == "counterfactual":
        batch = cell_batches(adata.obs[batch_key] if batch_key in adata.obs else None, batch_key,
                             list(map(str, adata.obs.columns)), trained.batch_categories, all_batches_new)
        batch_level_columns(adata.obs.items(), batch, batch_key)
    normal = normal_cells(adata.obs[settings.normal_key] if settings.normal_key in adata.obs else None, settings,
                          list(map(str, adata.obs.columns)))
    bound = BoundModel(trained, adata.var_names, settings, counts_layer, batch, batch_key,
                       adata.obs_names, normal, sex_linked_columns(adata.var, trained, settings))
    rows = ondisk.InMemoryRows(matrix)
    return output_kind(bound, *estimate(bound, rows, adata.n_obs)), rows


def correct_adata(adata: ad.AnnData, trained: BatchfixModel, settings: ResolvedCorrection,
                  counts_layer: str | None = None, batch_key: str | None = None, copy: bool = False,
                  progress: bool = False, all_batches_new: bool = False) -> ad.AnnData | None:
    """Add corrected expression to an in-memory AnnData, scanpy style (what is added: this module's docstring).

    obs[batch_key] is read for output_mode=counterfactual; batch_key and counts_layer default to the model's
    (`data_keys`). `adata` is left unchanged when an error is raised. Returns the corrected copy when copy=True,
    else None.
    """
    output, rows = prepared_output(adata, trained, settings, counts_layer, batch_key, all_batches_new)
    bound, n_obs, tallies = output.bound, adata.n_obs, Tallies()
    latent = np.empty((n_obs, bound.latent_dim), dtype=np.float32)
    pieces: dict[str, list] = {}
    for start, stop, chunk in corrected_chunks(output, rows, n_obs, settings.chunk_size, progress):
        latent[start:stop] = chunk.latent
        tallies += chunk.tallies
        for kind, matrix_rows in chunk.layers.items():
            pieces.setdefault(kind, []).append(matrix_rows)
    check_empty_cells(bound, tallies, n_obs)
    info = provenance(bound, output.estimates, tallies)

    keys = OutputKeys(settings.key_added)
    adata = adata.copy() if copy else adata
    for kind, parts in pieces.items():
        adata.layers[layer_names(keys)[kind]] = sp.vstack(parts, format="csr")
    adata.obsm[keys.latent] = latent
    adata.var[keys.modelled] = bound.modelled_mask
    adata.var[keys.corrected] = bound.corrected_mask
    if "highly_variable" not in adata.var.columns:  # scanpy's HVG column, where the user has none: the modelled
        adata.var["highly_variable"] = bound.modelled_mask
    for column, values in (infercnv_columns(adata.var, trained.data_options["genome"]) or {}).items():
        adata.var[column] = values  # coordinates as infercnvpy reads them ('chr1', start, end)
    adata.uns[keys.uns] = info
    bound.clock.log(f"{n_obs} cells in memory")
    return adata if copy else None


def open_input(input_path: str | Path, output_path: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """(input, output) paths, checked: the input an .h5ad, the output no folder, nothing else batchfix never replaces
    (the input, a device, a FIFO, ...: refuse_existing) nor (unless overwrite) an existing file."""
    source = check_h5ad_path(input_path)
    target = Path(output_path).expanduser()
    if target.is_dir():
        raise InputError(f"The output {target} is a folder; name an .h5ad file.")
    refuse_existing(target, overwrite, reads={"input": source})
    return source, target


class CsrAppender:
    """A CSR matrix in an open .h5ad (anndata's encoding), written a block of rows at a time; the number of
    stored values need not be known in advance. With a thread `pool`, gzip chunks are compressed on its
    `workers` while the caller goes on (batchfix.data.chunk_writer); `close()` once the last rows are in."""

    def __init__(self, group: h5py.Group, name: str, shape: tuple[int, int],
                 compression: dict = ondisk.LAYER_COMPRESSION, pool: Executor | None = None, workers: int = 1):
        csr = group.create_group(name)
        csr.attrs.update(ondisk.CSR_ENCODING)
        csr.attrs["shape"] = np.array(shape, dtype=np.int64)
        position = ondisk.index_dtype(shape[0] * shape[1], shape[1])
        block = max(1, ondisk.CHUNK_BYTES // 4)
        self.data = csr.create_dataset("data", shape=(0,), maxshape=(None,), dtype=np.float32, chunks=(block,),
                                       **compression)
        self.indices = csr.create_dataset("indices", shape=(0,), maxshape=(None,), dtype=position, chunks=(block,),
                                          **compression)
        self.indptr = csr.create_dataset("indptr", shape=(shape[0] + 1,), dtype=position)
        self.indptr[0] = 0
        self.n_rows = self.n_stored = 0
        parallel = pool is not None and compression.get("compression") == "gzip" and compression.get("shuffle")
        self.appenders = [ChunkedAppender(d, pool, workers) for d in (self.data, self.indices)] if parallel else []

    def append(self, rows: sp.csr_matrix) -> None:
        stop = self.n_stored + rows.nnz
        if self.appenders:
            for appender, values in zip(self.appenders, (rows.data, rows.indices)):
                appender.append(values)
        else:
            self.data.resize((stop,))
            self.indices.resize((stop,))
            self.data[self.n_stored:stop] = rows.data
            self.indices[self.n_stored:stop] = rows.indices
        self.indptr[self.n_rows + 1:self.n_rows + rows.shape[0] + 1] = self.n_stored + rows.indptr[1:]
        self.n_rows, self.n_stored = self.n_rows + rows.shape[0], stop

    def close(self) -> None:
        for appender in self.appenders:
            appender.close()


def correct_file(input_path: str | Path, output_path: str | Path, trained: BatchfixModel,
                 settings: ResolvedCorrection, counts_layer: str | None = None, batch_key: str | None = None,
                 overwrite: bool = False, progress: bool = True, all_batches_new: bool = False) -> Path:
    """Correct an .h5ad into a new .h5ad, streaming chunks of cells (memory bounded by chunk_size).

    The output is the input's content (X, layers, obs, var, obsm, obsp, varm, varp, uns, raw: copied
    with h5py, storage settings kept) plus what `correct_adata` adds, written into a temporary file
    beside `output_path` and renamed into place when complete. An existing output is refused
    unless overwrite=True. The input is opened read-only.
    """
    source, target = open_input(input_path, output_path, overwrite)
    with ondisk.open_anndata(source) as src:
        bound, rows, n_obs = bind_file(src, source, trained, settings, counts_layer, batch_key, all_batches_new)
        output = output_kind(bound, *estimate(bound, rows, n_obs))
        with atomic_output(target, overwrite) as tmp, h5py.File(tmp, "w") as dst:
            write_streamed(src, dst, output, rows, n_obs, progress)
    log_written(target, bound, n_obs)
    bound.clock.log(f"{n_obs} cells, one process")
    return target


def bind_file(src: h5py.File, source: Path, trained: BatchfixModel, settings: ResolvedCorrection,
              counts_layer: str | None, batch_key: str | None, all_batches_new: bool) -> tuple[BoundModel, object, int]:
    """(the model bound to an open input's genes and cells, a reader of its rows (X or counts_layer), its number
    of cells)."""
    batch_key, counts_layer = data_keys(trained, batch_key, counts_layer)
    var_names = ondisk.read_var_names(src)
    n_obs = ondisk.n_obs_of(src)
    rows = ondisk.open_rows(ondisk.matrix_element(src, counts_layer))
    if rows.shape != (n_obs, len(var_names)):
        raise InputError(f"{source}: the matrix is {rows.shape} but obs x var is {(n_obs, len(var_names))}.")
    batch = None
    if settings.output_mode == "counterfactual":
        batch = cell_batches(ondisk.read_obs_column(src, batch_key), batch_key, ondisk.obs_columns(src),
                             trained.batch_categories, all_batches_new)
        batch_level_columns(((c, ondisk.read_obs_column(src, c)) for c in ondisk.obs_columns(src) if c != batch_key),
                            batch, batch_key)
    normal = None if settings.normal_key is None else normal_cells(
        ondisk.read_obs_column(src, settings.normal_key), settings, ondisk.obs_columns(src))
    sex_linked = sex_linked_columns(ondisk.read_var_frame(src), trained, settings) if batch is not None else None
    bound = BoundModel(trained, var_names, settings, counts_layer, batch, batch_key,
                       ondisk.read_obs_names(src), normal, sex_linked)
    return bound, rows, n_obs


def sex_linked_columns(var: pd.DataFrame, trained: BatchfixModel, settings: ResolvedCorrection) -> list[np.ndarray]:
    """The input's sex-linked gene sets, where the genes a batch lacks are found (the counterfactual output with
    evidence weights, batchfix.correction.lacking_genes); else none."""
    if settings.output_mode != "counterfactual" or settings.shrink != "evidence":
        return []
    return sex_linked_sets(var, trained.data_options["genome"])


def log_written(target: Path, bound: BoundModel, n_obs: int) -> None:
    log.info("Wrote %s (%d cells; layers %s (%s) with %d corrected genes, %d missing; reference: %s).", target,
             n_obs, list(layer_entries(bound)), bound.settings.output_mode, int(bound.corrected_mask.sum()),
             len(bound.missing_genes), bound.reference_name)


def write_streamed(src: h5py.File, dst: h5py.File, output: OutputKind, rows, n_obs: int, progress: bool) -> None:
    """The input's content and the correction's new entries, chunk by chunk, into the open output."""
    chunks = corrected_chunks(output, rows, n_obs, output.bound.settings.chunk_size, progress)
    tallies = write_correction(src, dst, output.bound, n_obs, chunks)
    write_provenance(dst, output.bound, output.estimates, tallies, n_obs)


def write_correction(src: h5py.File, dst: h5py.File, bound: BoundModel, n_obs: int,
                     chunks: Iterable[tuple[int, int, ChunkOutput]], workers: int | None = None) -> Tallies:
    """The input's content, then the latents and layers of `chunks` (start, stop, outputs), which cover every cell
    once in row order, into the open output, the layers' chunks compressed on `workers` threads (default: torch's
    thread count) while the next cells are corrected; returns the chunks' tallies summed."""
    workers, clock = workers or torch.get_num_threads(), bound.clock
    keys = OutputKeys(bound.settings.key_added)
    names = layer_names(keys)
    with clock.stage("write"):
        ondisk.copy_file_except(src, dst, top_skip={"var"},
                                skip={"layers": set(names.values()), "obsm": {keys.latent}, "uns": {keys.uns}})
        coordinates = infercnv_columns(ondisk.read_var_frame(src), bound.trained.data_options["genome"]) or {}
        ondisk.replace_var_columns(src, dst, {keys.modelled: bound.modelled_mask,
                                              keys.corrected: bound.corrected_mask, **coordinates},
                                   defaults={"highly_variable": bound.modelled_mask})
        latent = ondisk.create_array(dst["obsm"], keys.latent, (n_obs, bound.latent_dim))
    tallies = Tallies()
    with ThreadPoolExecutor(workers, thread_name_prefix="batchfix-compress") as pool:
        writers = {kind: CsrAppender(dst["layers"], names[kind], (n_obs, bound.n_vars), pool=pool, workers=workers)
                   for kind in output_layers(bound)}
        for start, stop, chunk in chunks:
            tallies += chunk.tallies
            with clock.stage("write"):
                latent[start:stop] = chunk.latent
                for kind, matrix_rows in chunk.layers.items():
                    writers[kind].append(matrix_rows)
        with clock.stage("write"):
            for writer in writers.values():
                writer.close()
    return tallies


def output_layers(bound: BoundModel) -> list[str]:
    """The kinds of layer the bound model's output holds ('log', and 'counts' for the corrected counts)."""
    return [kind for kind in layer_names(OutputKeys(bound.settings.key_added)) if bound.counts_output or kind == "log"]


def write_provenance(dst: h5py.File, bound: BoundModel, estimates, tallies: Tallies, n_obs: int, **extra) -> None:
    """uns[key_added] of the open output (with `extra` entries), once every cell is written; an input of empty
    cells leaves no output."""
    check_empty_cells(bound, tallies, n_obs)
    info = {**provenance(bound, estimates, tallies), **extra}
    ondisk.write_uns_entry(dst, OutputKeys(bound.settings.key_added).uns, for_hdf5(info), compressed=("model_checks",))
