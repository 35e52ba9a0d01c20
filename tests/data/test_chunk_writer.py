"""Chunks compressed on worker threads and written in place read back as h5py's own writes would
(batchfix.data.chunk_writer)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anndata as ad
import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from batchfix.correction.writers import CsrAppender
from batchfix.data import ondisk
from batchfix.data.chunk_writer import ChunkedAppender


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_appended_values_read_back_exactly_with_the_datasets_filters(tmp_path, dtype):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, size=int(rng.integers(0, 2500))).astype(dtype) / (7 if dtype == np.float32 else 1)
             for _ in range(40)]
    with h5py.File(tmp_path / "f.h5", "w") as f, ThreadPoolExecutor(2) as pool:
        dataset = f.create_dataset("x", shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1000,),
                                   **ondisk.LAYER_COMPRESSION)
        appender = ChunkedAppender(dataset, pool, workers=2)
        for part in parts:
            appender.append(part)
        assert appender.close() == sum(len(p) for p in parts)
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f["x"].compression == "gzip" and f["x"].shuffle and f["x"].chunks == (1000,)
        np.testing.assert_array_equal(f["x"][:], np.concatenate(parts).astype(dtype))


def test_a_layer_written_with_a_pool_is_the_matrix_anndata_reads(tmp_path):
    matrix = sp.random(3000, 400, density=0.05, format="csr", random_state=1, dtype=np.float32)
    matrix.data = np.round(matrix.data * 20)
    ad.AnnData(sp.csr_matrix(matrix.shape, dtype=np.float32)).write_h5ad(tmp_path / "a.h5ad")
    with h5py.File(tmp_path / "a.h5ad", "a") as f, ThreadPoolExecutor(2) as pool:
        writer = CsrAppender(f["layers"], "corrected", matrix.shape, pool=pool, workers=2)
        for start in range(0, matrix.shape[0], 700):
            writer.append(matrix[start:start + 700])
        writer.close()
    back = ad.read_h5ad(tmp_path / "a.h5ad").layers["corrected"]
    assert (back != matrix).nnz == 0 and back.dtype == np.float32


def test_a_dataset_without_gzip_and_shuffle_is_refused(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f, ThreadPoolExecutor(1) as pool:
        dataset = f.create_dataset("x", shape=(0,), maxshape=(None,), dtype=np.float32, chunks=(10,),
                                   compression="lzf")
        with pytest.raises(ValueError, match="gzip dataset with shuffle"):
            ChunkedAppender(dataset, pool, workers=1)
