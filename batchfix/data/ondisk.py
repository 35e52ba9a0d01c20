"""On-disk AnnData (.h5ad) pieces for streaming: read cells in row chunks, write a new file chunk by chunk.

Used by `batchfix.correction.writers.correct_file`, so that correcting a file needs memory for one chunk of
cells, never for the whole matrix:

- `open_rows` gives a row-chunk reader over X or a layer stored dense ('array') or as CSR
  ('csr_matrix'); a CSC matrix cannot be read by rows and is loaded whole (with a warning).
- `copy_file_except` copies every group and dataset of the input with h5py (storage settings such
  as compression kept, values byte for byte), leaving out the entries the correction replaces.
- `create_csr` / `create_array` make the new entries with anndata's on-disk encoding
  (encoding-type / encoding-version attributes), to be filled slice by slice.
- Outputs go through `batchfix.data.atomic.atomic_output`: a temporary path beside the target, moved into
  place only when the writing finished, so a failed run leaves neither a partial output nor a
  temporary file.
"""
from __future__ import annotations

import logging

import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

try:  # anndata >= 0.11
    from anndata.io import read_elem, write_elem
except ImportError:  # pragma: no cover - older anndata
    from anndata.experimental import read_elem, write_elem

from batchfix.data.io import check_sparse_indices, check_sparse_structure, missing_matrix
from batchfix.errors import InputError

log = logging.getLogger(__name__)

DICT_ENCODING = {"encoding-type": "dict", "encoding-version": "0.1.0"}
ARRAY_ENCODING = {"encoding-type": "array", "encoding-version": "0.2.0"}
CSR_ENCODING = {"encoding-type": "csr_matrix", "encoding-version": "0.1.0"}
CHUNK_BYTES = 4 << 20  # HDF5 chunk size of the datasets written here
# A corrected layer is written with gzip (level 1) after a byte shuffle: its column indices repeat the same
# pattern on every row (~100x smaller), and its values shrink too: on the bundled file the counts layer's
# 23.4 MB of float32 to 4.3 MB and the log layer's to 10.6 MB, for about half a second of writing. The fastest and
# smallest gzip setting of those measured; gzip is the codec every HDF5 reader opens (docs/lab/scale.md).
LAYER_COMPRESSION = {"compression": "gzip", "compression_opts": 1, "shuffle": True}


def encoding_type(elem) -> str | None:
    value = elem.attrs.get("encoding-type")
    return value.decode() if isinstance(value, bytes) else value


def check_anndata_file(f: h5py.File, path) -> None:
    """Refuse HDF5 files that are not AnnData files in the current (anndata >= 0.8) on-disk format."""
    if encoding_type(f) != "anndata":
        if "X" in f or "obs" in f:
            raise InputError(
                f"{path} was written by an old anndata version (no encoding attributes). Re-save it once with "
                "anndata >= 0.8: anndata.read_h5ad(path).write_h5ad(new_path)."
            )
        raise InputError(f"{path} is an HDF5 file but not an AnnData .h5ad file (keys: {list(f.keys())}).")
    for key in ("obs", "var"):
        if key not in f:
            raise InputError(f"{path} has no '{key}' group; it is not a complete AnnData file.")


def open_anndata(path) -> h5py.File:
    """Open an .h5ad file read-only, refusing one that is not HDF5 or not an AnnData file (InputError)."""
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise InputError(f"Cannot open {path} as HDF5: {err}") from err
    try:
        check_anndata_file(f, path)
    except BaseException:
        f.close()
        raise
    return f


def read_var_names(f: h5py.File) -> pd.Index:
    """var_names of an open .h5ad file (only var's index is read)."""
    return read_index(f, "var")


def read_obs_names(f: h5py.File) -> pd.Index:
    """obs_names of an open .h5ad file (only obs's index is read)."""
    return read_index(f, "obs")


def read_index(f: h5py.File, group: str) -> pd.Index:
    frame = f[group]
    index_key = frame.attrs.get("_index", "_index")
    index_key = index_key.decode() if isinstance(index_key, bytes) else index_key
    return pd.Index(read_elem(frame[index_key]), dtype=object).astype(str)


def obs_columns(f: h5py.File) -> list[str]:
    """Names of the obs columns of an open .h5ad file."""
    order = f["obs"].attrs.get("column-order", [])
    return [c.decode() if isinstance(c, bytes) else str(c) for c in np.atleast_1d(order)]


def read_obs_column(f: h5py.File, key: str) -> pd.Series | None:
    """One obs column of an open .h5ad file (only that column is read), or None when there is none."""
    if key not in obs_columns(f) or key not in f["obs"]:
        return None
    return pd.Series(read_elem(f["obs"][key]))


def n_obs_of(f: h5py.File) -> int:
    obs = f["obs"]
    index_key = obs.attrs.get("_index", "_index")
    index_key = index_key.decode() if isinstance(index_key, bytes) else index_key
    return int(obs[index_key].shape[0])


def matrix_element(f: h5py.File, layer: str | None, option: str = "counts_layer"):
    """The h5py object of X or of layers/<layer>, with errors naming what exists."""
    layers = list(f["layers"].keys()) if "layers" in f else []
    if (layer is None and "X" not in f) or (layer is not None and layer not in layers):
        raise missing_matrix(layer, layers, option)
    return f["X"] if layer is None else f["layers"][layer]


class DenseRows:
    """Row chunks of a dense on-disk matrix. The dataset is opened for each read and let go after it: an open
    handle with a filled chunk cache makes HDF5 recompress the dataset when the file is copied (4.5 s for the
    bundled 47 MB gzip X against 0.004 s without)."""

    def __init__(self, dataset: h5py.Dataset):
        if dataset.ndim != 2:
            raise InputError(f"{dataset.name} is not a 2-d matrix (shape {dataset.shape}).")
        self.file, self.name, self.dtype = dataset.file, dataset.name, dataset.dtype
        self.shape = tuple(int(n) for n in dataset.shape)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.file[self.name][start:stop]

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The rows `rows` (ascending), one read per run of consecutive rows."""
        dataset = self.file[self.name]
        parts = [dataset[rows[a]:rows[b] + 1] for a, b in run_bounds(rows)]
        return np.concatenate(parts) if parts else np.empty((0, self.shape[1]), dtype=self.dtype)


def run_bounds(rows: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) positions in `rows` (ascending) of each run of consecutive rows."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return list(zip(np.r_[0, breaks].tolist(), np.r_[breaks - 1, len(rows) - 1].tolist()))


class CSRRows:
    """Row chunks of an on-disk CSR matrix: only the chunk's slice of data/indices is read."""

    def __init__(self, group: h5py.Group):
        self.group = group
        self.shape = tuple(int(n) for n in group.attrs["shape"])
        self.data, self.indices, self.indptr = group["data"], group["indices"], group["indptr"]
        self._offsets = self.indptr[:].astype(np.int64)  # the whole indptr: one pointer per row
        self.where = f"The matrix {group.name} of {group.file.filename}"
        check_sparse_structure(self._offsets, len(self.indices), self.shape[0], self.where)

    def matrix(self, data, indices, indptr, n_rows: int) -> sp.csr_matrix:
        """A chunk's CSR matrix, its column indices checked."""
        check_sparse_indices(indices, self.shape[1], self.where)
        return sp.csr_matrix((data, indices, indptr), shape=(n_rows, self.shape[1]))

    def rows(self, start: int, stop: int) -> sp.csr_matrix:
        indptr = self._offsets[start:stop + 1]
        first, last = int(indptr[0]), int(indptr[-1])
        return self.matrix(self.data[first:last], self.indices[first:last], indptr - first, stop - start)

    def take(self, rows: np.ndarray) -> sp.csr_matrix:
        """The rows `rows` (ascending): one read of data and of indices per run of consecutive rows."""
        starts, stops = self._offsets[rows], self._offsets[rows + 1]
        spans = [(starts[a], stops[b]) for a, b in run_bounds(rows)]
        data = [self.data[a:b] for a, b in spans if b > a]
        indices = [self.indices[a:b] for a, b in spans if b > a]
        indptr = np.concatenate([[0], np.cumsum(stops - starts)])
        return self.matrix(np.concatenate(data) if data else np.empty(0, self.data.dtype),
                           np.concatenate(indices) if indices else np.empty(0, self.indices.dtype), indptr, len(rows))


class InMemoryRows:
    """Row chunks of an in-memory matrix (numpy, scipy sparse, or anything anndata holds)."""

    def __init__(self, matrix):
        self.matrix = sp.csr_matrix(matrix) if sp.issparse(matrix) and matrix.format != "csr" else matrix
        self.shape = tuple(int(n) for n in matrix.shape)

    def rows(self, start: int, stop: int):
        stop = min(stop, self.shape[0])
        if sp.issparse(self.matrix):  # scipy's row slicing checks every entry's column: ~40x slower than this copy
            indptr = self.matrix.indptr[start:stop + 1]
            first, last = int(indptr[0]), int(indptr[-1])
            return sp.csr_matrix((self.matrix.data[first:last].copy(), self.matrix.indices[first:last].copy(),
                                  indptr - first), shape=(stop - start, self.shape[1]))
        return np.asarray(self.matrix[start:stop])

    def take(self, rows: np.ndarray):
        chunk = self.matrix[rows]
        return chunk if sp.issparse(chunk) else np.asarray(chunk)


def open_rows(elem) -> DenseRows | CSRRows | InMemoryRows:
    """A row-chunk reader over an on-disk matrix element."""
    kind = encoding_type(elem)
    if isinstance(elem, h5py.Dataset):
        return DenseRows(elem)
    if kind == "csr_matrix":
        return CSRRows(elem)
    if kind == "csc_matrix":
        log.warning("%s is stored as CSC, which cannot be read by rows: it is loaded whole into memory. "
                    "For large files store the counts as CSR (adata.X = adata.X.tocsr()).", elem.name)
        return InMemoryRows(read_elem(elem).tocsr())
    raise InputError(f"{elem.name} has encoding '{kind}'; expected a dense array or a CSR/CSC sparse matrix.")


def copy_attrs(source, target) -> None:
    for key, value in source.attrs.items():
        target.attrs[key] = value


def copy_file_except(src: h5py.File, dst: h5py.File, skip: dict[str, set[str]], top_skip: set[str]) -> None:
    """Copy all of `src` into `dst` (root attributes included), except the top-level keys in `top_skip`
    and, inside the top-level groups named in `skip`, the listed members (those groups are created
    with their attributes even when the input lacks them)."""
    copy_attrs(src, dst)
    for key in src.keys():
        if key in top_skip:
            continue
        if key in skip:
            group = dst.create_group(key)
            copy_attrs(src[key], group)
            for member in src[key].keys():
                if member not in skip[key]:
                    src.copy(src[key][member], group, name=member)
        else:
            src.copy(src[key], dst, name=key)
    for key in skip:
        if key not in dst:
            group = dst.create_group(key)
            group.attrs.update(DICT_ENCODING)


def _chunks(n: int, itemsize: int, row: int = 1) -> tuple[int, ...] | None:
    """A chunk shape of about CHUNK_BYTES for a (n,) or (n, row) dataset; None when empty."""
    if n == 0:
        return None
    rows = max(1, min(n, CHUNK_BYTES // (itemsize * row)))
    return (rows,) if row == 1 else (rows, row)


def create_array(group: h5py.Group, name: str, shape: tuple[int, int], dtype=np.float32) -> h5py.Dataset:
    """An empty dense (obsm-style) array with anndata's 'array' encoding, filled later by row slices."""
    itemsize = np.dtype(dtype).itemsize
    dataset = group.create_dataset(name, shape=shape, dtype=dtype,
                                   chunks=_chunks(shape[0], itemsize, shape[1]) if shape[1] else None)
    dataset.attrs.update(ARRAY_ENCODING)
    return dataset


def index_dtype(nnz: int, n_vars: int):
    """int32 CSR indices while they fit, else int64 (what anndata/scipy accept)."""
    return np.int32 if max(nnz, n_vars) < np.iinfo(np.int32).max else np.int64


def create_csr(group: h5py.Group, name: str, shape: tuple[int, int], nnz: int,
               dtype=np.float32) -> tuple[h5py.Dataset, h5py.Dataset, h5py.Dataset]:
    """An empty CSR matrix with anndata's 'csr_matrix' encoding: (data, indices, indptr) to fill.

    indptr is int32 while the number of stored values allows it (as scipy and anndata do), else int64.
    """
    csr = group.create_group(name)
    csr.attrs.update(CSR_ENCODING)
    csr.attrs["shape"] = np.array(shape, dtype=np.int64)
    position_dtype = index_dtype(nnz, shape[1])
    compression = LAYER_COMPRESSION if nnz else {}
    data = csr.create_dataset("data", shape=(nnz,), dtype=dtype, chunks=_chunks(nnz, np.dtype(dtype).itemsize),
                              **compression)
    indices = csr.create_dataset("indices", shape=(nnz,), dtype=position_dtype,
                                 chunks=_chunks(nnz, np.dtype(position_dtype).itemsize), **compression)
    indptr = csr.create_dataset("indptr", shape=(shape[0] + 1,), dtype=position_dtype,
                                chunks=_chunks(shape[0] + 1, np.dtype(position_dtype).itemsize))
    return data, indices, indptr


def read_var_frame(f: h5py.File) -> pd.DataFrame:
    """var of an open .h5ad file, as a DataFrame."""
    return read_elem(f["var"])


def replace_var_columns(src: h5py.File, dst: h5py.File, columns: dict[str, np.ndarray],
                        defaults: dict[str, np.ndarray] | None = None) -> None:
    """Write the input's var into `dst` with `columns` added (or replaced), and `defaults` added where var has no
    column of that name."""
    var = read_elem(src["var"])
    for column, values in columns.items():
        var[column] = values
    for column, values in (defaults or {}).items():
        if column not in var.columns:
            var[column] = values
    write_elem(dst, "var", var)


def write_uns_entry(dst: h5py.File, key: str, value: dict, compressed: tuple[str, ...] = ()) -> None:
    """uns[key] of an open .h5ad; its entries named in `compressed` (dicts of arrays: the model checks, 2.7 MB
    uncompressed on the bundled data) compressed as the layers are."""
    if key in dst["uns"]:
        del dst["uns"][key]
    write_elem(dst["uns"], key, {name: item for name, item in value.items() if name not in compressed})
    for name in compressed:
        if name in value:
            write_elem(dst["uns"][key], name, value[name], dataset_kwargs=LAYER_COMPRESSION)


def placed_columns(rows, columns: np.ndarray, places: np.ndarray, width: int) -> np.ndarray:
    """(cells, width) float32: the input `rows`' (sparse or dense) `columns` at `places` of a matrix of zeros (a
    model's gene order; its other places stay 0). Sparse rows are placed entry by entry: for 4,096 cells x 9,533
    genes in a shuffled order 0.27 s where a dense copy in the input's order, then placed, took 1.37 s (in the
    input's own order both take 0.14 s)."""
    picked = rows[:, columns]
    if not sp.issparse(picked):
        values = np.zeros((picked.shape[0], width), dtype=np.float32)
        values[:, places] = np.asarray(picked)
        return values
    picked = sp.csr_matrix(picked)
    placed = sp.csr_matrix((picked.data, places[picked.indices], picked.indptr), shape=(picked.shape[0], width))
    return placed.toarray().astype(np.float32, copy=False)
