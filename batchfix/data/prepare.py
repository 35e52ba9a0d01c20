"""From validated input to model-ready tensors: genes selected and put in genomic order, minibatches."""
from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from batchfix.config import DataConfig
from batchfix.data import ondisk
from batchfix.data.genome import GeneCoordinates, place_genes
from batchfix.data.io import ExpressionInput
from batchfix.data.normalize import log_cp10k
from batchfix.data.select import highly_variable_genes
from batchfix.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class DiskCells:
    """Where streamed training reads its cells from: an .h5ad matrix on disk (batchfix.data.streaming)."""

    path: str
    element: str  # "X" or "layers/<name>"
    rows: np.ndarray  # (cells,) the file rows of the cells trained on (non-empty ones), ascending
    columns: np.ndarray  # (modelled genes,) the file columns of the modelled genes, in genomic order
    chunk_cells: int = DataConfig.chunk_cells  # cells held at a time


@dataclass
class PreparedData:
    """Modelled genes in genomic order, and the cells' values and batch codes for them.

    counts: (cells, modelled genes) CSR, columns in genomic order; None when the cells stay on disk
    (`disk` says where).
    """

    counts: sp.csr_matrix | None
    batch_index: np.ndarray
    batch_categories: list[str]
    genes: list[str]
    coordinates: GeneCoordinates
    gene_mean: np.ndarray
    gene_std: np.ndarray
    disk: DiskCells | None = None
    rows: np.ndarray | None = None  # (cells,) the input's rows of these cells, in memory (streamed: disk.rows)

    @property
    def n_cells(self) -> int:
        return len(self.batch_index)

    @property
    def file_rows(self) -> np.ndarray:
        """(cells,) the row of each prepared cell in the input (empty cells are not prepared)."""
        if self.disk is not None:
            return self.disk.rows
        return np.arange(self.n_cells) if self.rows is None else self.rows


def model_genes(var: pd.DataFrame, selected: np.ndarray, data: DataConfig) -> tuple[np.ndarray, GeneCoordinates]:
    """Columns of the modelled genes among var's rows, in genomic order, and their coordinates."""
    coordinates = place_genes(var.iloc[selected], data.genome, data.gtf)
    if data.unplaced == "drop":
        keep = coordinates.placed
        log.info("Dropping %d unplaced genes of %d modelled (data.unplaced=drop).", int((~keep).sum()), len(keep))
        selected, coordinates = selected[keep], coordinates.subset(np.flatnonzero(keep))
    order = coordinates.genomic_order()
    return selected[order], coordinates.subset(order)


def standardization(mean: np.ndarray, sq_mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The encoder's per-gene mean and sd (floored by +0.01) from the means over cells of values and squares."""
    std = np.sqrt(np.clip(sq_mean - mean**2, 0.0, None)) + 1e-2
    return mean.astype(np.float32), std.astype(np.float32)


def prepare(inp: ExpressionInput, data: DataConfig) -> PreparedData:
    """Place genes, select HVGs, order them genomically; standardization statistics for the encoder."""
    selected = np.flatnonzero(highly_variable_genes(inp.counts, inp.batch, data.n_top_genes, inp.scale))
    file_columns, coordinates = model_genes(inp.var, selected, data)
    counts = inp.counts[:, file_columns].tocsr()
    values = log_cp10k(counts) if inp.scale == "counts" else counts  # what BatchfixNet.log_expression sees
    gene_mean, gene_std = standardization(np.asarray(values.mean(axis=0)).ravel(),
                                          np.asarray(values.multiply(values).mean(axis=0)).ravel())
    categories = inp.batch_categories
    return PreparedData(
        counts=counts,
        batch_index=np.searchsorted(categories, inp.batch).astype(np.int64),
        batch_categories=categories,
        genes=inp.var.index[file_columns].tolist(),
        coordinates=coordinates,
        gene_mean=gene_mean,
        gene_std=gene_std,
        rows=inp.rows,
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


BLOCKS_PER_CHUNK = 16  # a streamed chunk mixes cells from this many places of the file


class StreamedCells(IterableDataset):
    """Minibatches of cells read from an .h5ad on disk, for files too large to hold in memory.

    An epoch serves every cell once. The cells are cut into blocks of consecutive file rows
    (chunk_cells / BLOCKS_PER_CHUNK cells); with `shuffle` the blocks are shuffled (the same order in
    every DDP process: seed and epoch) and process `rank` of `world_size` reads blocks rank, rank +
    world_size, ...: its own shard. Blocks are read BLOCKS_PER_CHUNK at a time into one chunk whose
    cells are shuffled and served as minibatches (leftovers carried into the next chunk), so even a
    file sorted by batch gives mixed minibatches, and memory holds one chunk of modelled genes plus the
    block being read. With `shuffle` every process serves exactly `len(self)` minibatches, as DDP's
    lockstep needs: a shard that falls short repeats its first minibatches, one in excess stops early.
    """

    def __init__(self, disk: DiskCells, cells: np.ndarray, batch_index: np.ndarray, batch_size: int,
                 chunk_cells: int, shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.disk, self.rows, self.batch_index = disk, disk.rows[cells], batch_index[cells]
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        # At least one block per process while there are cells enough.
        self.block = max(1, min(chunk_cells // BLOCKS_PER_CHUNK, len(self.rows) // world_size))
        self.epoch = 0  # the next epoch served (the block order and shuffles follow it)
        self.largest_chunk = 0  # the most cells held at once so far

    def __len__(self) -> int:
        return math.ceil(math.ceil(len(self.rows) / self.batch_size) / self.world_size)

    def shard(self, epoch: int) -> list[np.ndarray]:
        """This process's blocks (positions into self.rows) for an epoch, in reading order."""
        blocks = [np.arange(start, min(start + self.block, len(self.rows)))
                  for start in range(0, len(self.rows), self.block)]
        order = np.random.default_rng([self.seed, epoch]).permutation(len(blocks)) if self.shuffle \
            else np.arange(len(blocks))
        return [blocks[i] for i in order[self.rank::self.world_size]]

    def read(self, reader, block: np.ndarray) -> sp.csr_matrix:
        """One block's cells in the modelled genes (a block of every gene is all that is read at once)."""
        return sp.csr_matrix(reader.take(self.rows[block]), dtype=np.float32)[:, self.disk.columns]

    def chunks(self, reader, shard: list[np.ndarray], rng) -> Iterator[tuple[sp.csr_matrix, np.ndarray]]:
        """(counts, batch codes) of BLOCKS_PER_CHUNK blocks at a time, cells shuffled."""
        for first in range(0, len(shard), BLOCKS_PER_CHUNK):
            blocks = shard[first:first + BLOCKS_PER_CHUNK]
            counts = sp.vstack([self.read(reader, block) for block in blocks], format="csr")
            codes = self.batch_index[np.concatenate(blocks)]
            order = rng.permutation(len(codes)) if self.shuffle else np.arange(len(codes))
            yield counts[order], codes[order]

    def served(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The shard's minibatches for an epoch (a chunk's leftover cells go on with the next chunk)."""
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        counts, codes = sp.csr_matrix((0, len(self.disk.columns)), dtype=np.float32), np.empty(0, np.int64)
        with h5py.File(self.disk.path, "r") as f:
            reader = ondisk.open_rows(f[self.disk.element])
            for more, more_codes in self.chunks(reader, self.shard(epoch), rng):
                counts, codes = sp.vstack([counts, more], format="csr"), np.concatenate([codes, more_codes])
                self.largest_chunk = max(self.largest_chunk, counts.shape[0])
                whole = counts.shape[0] - counts.shape[0] % self.batch_size
                for start in range(0, whole, self.batch_size):
                    yield dense_batch(counts[start:start + self.batch_size], codes[start:start + self.batch_size])
                counts, codes = counts[whole:], codes[whole:]
        if counts.shape[0]:
            yield dense_batch(counts, codes)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, self.epoch = self.epoch, self.epoch + int(self.shuffle)
        if not self.shuffle:
            yield from self.served(epoch)
            return
        kept, count = [], 0  # a shard falls short by less than a block or so
        for batch in itertools.islice(self.served(epoch), len(self)):
            if len(kept) < self.block // self.batch_size + 2:
                kept.append(batch)
            count += 1
            yield batch
        for i in range(len(self) - count):  # a short DDP shard repeats its first minibatches
            yield kept[i % len(kept)]


def in_order(prepared: PreparedData, batch_size: int,
             cells: np.ndarray | None = None) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """Every prepared cell (or those at the sorted positions `cells`) once, in order, as (values (B, G), batch
    codes (B,)): from memory, or streamed from disk a chunk at a time."""
    cells = np.arange(prepared.n_cells) if cells is None else cells
    if prepared.disk is None:
        for start in range(0, len(cells), batch_size):
            rows = cells[start:start + batch_size]
            yield torch.from_numpy(prepared.counts[rows].toarray()), prepared.batch_index[rows]
        return
    streamed = StreamedCells(prepared.disk, cells, prepared.batch_index, batch_size,
                             prepared.disk.chunk_cells, shuffle=False)
    for values, codes in streamed:
        yield values, codes.numpy()


def dense_batch(counts: sp.csr_matrix, codes: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(counts.toarray()), torch.from_numpy(codes)  # (B, G), (B,)


def validation_size(n_cells: int, validation_fraction: float, max_validation_cells: int | None = None) -> int:
    """Cells held out for validation: the fraction of n_cells (none below 50 cells), at most max_validation_cells."""
    n_validation = int(round(validation_fraction * n_cells)) if n_cells >= 50 else 0
    if n_validation >= n_cells:
        raise ConfigError(f"fit.validation_fraction={validation_fraction:g} holds out all {n_cells} cells: "
                          "none are left to train on.")
    if max_validation_cells is not None and n_validation > max_validation_cells:
        log.info("Validating on %d of the %d held-out cells (fit.max_validation_cells); the rest "
                 "are trained on.", max_validation_cells, n_validation)
        n_validation = max_validation_cells
    return n_validation
