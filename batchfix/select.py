"""Gene selection: batch-aware highly variable genes, computed on counts, kept in genomic order."""
from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp

log = logging.getLogger(__name__)


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
    adata = ad.AnnData(counts, obs=pd.DataFrame({"batch": pd.Categorical(batch)}, index=np.arange(len(batch)).astype(str)))
    if scale == "counts":
        try:
            table = sc.pp.highly_variable_genes(
                adata, n_top_genes=n_top_genes, flavor="seurat_v3", batch_key="batch", inplace=False,
            )
        except ValueError as err:  # loess can fail on a tiny batch; fall back to pooled cells
            log.warning("Batch-aware seurat_v3 failed (%s); selecting HVGs over all cells pooled.", err)
            table = sc.pp.highly_variable_genes(adata, n_top_genes=n_top_genes, flavor="seurat_v3", inplace=False)
    else:
        table = sc.pp.highly_variable_genes(adata, n_top_genes=n_top_genes, flavor="seurat", batch_key="batch", inplace=False)
    mask = table["highly_variable"].to_numpy(dtype=bool)
    log.info("Selected %d highly variable genes of %d.", int(mask.sum()), n_genes)
    return mask
