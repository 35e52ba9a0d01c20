"""Reading and validating AnnData files, and atomic whole-file writes (streamed writes: ondisk.py).

Reading validates the input and turns it into plain arrays (`ExpressionInput`); writing is
atomic (temporary file in the destination folder, then rename), so a crash never leaves a
partial output and the input file is never touched.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

log = logging.getLogger(__name__)

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class InputError(ValueError):
    """Bad user input: the message names the problem and what exists instead."""


@dataclass
class ExpressionInput:
    """Validated expression data, still in the file's own gene order.

    counts: (cells, genes) float32 CSR matrix (raw counts, or log-scale values for scale='log').
    """

    counts: sp.csr_matrix
    batch: np.ndarray  # (cells,) str
    labels: np.ndarray | None  # (cells,) str
    obs_names: pd.Index
    var: pd.DataFrame  # index = gene names (var_names)
    scale: str  # "counts" or "log"
    path: str

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
        return ad.read_h5ad(p)
    except Exception as err:  # anndata raises many kinds for corrupt files
        raise InputError(f"Cannot read {p} as AnnData: {type(err).__name__}: {err}") from err


def require_obs_column(adata: ad.AnnData, key: str, what: str, option: str, hint: str = "") -> np.ndarray:
    """Return obs[key] as strings, or raise an error listing the obs columns that exist."""
    if key not in adata.obs.columns:
        raise InputError(
            f"{what} key '{key}' is not an obs column. Columns present: "
            f"{list(map(str, adata.obs.columns)) or '(none)'}. Set it with {option}=<column>{hint}."
        )
    values = adata.obs[key]
    if values.isna().any():
        raise InputError(f"obs column '{key}' has {int(values.isna().sum())} missing values.")
    return values.astype(str).to_numpy()


def select_matrix(adata: ad.AnnData, layer: str | None):
    """Return X or the named layer, or raise an error listing the layers that exist."""
    if layer is None:
        if adata.X is None:
            raise InputError(f"The file has no X matrix. Layers present: {list(adata.layers.keys())}.")
        return adata.X
    if layer not in adata.layers:
        raise InputError(
            f"Layer '{layer}' not found. Layers present: {list(adata.layers.keys()) or '(none)'}. "
            f"Use data.counts_layer=null to read X."
        )
    return adata.layers[layer]


def as_float32_csr(matrix) -> sp.csr_matrix:
    """Any in-memory matrix (dense, sparse, backed dataset) as a float32 CSR matrix."""
    if sp.issparse(matrix):
        return sp.csr_matrix(matrix, dtype=np.float32)
    return sp.csr_matrix(np.asarray(matrix, dtype=np.float32))


def count_bad_values(values: np.ndarray) -> tuple[int, int, int]:
    """(NaN or infinite, negative, non-integer) counts among `values`."""
    return (int((~np.isfinite(values)).sum()), int((values < 0).sum()),
            int((values != np.round(values)).sum()))


def check_values(counts: sp.csr_matrix, scale: str) -> None:
    """Raise on NaN/inf values, and on non-count values when counts are needed."""
    n_bad, n_negative, n_fraction = count_bad_values(counts.data)
    if n_bad:
        raise InputError(f"The expression matrix holds {n_bad} NaN or infinite values; clean them first.")
    if scale != "counts":
        return
    if n_negative or n_fraction:
        raise InputError(
            "The expression matrix does not hold raw counts "
            f"({n_negative} negative and {n_fraction} non-integer values). batchfix models counts by "
            "default: point data.counts_layer at a layer of raw counts, or set data.scale=log for "
            "log-normalized input (Gaussian likelihood)."
        )


def drop_empty(counts: sp.csr_matrix, var: pd.DataFrame) -> tuple[sp.csr_matrix, pd.DataFrame, np.ndarray]:
    """Drop all-zero cells and genes, logging how many; returns (counts, var, kept-cell mask)."""
    cell_ok = np.asarray((counts != 0).sum(axis=1)).ravel() > 0
    gene_ok = np.asarray((counts != 0).sum(axis=0)).ravel() > 0
    if (~cell_ok).any():
        log.info("Dropped %d empty cells (no non-zero values) of %d.", int((~cell_ok).sum()), len(cell_ok))
    if (~gene_ok).any():
        log.info("Dropped %d empty genes (no non-zero values) of %d.", int((~gene_ok).sum()), len(gene_ok))
    return counts[cell_ok][:, gene_ok].tocsr(), var.loc[gene_ok], cell_ok


def load_expression(
    path: str | os.PathLike,
    batch_key: str = "batch",
    label_key: str | None = None,
    counts_layer: str | None = None,
    scale: str = "counts",
    for_training: bool = True,
) -> ExpressionInput:
    """Read and validate an .h5ad file for training (or evaluation)."""
    if scale not in ("counts", "log"):
        raise InputError(f"data.scale must be 'counts' or 'log', got '{scale}'.")
    adata = read_h5ad(path)
    batch = require_obs_column(adata, batch_key, "Batch", "data.batch_key")
    labels = require_obs_column(adata, label_key, "Label", "data.label_key",
                                "; data.label_key=null trains without labels") if label_key else None
    counts = as_float32_csr(select_matrix(adata, counts_layer))
    check_values(counts, scale)
    var = adata.var.copy()
    var.index = var.index.astype(str)
    counts, var, cell_ok = drop_empty(counts, var)
    if counts.shape[0] == 0 or counts.shape[1] == 0:
        raise InputError(f"{path} has no non-empty cells or genes ({adata.n_obs} x {adata.n_vars}).")
    if for_training:
        # Counted after dropping empty cells: a batch whose cells are all empty is not trained on.
        found = sorted(pd.unique(batch[cell_ok]).tolist())
        if len(found) < 2:
            lost = sorted(set(pd.unique(batch).tolist()) - set(found))
            detail = f" (batches with only empty cells: {lost})" if lost else ""
            raise InputError(
                f"Training needs at least two batches in obs['{batch_key}']; found one: {found}{detail}. "
                "Is data.batch_key the column that names the batches?"
            )
    return ExpressionInput(
        counts=counts,
        batch=batch[cell_ok],
        labels=None if labels is None else labels[cell_ok],
        obs_names=adata.obs_names[cell_ok],
        var=var,
        scale=scale,
        path=str(path),
    )


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_output(target: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success move it to `target`, on any failure delete it.

    Without `overwrite` the final step is a hard link, which fails if `target` appeared meanwhile, so an
    existing file is never replaced; with it, an atomic rename replaces the old file in one step.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())  # the data is on disk before the name points at it
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600 files; match a plain write
        if overwrite:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise FileExistsError(f"Output {target} exists; pass overwrite=true to replace it.") from None
            except OSError:  # a file system without hard links
                if target.exists():
                    raise FileExistsError(f"Output {target} exists; pass overwrite=true to replace it.") from None
                os.replace(tmp, target)
            tmp.unlink(missing_ok=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_h5ad_atomic(adata: ad.AnnData, path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write a whole AnnData to a temporary file beside `path`, then move it into place."""
    target = Path(path).expanduser()
    if target.exists() and not overwrite:
        raise FileExistsError(f"Output {target} exists; pass overwrite=true to replace it.")
    with atomic_output(target, overwrite) as tmp:
        adata.write_h5ad(tmp)
    return target
