"""Gene selection: batch-aware highly variable genes, computed on counts, kept in genomic order.

scanpy ranks genes within each batch (seurat_v3 fits a loess of variance on mean per batch) and
merges the ranks. A batch of one cell has no variance and crashes that loess with a segmentation
fault, which no exception handler can catch; tiny batches give meaningless variances anyway. So
only batches with at least MIN_BATCH_CELLS cells and MIN_VARYING_GENES varying genes are ranked
(their cells are still all trained on), with a log line naming the others; with fewer than two
such batches the cells are pooled.
"""
from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from batchfix.errors import InputError

log = logging.getLogger(__name__)

MIN_BATCH_CELLS = 10  # a batch's own gene variances are used from this many cells up
MIN_VARYING_GENES = 20  # seurat_v3's loess needs points (fewer than 4 crash the process)


def varying_genes(counts: sp.csr_matrix) -> int:
    """How many genes take more than one value across the rows of `counts`."""
    if counts.shape[0] < 2:
        return 0
    low, high = counts.min(axis=0).toarray().ravel(), counts.max(axis=0).toarray().ravel()
    return int((high > low).sum())


def ranked_batches(counts: sp.csr_matrix, batch: np.ndarray) -> np.ndarray | None:
    """Mask of the cells whose batches are large and varied enough to rank genes in, or None to pool all cells."""
    names, sizes = np.unique(batch, return_counts=True)
    usable = [name for name, size in zip(names, sizes)
              if size >= MIN_BATCH_CELLS and varying_genes(counts[batch == name]) >= MIN_VARYING_GENES]
    small = [f"{name} ({size} cell{'' if size == 1 else 's'})"
             for name, size in zip(names, sizes) if name not in usable]
    if small and len(usable) >= 2:
        log.warning("Batches too small to rank genes in (fewer than %d cells or %d varying genes): %s. Highly "
                    "variable genes are ranked in the other %d batches; every cell is still trained on.",
                    MIN_BATCH_CELLS, MIN_VARYING_GENES, ", ".join(small), len(usable))
    if len(usable) < 2:
        log.warning("Fewer than two batches are large enough to rank genes in (%d cells and %d varying genes "
                    "each): highly variable genes are selected over all cells pooled.",
                    MIN_BATCH_CELLS, MIN_VARYING_GENES)
        return None
    return np.isin(batch, usable)


def scanpy_hvg(counts: sp.csr_matrix, batch: np.ndarray | None, n_top_genes: int, scale: str) -> pd.DataFrame:
    """scanpy's table for `n_top_genes` (seurat_v3 on counts, seurat on log-scale), per batch unless batch is None.
    scanpy is imported here, at training time: a correction never selects genes and starts 0.6 s sooner."""
    import scanpy as sc

    obs = pd.DataFrame(index=np.arange(counts.shape[0]).astype(str))
    if batch is not None:
        obs["batch"] = pd.Categorical(batch)
    adata = ad.AnnData(counts, obs=obs)
    return sc.pp.highly_variable_genes(adata, n_top_genes=n_top_genes, flavor="seurat_v3" if scale == "counts"
                                       else "seurat", batch_key=None if batch is None else "batch", inplace=False)


def highly_variable_genes(
    counts: sp.csr_matrix, batch: np.ndarray, n_top_genes: int | None, scale: str = "counts",
) -> np.ndarray:
    """Boolean mask over genes: the `n_top_genes` batch-aware HVGs (scanpy seurat_v3 on counts,
    seurat on log-scale input). None, or more genes than the file has, keeps all genes."""
    n_genes = counts.shape[1]
    if n_top_genes is None:
        return np.ones(n_genes, dtype=bool)
    if n_top_genes >= n_genes:
        log.info("data.n_top_genes=%d >= the %d genes in the file: keeping all genes.", n_top_genes, n_genes)
        return np.ones(n_genes, dtype=bool)
    n_varying = varying_genes(counts)
    if n_varying < MIN_VARYING_GENES:
        raise InputError(f"Only {n_varying} genes vary across the cells: selecting data.n_top_genes={n_top_genes} "
                         f"highly variable genes needs at least {MIN_VARYING_GENES}. Set data.n_top_genes=null to "
                         "model every gene.")
    cells = ranked_batches(counts, batch)
    table = None
    if cells is not None:
        try:
            table = scanpy_hvg(counts[cells], batch[cells], n_top_genes, scale)
        except (ValueError, IndexError) as err:  # loess can fail on a batch's few distinct values
            log.warning("Batch-aware selection failed (%s); selecting HVGs over all cells pooled.", err)
    if table is None:
        try:
            table = scanpy_hvg(counts, None, n_top_genes, scale)
        except (ValueError, IndexError) as err:
            raise InputError(f"Highly variable gene selection failed on this data ({err}); set data.n_top_genes="
                             "null to model every gene.") from err
    mask = table["highly_variable"].to_numpy(dtype=bool)
    log.info("Selected %d highly variable genes of %d.", int(mask.sum()), n_genes)
    return mask
