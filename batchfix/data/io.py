"""Reading and validating AnnData files (atomic writes: atomic.py; streamed reads and writes: ondisk.py).

Reading validates the input and turns it into plain arrays (`ExpressionInput`); the input file is
never touched.
"""
from __future__ import annotations

import hashlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from batchfix.config import DataKeys
from batchfix.data.header import bundled_dataset, input_path, missing_matrix, missing_obs_column  # noqa: F401
from batchfix.errors import InputError

log = logging.getLogger(__name__)


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class OutputKeys:
    """Where a correction stored under `key_added` lives in an AnnData."""

    key_added: str

    @property
    def layer(self) -> str:
        """layers[...]: corrected log expression (normalize_total + log1p of the corrected counts)."""
        return self.key_added

    @property
    def counts(self) -> str:
        """layers[...]: corrected counts of every gene (the NB model's counterfactual output)."""
        return f"{self.key_added}_counts"

    @property
    def corrected(self) -> str:
        """var[...]: True for the genes whose values the correction changed."""
        return f"{self.key_added}_corrected"

    @property
    def latent(self) -> str:
        """obsm[...]: the batch-free latent."""
        return f"X_{self.key_added}"

    @property
    def modelled(self) -> str:
        """var[...]: True for the genes the model corrected."""
        return f"{self.key_added}_modelled"

    @property
    def uns(self) -> str:
        """uns[...]: provenance of the correction."""
        return self.key_added


@dataclass
class ExpressionInput:
    """Validated expression data, still in the file's own gene order.

    counts: (cells, genes) float32 CSR matrix (raw counts, or log-scale values for scale='log').
    """

    counts: sp.csr_matrix
    batch: np.ndarray  # (cells,) str
    obs_names: pd.Index
    var: pd.DataFrame  # index = gene names (var_names)
    scale: str  # "counts" or "log"
    path: str
    rows: np.ndarray | None = None  # (cells,) the file rows of these cells (empty cells are dropped)

    @property
    def batch_categories(self) -> list[str]:
        return sorted(pd.unique(self.batch).tolist())


def check_h5ad_path(path: str | os.PathLike) -> Path:
    """Return the path if it names a readable HDF5 (.h5ad) file, else raise InputError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"Input file not found: {p}")
    if p.is_dir():
        raise InputError(f"Input path is a folder, not an .h5ad file: {p}")
    try:
        with open(p, "rb") as fh:
            head = fh.read(8)
    except OSError as err:
        raise InputError(f"Cannot read input file {p}: {err.strerror or err}") from err
    if head != HDF5_SIGNATURE:
        raise InputError(
            f"{p} is not an .h5ad file (no HDF5 signature; got {len(head)} leading bytes "
            f"{head[:8]!r}). Convert it with anndata/scanpy first, e.g. sc.read_10x_h5 or "
            f"sc.read_csv followed by adata.write_h5ad."
        )
    return p


def read_h5ad(path: str | os.PathLike) -> ad.AnnData:
    """Read a whole .h5ad file into memory, with clear errors."""
    p = check_h5ad_path(path)
    try:
        with warnings.catch_warnings():  # repeated names are checked with a clearer message (check_names)
            warnings.filterwarnings("ignore", message=r".* names are not unique", category=UserWarning)
            return ad.read_h5ad(p)
    except Exception as err:  # anndata raises many kinds for corrupt files
        raise InputError(f"Cannot read {p} as AnnData: {type(err).__name__}: {err}") from err


def require_obs_column(adata: ad.AnnData, key: str, what: str, option: str, hint: str = "") -> np.ndarray:
    """Return obs[key] as strings, or raise an error listing the obs columns that exist."""
    if key not in adata.obs.columns:
        raise missing_obs_column(key, list(adata.obs.columns), what, option, hint)
    return obs_strings(adata.obs[key], key)


def warn_if_labels_follow_batches(labels: np.ndarray, batch: np.ndarray, label_key: str, batch_key: str) -> bool:
    """Warn (and return True) when each label lives in one batch (95 % of its cells or more): then the labels
    differ between batches, and what the correction removes as batch effect is their difference."""
    table = pd.crosstab(pd.Series(labels, name="label"), pd.Series(batch, name="batch"))
    if table.shape[0] < 2 or table.shape[1] < 2:
        return False
    if not (table.max(axis=1) >= 0.95 * table.sum(axis=1)).all():
        return False
    log.warning("The labels of obs['%s'] line up with the batches of obs['%s']: each lives in one batch. The "
                "correction removes what differs between batches, so their differences go with it; a condition you "
                "want to compare must never be the batch_key (docs/corrected-matrix.md).", label_key, batch_key)
    return True


def obs_strings(values: pd.Series, key: str) -> np.ndarray:
    """An obs column as strings; missing values are refused."""
    if values.isna().any():
        first = values.index[values.isna().to_numpy()][:3].tolist()
        raise InputError(f"obs column '{key}' has {int(values.isna().sum())} missing values (cells {first}): every "
                         f"cell needs one. Drop those cells (adata[adata.obs['{key}'].notna()]) or fill them in.")
    return values.astype(str).to_numpy()


def select_matrix(adata: ad.AnnData, layer: str | None, option: str = "data.counts_layer"):
    """Return X or the named layer, or raise an error listing the layers that exist."""
    matrix = adata.X if layer is None else adata.layers.get(layer)
    if matrix is None:
        raise missing_matrix(layer, list(adata.layers.keys()), option)
    return matrix


def check_sparse_structure(indptr: np.ndarray, n_stored: int, n_rows: int, where: str = "The expression matrix",
                           fmt: str = "csr") -> None:
    """Refuse a sparse matrix whose row pointers (indptr) cannot be: scipy would raise or crash on it."""
    indptr = np.asarray(indptr)
    if len(indptr) != n_rows + 1 or (len(indptr) and (indptr[0] != 0 or indptr[-1] != n_stored)) \
            or (np.diff(indptr) < 0).any():
        raise InputError(f"{where} is a corrupt {fmt.upper()} matrix: its indptr ({len(indptr)} pointers from "
                         f"{indptr[:1].tolist()} to {indptr[-1:].tolist()}) does not describe {n_rows} rows of "
                         f"{n_stored} stored values. Re-create the matrix and save the file again.")


def check_sparse_indices(indices: np.ndarray, n_columns: int, where: str = "The expression matrix") -> None:
    """Refuse column (or row) indices outside the matrix: scipy would read past its arrays or abort."""
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= n_columns):
        bad = int(indices.max()) if int(indices.max()) >= n_columns else int(indices.min())
        raise InputError(f"{where} is a corrupt sparse matrix: it stores an index {bad} outside 0..{n_columns - 1}. "
                         "Re-create the matrix and save the file again.")


def as_float32_csr(matrix) -> sp.csr_matrix:
    """Any in-memory matrix (dense, sparse, backed dataset) as a float32 CSR matrix."""
    dtype = getattr(matrix, "dtype", None)
    if dtype is None or not (np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_)) \
            or np.issubdtype(dtype, np.complexfloating):
        raise InputError(f"The expression matrix holds {dtype or type(matrix).__name__} values, not real numbers.")
    if sp.issparse(matrix) and matrix.format in ("csr", "csc"):
        major, minor = matrix.shape if matrix.format == "csr" else matrix.shape[::-1]
        check_sparse_structure(matrix.indptr, len(matrix.indices), major, fmt=matrix.format)
        check_sparse_indices(matrix.indices, minor)
    if dtype == np.float16:  # scipy.sparse holds no float16; float32 holds each float16 value exactly
        matrix = matrix.astype(np.float32)
    matrix = sp.csr_matrix(matrix) if sp.issparse(matrix) else sp.csr_matrix(np.asarray(matrix))
    with np.errstate(invalid="ignore"):
        too_large = int((np.abs(matrix.data) > np.finfo(np.float32).max).sum()) if matrix.nnz else 0
    if too_large and np.isfinite(matrix.data).all():
        raise InputError(f"The expression matrix holds {too_large} values beyond float32's range "
                         f"({np.finfo(np.float32).max:.2e}); these are not counts or log-expression values.")
    return matrix.astype(np.float32)


def count_bad_values(values: np.ndarray) -> tuple[int, int, int]:
    """(NaN or infinite, negative, non-integer) counts among `values`."""
    return (int((~np.isfinite(values)).sum()), int((values < 0).sum()),
            int((values != np.round(values)).sum()))


TRAINING_COUNTS_HINT = ("batchfix models counts by default: point data.counts_layer at a layer of raw counts, or "
                        "set data.scale=log for log-normalized input (Gaussian likelihood).")


def check_values(values: np.ndarray, scale: str, where: str = "The expression matrix",
                 hint: str = TRAINING_COUNTS_HINT) -> None:
    """Raise on NaN/inf values, and on non-count values when counts are needed."""
    n_bad, n_negative, n_fraction = count_bad_values(values)
    if n_bad:
        raise InputError(f"{where} holds {n_bad} NaN or infinite values; clean them first.")
    if scale == "counts" and n_negative:
        raise InputError(f"{where} does not hold raw counts ({n_negative} negative values: scaled or z-scored data, "
                         "neither counts nor log-normalized expression). Point data.counts_layer at a layer of raw "
                         "counts.")
    if scale == "counts" and n_fraction:
        raise InputError(f"{where} does not hold raw counts ({n_fraction} non-integer values). {hint}")
    if scale == "log" and len(values):
        check_log_values(values, n_negative, n_fraction, where, None if hint == TRAINING_COUNTS_HINT else hint)


MAX_LOG_VALUE = 50.0  # log1p of normalized counts stays far below (log1p(1e4) = 9.2; log2 of a million CPM: 20)


def check_log_values(values: np.ndarray, n_negative: int, n_fraction: int, where: str,
                     hint: str | None = None) -> None:
    """Refuse what data.scale=log cannot mean: negative values (z-scored or scaled data) and raw counts. `hint`
    replaces the training advice (a trained model's scale is fixed)."""
    if n_negative:
        raise InputError(f"{where} holds {n_negative} negative values: data.scale=log expects log-normalized "
                         "expression (log1p of normalized counts, >= 0), not z-scored or scaled values (sc.pp.scale). "
                         + (hint or "Point data.counts_layer at the layer of raw counts (data.scale=counts) or of "
                                    "log1p values kept before scaling."))
    largest = float(values.max())
    if (not n_fraction and largest > 1) or largest > MAX_LOG_VALUE:
        what = "every value a whole number" if not n_fraction else f"values up to {largest:g}"
        raise InputError(f"{where} looks like raw counts, not log-normalized expression ({what}): "
                         + (hint or "set data.scale=counts (the default) for raw counts, or point data.counts_layer "
                                    "at the log1p layer."))


def drop_empty(counts: sp.csr_matrix, var: pd.DataFrame) -> tuple[sp.csr_matrix, pd.DataFrame, np.ndarray]:
    """Drop all-zero cells and genes, logging how many; returns (counts, var, kept-cell mask)."""
    cell_ok = np.asarray((counts != 0).sum(axis=1)).ravel() > 0
    gene_ok = np.asarray((counts != 0).sum(axis=0)).ravel() > 0
    if (~cell_ok).any():
        log.info("Dropped %d empty cells (no non-zero values) of %d.", int((~cell_ok).sum()), len(cell_ok))
    if (~gene_ok).any():
        log.info("Dropped %d empty genes (no non-zero values) of %d.", int((~gene_ok).sum()), len(gene_ok))
    return counts[cell_ok][:, gene_ok].tocsr(), var.loc[gene_ok], cell_ok


def repeated(names: pd.Index) -> list[str]:
    """The names that occur more than once (as strings: 1 and "1" are the same gene name)."""
    names = pd.Index(names).astype(str)
    return names[names.duplicated()].unique().tolist()


def duplicate_genes_error(names: list[str], where: str) -> InputError:
    return InputError(
        f"{where} holds {len(names)} gene names more than once (e.g. {names[:5]}): genes are matched by name, so "
        "a repeated name is ambiguous. Sum or drop the duplicates, or rename them with "
        "adata.var_names_make_unique(), and save the file again."
    )


def check_names(adata: ad.AnnData) -> None:
    """Refuse repeated var_names (genes are matched by name); repeated obs_names only get a warning,
    because cells are matched by position, never by name."""
    genes = repeated(adata.var_names)
    if genes:
        raise duplicate_genes_error(genes, "var_names")
    cells = repeated(adata.obs_names)
    if cells:
        log.warning("obs_names holds %d cell names more than once (e.g. %s); batchfix matches cells by position, "
                    "so this does not matter here.", len(cells), cells[:3])


def check_batches(batch: np.ndarray, cell_ok: np.ndarray, batch_key: str) -> None:
    """At least two batches keep a non-empty cell (a batch whose cells are all empty is not trained on)."""
    found = sorted(pd.unique(batch[cell_ok]).tolist())
    lost = sorted(set(pd.unique(batch).tolist()) - set(found))
    if len(found) < 2:
        detail = f" (batches with only empty cells: {lost})" if lost else ""
        raise InputError(
            f"Training needs at least two batches in obs['{batch_key}']; found one: {found}{detail}. "
            "Is data.batch_key the column that names the batches?"
        )
    if lost:
        log.warning("Batches %s hold only empty cells: they are not trained on.", lost)


def expression_input(adata: ad.AnnData, keys: DataKeys, scale: str = "counts",
                     source: str = "the AnnData") -> ExpressionInput:
    """Validate an AnnData for training and take what training needs from it (`adata` is not changed)."""
    check_names(adata)
    batch = require_obs_column(adata, keys.batch_key, "Batch", "data.batch_key")
    if keys.label_key:  # the evaluation after training reads the labels: a wrong column stops before the fit
        labels = require_obs_column(adata, keys.label_key, "Label", "data.label_key",
                                    "; data.label_key=null trains without labels")
        warn_if_labels_follow_batches(labels, batch, keys.label_key, keys.batch_key)
    counts = as_float32_csr(select_matrix(adata, keys.counts_layer))
    check_values(counts.data, scale)
    var = adata.var.copy()
    var.index = var.index.astype(str)
    counts, var, cell_ok = drop_empty(counts, var)
    if counts.shape[0] == 0 or counts.shape[1] == 0:
        raise InputError(f"{source} has no non-empty cells or genes ({adata.n_obs} x {adata.n_vars}).")
    check_batches(batch, cell_ok, keys.batch_key)
    return ExpressionInput(
        counts=counts,
        batch=batch[cell_ok],
        obs_names=adata.obs_names[cell_ok],
        var=var,
        scale=scale,
        path=source,
        rows=np.flatnonzero(cell_ok),
    )


def batch_level_columns(columns, batch: np.ndarray, batch_key: str) -> list[str]:
    """The obs columns (from `columns`, (name, values) pairs) constant within each batch, with at least two values
    and fewer values than batches (a condition per donor, not another name of the batch): correcting by batch
    removes their differences too. Each is named in one warning line with the DE route that works."""
    batch = np.asarray(batch).astype(str)
    n_batches = len(np.unique(batch))
    found = []
    for name, values in columns:
        if name == batch_key or values is None:
            continue
        frame = pd.DataFrame({"batch": batch, "value": pd.Series(values).astype(str).to_numpy()})
        per_batch = frame.groupby("batch", sort=True)["value"].nunique()
        n_values = frame["value"].nunique()
        if (per_batch == 1).all() and 2 <= n_values < n_batches:
            found.append(str(name))
            groups = frame.drop_duplicates().groupby("value")["batch"].apply(list).to_dict()
            log.warning("obs column '%s' is constant within each batch (%s): correcting by '%s' removes its "
                        "differences with the batches'. For DE between its values, pseudobulk the raw counts per "
                        "batch and test ~%s with the batches as replicates (docs/corrected-matrix.md).", name,
                        "; ".join(f"{value}: {', '.join(b)}" for value, b in groups.items()), batch_key, name)
    return found


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (hex), read a MiB at a time: what identifies a checkpoint in a correction's uns."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
