"""From validated input to model-ready tensors: genes selected and put in genomic order, minibatches."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pytorch_lightning as pl
import scipy.sparse as sp
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from batchfix.config import DataConfig
from batchfix.errors import ConfigError
from batchfix.genome import GeneCoordinates, place_genes
from batchfix.io import ExpressionInput
from batchfix.normalize import log_cp10k
from batchfix.select import highly_variable_genes

log = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """Modelled genes in genomic order, and the cells' values and batch codes for them.

    counts: (cells, modelled genes) CSR, columns in genomic order.
    """

    counts: sp.csr_matrix
    batch_index: np.ndarray
    batch_categories: list[str]
    genes: list[str]
    coordinates: GeneCoordinates
    gene_mean: np.ndarray
    gene_std: np.ndarray


def prepare(inp: ExpressionInput, data: DataConfig) -> PreparedData:
    """Place genes, select HVGs, order them genomically; standardization statistics for the encoder."""
    selected = np.flatnonzero(highly_variable_genes(inp.counts, inp.batch, data.n_top_genes, inp.scale))
    coordinates = place_genes(inp.var.iloc[selected], data.genome, data.gtf)
    if data.unplaced == "drop":
        keep = coordinates.placed
        log.info("Dropping %d unplaced genes of %d modelled (data.unplaced=drop).", int((~keep).sum()), len(keep))
        selected, coordinates = selected[keep], coordinates.subset(np.flatnonzero(keep))
    order = coordinates.genomic_order()
    file_columns = selected[order]
    counts = inp.counts[:, file_columns].tocsr()
    values = log_cp10k(counts) if inp.scale == "counts" else counts  # what BatchfixNet.log_expression sees
    mean = np.asarray(values.mean(axis=0)).ravel()
    sq_mean = np.asarray(values.multiply(values).mean(axis=0)).ravel()
    std = np.sqrt(np.clip(sq_mean - mean**2, 0.0, None)) + 1e-2
    categories = inp.batch_categories
    return PreparedData(
        counts=counts,
        batch_index=np.searchsorted(categories, inp.batch).astype(np.int64),
        batch_categories=categories,
        genes=inp.var.index[file_columns].tolist(),
        coordinates=coordinates.subset(order),
        gene_mean=mean.astype(np.float32),
        gene_std=std.astype(np.float32),
    )


class CellBatches(Dataset):
    """Rows of a CSR matrix served as dense minibatches: dataset[list of rows] -> (values, batch codes)."""

    def __init__(self, counts: sp.csr_matrix, batch_index: np.ndarray):
        self.counts, self.batch_index = counts, batch_index

    def __len__(self) -> int:
        return self.counts.shape[0]

    def __getitem__(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.sort(np.asarray(rows))
        values = torch.from_numpy(self.counts[rows].toarray())  # (B, G)
        return values, torch.from_numpy(self.batch_index[rows])


def minibatches(dataset: Dataset, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    """A loader that asks the dataset for whole minibatches (one sparse slice each, no per-cell collate).

    The shuffle has its own seeded generator, so DDP processes draw the same order per epoch.
    """
    sampler = (RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle
               else SequentialSampler(dataset))
    return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last=False), batch_size=None)


class CellDataModule(pl.LightningDataModule):
    """Train/validation split of the prepared cells (validation drives early stopping)."""

    def __init__(self, prepared: PreparedData, batch_size: int = 128, validation_fraction: float = 0.1, seed: int = 0):
        super().__init__()
        self.prepared, self.batch_size, self.seed = prepared, batch_size, seed
        n_cells = prepared.counts.shape[0]
        permutation = np.random.default_rng(seed).permutation(n_cells)
        n_validation = int(round(validation_fraction * n_cells)) if n_cells >= 50 else 0
        if n_validation >= n_cells:
            raise ConfigError(f"fit.validation_fraction={validation_fraction:g} holds out all {n_cells} cells: "
                              "none are left to train on.")
        self.validation_rows = np.sort(permutation[:n_validation])
        self.train_rows = np.sort(permutation[n_validation:])

    def subset(self, rows: np.ndarray) -> CellBatches:
        return CellBatches(self.prepared.counts[rows], self.prepared.batch_index[rows])

    def train_dataloader(self) -> DataLoader:
        return minibatches(self.subset(self.train_rows), self.batch_size, shuffle=True, seed=self.seed)

    def val_dataloader(self) -> DataLoader:
        return minibatches(self.subset(self.validation_rows), self.batch_size, shuffle=False)
