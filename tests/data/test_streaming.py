"""Training data streamed from disk (data.stream): the same prepared data as the in-memory route,
every cell once per epoch in shuffled chunks, own shards per DDP process, and a real training run."""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import replace
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hydra import compose, initialize_config_module

from batchfix import tasks
from batchfix.config import DataConfig, TrainConfig, validated
from batchfix.data.prepare import StreamedCells, in_order
from batchfix.data.streaming import prepare_streamed, use_streaming
from batchfix.errors import ConfigError
from batchfix.training.fitting import CellDataModule, load_training_data
from batchfix.training.trained import load_trained

N_TOP_GENES = 200


@pytest.fixture(scope="module")
def disk_h5ad(tmp_path_factory, bundled_adata, _subset_index) -> Path:
    """The real 200-cell x 600-gene subset as CSR on disk, with one cell and one gene emptied."""
    cells, genes = _subset_index
    adata = bundled_adata[cells][:, genes].copy()
    x = np.asarray(adata.X, dtype=np.float32)
    x[17] = 0.0  # an empty cell, dropped by both routes
    x[:, 5] = 0.0  # an empty gene
    adata.X = sp.csr_matrix(x)
    path = tmp_path_factory.mktemp("stream") / "cells.h5ad"
    adata.write_h5ad(path)
    return path


def data_config(path: Path, **options) -> DataConfig:
    return DataConfig(path=str(path), n_top_genes=N_TOP_GENES, **options)


def row_keys(matrix: np.ndarray) -> list[bytes]:
    return sorted(row.tobytes() for row in matrix)


def test_streamed_preparation_matches_the_in_memory_route(disk_h5ad):
    before = hashlib.sha256(disk_h5ad.read_bytes()).hexdigest()
    data = data_config(disk_h5ad, chunk_cells=32, hvg_max_cells=1000)
    memory = load_training_data(replace(data, stream="false"))
    disk = prepare_streamed(data.path, data)
    assert hashlib.sha256(disk_h5ad.read_bytes()).hexdigest() == before
    assert disk.counts is None and disk.n_cells == memory.n_cells == 199
    assert disk.genes == memory.genes and len(disk.genes) == N_TOP_GENES
    assert disk.batch_categories == memory.batch_categories
    np.testing.assert_array_equal(disk.batch_index, memory.batch_index)
    np.testing.assert_array_equal(disk.coordinates.start, memory.coordinates.start)
    np.testing.assert_allclose(disk.gene_mean, memory.gene_mean, rtol=1e-5, atol=1e-6)
    # float64 sums on disk against float32 means in memory: the variance differs by float noise
    np.testing.assert_allclose(disk.gene_std, memory.gene_std, rtol=2e-4, atol=1e-6)
    streamed = np.concatenate([x.numpy() for x, _ in in_order(disk, 64)])
    np.testing.assert_array_equal(streamed, memory.counts.toarray())  # in file order, cell for cell
    chosen = np.array([0, 3, 4, 5, 50, 51, 120, 198])  # scattered and consecutive cells (calibration's sample)
    for prepared in (disk, memory):
        values, codes = zip(*in_order(prepared, 3, chosen))
        np.testing.assert_array_equal(np.concatenate([v.numpy() for v in values]), memory.counts[chosen].toarray())
        np.testing.assert_array_equal(np.concatenate(codes), memory.batch_index[chosen])


def test_hvgs_of_a_subsample_when_the_file_has_more_cells(disk_h5ad, caplog):
    data = data_config(disk_h5ad, chunk_cells=32, hvg_max_cells=100)
    with caplog.at_level("INFO"):
        disk = prepare_streamed(data.path, data)
    assert "Ranking highly variable genes on" in caplog.text and len(disk.genes) == N_TOP_GENES
    assert disk.n_cells == 199  # the statistics and the cells are still every cell's


def test_epochs_serve_every_cell_once_in_shuffled_chunks(disk_h5ad):
    data = data_config(disk_h5ad, chunk_cells=32, hvg_max_cells=1000)
    memory = load_training_data(replace(data, stream="false"))
    disk = prepare_streamed(data.path, data)
    cells = np.arange(0, disk.n_cells, 2)  # a training split
    stream = StreamedCells(disk.disk, cells, disk.batch_index, 16, 32, shuffle=True, seed=3)
    epochs = []
    for _ in range(2):
        batches = list(stream)
        assert len(batches) == len(stream) == int(np.ceil(len(cells) / 16))
        x = np.concatenate([b[0].numpy() for b in batches])
        codes = np.concatenate([b[1].numpy() for b in batches])
        assert row_keys(x) == row_keys(memory.counts[cells].toarray())
        assert np.bincount(codes).tolist() == np.bincount(memory.batch_index[cells]).tolist()
        epochs.append(x)
    assert not np.array_equal(epochs[0], epochs[1])  # a new order each epoch
    assert not np.array_equal(epochs[0], memory.counts[cells].toarray())  # not file order
    assert stream.largest_chunk <= 32 + 16  # memory holds a chunk (and a minibatch's leftover)


def test_ddp_processes_read_their_own_shards(disk_h5ad):
    data = data_config(disk_h5ad, chunk_cells=32, hvg_max_cells=1000)
    disk = prepare_streamed(data.path, data)
    cells = np.arange(disk.n_cells)
    shards = [StreamedCells(disk.disk, cells, disk.batch_index, 16, 32, shuffle=True, seed=1, rank=r, world_size=2)
              for r in range(2)]
    blocks = [np.concatenate(s.shard(0)) for s in shards]
    assert not set(blocks[0]) & set(blocks[1]) and sorted(np.concatenate(blocks)) == list(cells)
    served = [list(s) for s in shards]
    assert len(served[0]) == len(served[1]) == len(shards[0])  # DDP's lockstep: the same number of steps


def test_stream_option_and_auto_threshold(disk_h5ad):
    assert use_streaming(data_config(disk_h5ad, stream="true"), str(disk_h5ad))
    assert not use_streaming(data_config(disk_h5ad, stream="false", stream_above_gb=0.0), str(disk_h5ad))
    assert not use_streaming(data_config(disk_h5ad), str(disk_h5ad))  # auto: far below 2 GB
    assert use_streaming(data_config(disk_h5ad, stream_above_gb=1e-6), str(disk_h5ad))
    assert DataConfig(stream=True).stream == "true"  # Hydra reads data.stream=true as a boolean
    with pytest.raises(ConfigError, match="data.stream"):
        DataConfig(stream="sometimes")
    with pytest.raises(ConfigError, match="data.chunk_cells"):
        DataConfig(chunk_cells=4)
    with pytest.raises(ConfigError, match="data.hvg_max_cells"):
        DataConfig(hvg_max_cells=10)


def test_validation_cap_moves_the_other_held_out_cells_into_training(disk_h5ad):
    data = data_config(disk_h5ad)
    prepared = load_training_data(replace(data, stream="false"))
    capped = CellDataModule(prepared, 64, 0.1, seed=0, max_validation_cells=5)
    uncapped = CellDataModule(prepared, 64, 0.1, seed=0, max_validation_cells=10_000)
    assert len(capped.validation_rows) == 5 and len(uncapped.validation_rows) == 20
    assert len(capped.train_rows) == prepared.n_cells - 5
    assert not set(capped.validation_rows) & set(capped.train_rows)
    with pytest.raises(ConfigError, match="fit.max_validation_cells"):
        validated({"fit": {"max_validation_cells": 0}}, TrainConfig)


def test_streamed_training_run(disk_h5ad, tmp_path):
    """A real run with data.stream=true: trained, calibrated from disk, corrected; the input unchanged."""
    before = hashlib.sha256(disk_h5ad.read_bytes()).hexdigest()
    overrides = [f"data.path={disk_h5ad}", f"data.n_top_genes={N_TOP_GENES}", "data.stream=true",
                 "data.chunk_cells=64", "model.genes_per_token=16", "model.d_model=16", "model.n_heads=2",
                 "model.n_layers=1", "model.latent_dim=8", "model.decoder_hidden=32", "fit.batch_size=32",
                 "fit.max_validation_cells=8", "trainer.max_epochs=2", "evaluate=false", "threads=1",
                 "trainer.enable_progress_bar=false"]
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        cfg = validated(compose(config_name="train", overrides=overrides), TrainConfig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = tasks.train(cfg, tmp_path / "run")
    assert not [w for w in caught if "IterableDataset" in str(w.message)]  # exact without loader workers
    assert hashlib.sha256(disk_h5ad.read_bytes()).hexdigest() == before
    assert metrics["streamed"] is True and metrics["n_cells"] == 199 and metrics["epochs"] == 2
    assert metrics["steps"] == 2 * int(np.ceil((199 - 8) / 32))
    assert np.isfinite(metrics["losses"]["train_loss"])
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["streamed"] is True
    model = load_trained(tmp_path / "run" / "model.ckpt")
    assert (model.tables.residual_spread > 0).all()  # calibrated on the streamed cells
    corrected = ad.read_h5ad(tmp_path / "run" / "corrected.h5ad")
    layer = corrected.layers["batchfix"]
    assert corrected.n_obs == 200 and np.isfinite(layer.data if sp.issparse(layer) else layer).all()
    assert torch.isfinite(torch.as_tensor(corrected.obsm["X_batchfix"])).all()
