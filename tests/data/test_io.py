"""Input side of batchfix.data.io: clear errors on bad files, and validation."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from batchfix.config import DataConfig, DataKeys
from batchfix.data import io
from batchfix.data.io import expression_input, read_h5ad
from batchfix.errors import ConfigError, InputError


def read_for_training(path, scale: str = "counts", **keys) -> io.ExpressionInput:
    """A file read and validated as training reads it, with the data keys (batch_key, label_key, counts_layer)
    by name."""
    return expression_input(read_h5ad(path), DataKeys(**keys), scale, source=str(path))

# The real subset written by conftest.small_h5ad: 200 cells (40 per batch) x 600 genes.
N_SUBSET_CELLS, N_SUBSET_GENES, N_BATCHES = 200, 600, 5


def file_digest(path) -> str:
    """sha256 of a file's bytes (to check that inputs are left untouched)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def dense(matrix) -> np.ndarray:
    return matrix.toarray() if sp.issparse(matrix) else np.asarray(matrix)


# --------------------------------------------------------------------------------------------
# The good path on real data


def test_loads_real_subset_unchanged(small_adata, small_h5ad):
    before = file_digest(small_h5ad)
    inp = read_for_training(small_h5ad, batch_key="batch", label_key="cell_type")
    assert file_digest(small_h5ad) == before
    assert isinstance(inp.counts, sp.csr_matrix) and inp.counts.dtype == np.float32
    assert inp.counts.shape == (N_SUBSET_CELLS, N_SUBSET_GENES)
    np.testing.assert_array_equal(inp.counts.toarray(), small_adata.X)
    assert list(inp.obs_names) == list(small_adata.obs_names)
    assert list(inp.var.index) == list(small_adata.var_names)
    assert {"gene_symbol", "chromosome", "start", "end"} <= set(inp.var.columns)
    np.testing.assert_array_equal(inp.batch, small_adata.obs["batch"].astype(str).to_numpy())
    assert len(inp.batch_categories) == N_BATCHES
    assert inp.batch_categories == sorted(small_adata.obs["batch"].astype(str).unique())
    assert inp.scale == "counts" and inp.path == str(small_h5ad)


def test_bundled_file_loads(bundled_h5ad, bundled_adata):
    before = file_digest(bundled_h5ad)
    inp = read_for_training(bundled_h5ad, label_key="cell_type")
    assert file_digest(bundled_h5ad) == before
    assert inp.counts.shape == (1021, 11533)
    assert len(inp.batch_categories) == 5
    assert inp.counts.nnz == int(np.count_nonzero(bundled_adata.X))


def test_unknown_scale_rejected():
    with pytest.raises(ConfigError, match=r"data\.scale.*'raw'"):
        DataConfig(scale="raw")


# --------------------------------------------------------------------------------------------
# Files that are not readable .h5ad files


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "missing.h5ad"
    with pytest.raises(InputError) as err:
        read_for_training(path)
    assert str(path) in str(err.value)
    assert "not found" in str(err.value)


def test_folder_instead_of_file(tmp_path):
    path = tmp_path / "looks_like.h5ad"
    path.mkdir()
    with pytest.raises(InputError) as err:
        read_for_training(path)
    assert str(path) in str(err.value)
    assert "folder" in str(err.value)


def refused_unchanged(path, *phrases: str) -> None:
    """Training refuses the file at `path` naming it and every one of `phrases`, and leaves its bytes as they were."""
    before = file_digest(path)
    with pytest.raises(InputError) as err:
        read_for_training(path)
    message = str(err.value)
    assert str(path) in message and all(phrase in message for phrase in phrases), message
    assert file_digest(path) == before


def test_csv_renamed_to_h5ad(small_adata, tmp_path):
    path = tmp_path / "counts.h5ad"
    frame = pd.DataFrame(small_adata.X[:20, :50], index=small_adata.obs_names[:20],
                         columns=small_adata.var_names[:50])
    frame.to_csv(path)
    refused_unchanged(path, "not an .h5ad file", "HDF5 signature")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.h5ad"
    path.touch()
    with pytest.raises(InputError) as err:
        read_for_training(path)
    assert str(path) in str(err.value) and "not an .h5ad file" in str(err.value)


def test_truncated_hdf5(small_h5ad, tmp_path):
    data = small_h5ad.read_bytes()
    path = tmp_path / "truncated.h5ad"
    path.write_bytes(data[: len(data) // 2])
    refused_unchanged(path, "Cannot read", "truncated")


def test_corrupt_hdf5_superblock(small_h5ad, tmp_path):
    data = bytearray(small_h5ad.read_bytes())
    data[8:512] = bytes(504)  # keep the signature, wipe the superblock
    path = tmp_path / "corrupt.h5ad"
    path.write_bytes(bytes(data))
    before = file_digest(path)
    with pytest.raises(InputError) as err:
        read_for_training(path)
    assert str(path) in str(err.value) and "Cannot read" in str(err.value)
    assert file_digest(path) == before


@pytest.mark.filterwarnings("ignore:Element.*without encoding metadata")
def test_hdf5_that_is_not_anndata(tmp_path):
    path = tmp_path / "tenx_like.h5ad"
    with h5py.File(path, "w") as fh:
        fh["matrix/data"] = np.arange(5)
    with pytest.raises(InputError) as err:
        read_h5ad(path)
    assert str(path) in str(err.value) and "as AnnData" in str(err.value)


# --------------------------------------------------------------------------------------------
# Keys and layers


def test_batch_key_absent_lists_columns(small_h5ad):
    before = file_digest(small_h5ad)
    with pytest.raises(InputError) as err:
        read_for_training(small_h5ad, batch_key="sample")
    message = str(err.value)
    assert "'sample'" in message and "data.batch_key" in message
    assert "'batch'" in message and "'cell_type'" in message
    assert file_digest(small_h5ad) == before


def test_label_key_absent_lists_columns(small_h5ad):
    with pytest.raises(InputError) as err:
        read_for_training(small_h5ad, label_key="celltype")
    message = str(err.value)
    assert "'celltype'" in message and "data.label_key" in message
    assert "'batch'" in message and "'cell_type'" in message


def test_batch_with_missing_values(small_adata, write_h5ad):
    small_adata.obs["batch"] = small_adata.obs["batch"].astype(object)
    small_adata.obs.iloc[[3, 9], small_adata.obs.columns.get_loc("batch")] = np.nan
    path = write_h5ad(small_adata)
    with pytest.raises(InputError, match=r"'batch' has 2 missing values"):
        read_for_training(path)


def test_counts_layer_absent_lists_layers(small_adata, write_h5ad):
    small_adata.layers["spliced"] = small_adata.X.copy()
    small_adata.layers["unspliced"] = small_adata.X.copy()
    path = write_h5ad(small_adata)
    with pytest.raises(InputError) as err:
        read_for_training(path, counts_layer="counts")
    message = str(err.value)
    assert "'counts'" in message
    assert "'spliced'" in message and "'unspliced'" in message


def test_counts_layer_absent_no_layers(small_h5ad):
    with pytest.raises(InputError) as err:
        read_for_training(small_h5ad, counts_layer="counts")
    assert "'counts'" in str(err.value) and "(none)" in str(err.value)


def test_counts_layer_is_read_instead_of_x(small_adata, write_h5ad):
    raw = small_adata.X.copy()
    small_adata.layers["counts"] = sp.csr_matrix(raw)
    small_adata.X = np.log1p(raw / raw.sum(axis=1, keepdims=True) * 1e4).astype(np.float32)
    path = write_h5ad(small_adata)
    with pytest.raises(InputError):  # X is log-normalized: not counts
        read_for_training(path)
    inp = read_for_training(path, counts_layer="counts")
    np.testing.assert_array_equal(inp.counts.toarray(), raw)


# --------------------------------------------------------------------------------------------
# Values


def test_negative_values_are_not_counts(small_adata, write_h5ad):
    X = small_adata.X.copy()
    X[0, np.flatnonzero(X[0])[:4]] *= -1  # 4 negative values
    small_adata.X = X
    path = write_h5ad(small_adata)
    before = file_digest(path)
    with pytest.raises(InputError) as err:
        read_for_training(path, scale="counts")
    message = str(err.value)
    assert "not hold raw counts" in message
    assert "4 negative values: scaled or z-scored data" in message and "data.scale=log" not in message
    with pytest.raises(InputError, match="4 negative values: data.scale=log expects log-normalized"):
        read_for_training(path, scale="log")  # z-scored or scaled values are no log expression either
    assert file_digest(path) == before


def test_log_normalized_values_are_not_counts(small_adata, write_h5ad):
    raw = small_adata.X
    X = np.log1p(raw / raw.sum(axis=1, keepdims=True) * 1e4).astype(np.float32)
    small_adata.X = X
    path = write_h5ad(small_adata)
    n_fraction = int(((X != np.round(X)) & (X != 0)).sum())
    assert n_fraction > 1000
    with pytest.raises(InputError) as err:
        read_for_training(path)
    message = str(err.value)
    assert "not hold raw counts" in message and "data.scale=log" in message
    assert f"{n_fraction} non-integer" in message
    inp = read_for_training(path, scale="log")
    np.testing.assert_allclose(inp.counts.toarray(), X)


@pytest.mark.parametrize("scale", ["counts", "log"])
def test_nan_and_inf_are_counted(small_adata, write_h5ad, scale):
    X = small_adata.X.copy()
    X[1, 2] = np.nan
    X[5, 7] = np.nan
    X[10, 0] = np.nan
    X[20, 3] = np.inf
    X[30, 4] = -np.inf
    small_adata.X = X
    path = write_h5ad(small_adata)
    with pytest.raises(InputError) as err:
        read_for_training(path, scale=scale)
    assert "5 NaN or infinite" in str(err.value)


def test_nan_in_sparse_matrix_counted(small_adata, write_h5ad):
    X = sp.csr_matrix(small_adata.X)
    X.data[:6] = np.nan
    small_adata.X = X
    path = write_h5ad(small_adata)
    with pytest.raises(InputError, match=r"\b6 NaN or infinite"):
        read_for_training(path)


# --------------------------------------------------------------------------------------------
# Batches


def test_single_batch_rejected_for_training(small_adata, write_h5ad):
    one = small_adata[small_adata.obs["batch"] == "sc_dropseq"].copy()
    path = write_h5ad(one)
    with pytest.raises(InputError) as err:
        read_for_training(path, batch_key="batch")
    message = str(err.value)
    assert "sc_dropseq" in message and "two batches" in message and "'batch'" in message


def test_batch_key_naming_a_constant_column(small_adata, write_h5ad):
    small_adata.obs["donor"] = "d1"
    path = write_h5ad(small_adata)
    with pytest.raises(InputError, match=r"found one: \['d1'\]"):
        read_for_training(path, batch_key="donor")
    assert read_for_training(path, batch_key="batch").counts.shape[0] == N_SUBSET_CELLS


def test_batch_left_with_only_empty_cells_rejected(small_adata, write_h5ad):
    """Two batches in the file, but every cell of one is empty: training sees one batch."""
    two = small_adata[small_adata.obs["batch"].isin(["sc_dropseq", "sc_celseq2"])].copy()
    X = two.X.copy()
    X[(two.obs["batch"] == "sc_celseq2").to_numpy()] = 0
    two.X = X
    path = write_h5ad(two)
    with pytest.raises(InputError) as err:
        read_for_training(path)
    message = str(err.value)
    assert "found one: ['sc_dropseq']" in message
    assert "only empty cells: ['sc_celseq2']" in message


# --------------------------------------------------------------------------------------------
# Empty cells and genes


def test_empty_cells_and_genes_dropped_with_log(small_adata, write_h5ad, caplog):
    X = small_adata.X.copy()
    empty_cells = np.array([0, 17, 55, 101, 150, 170, 199])
    empty_genes = np.array([3, 40, 99, 100, 250, 333, 400, 512, 513, 590, 599])
    X[empty_cells] = 0
    X[:, empty_genes] = 0
    small_adata.X = X
    # preconditions: exactly these are empty
    assert set(np.flatnonzero(X.sum(axis=1) == 0)) == set(empty_cells)
    assert set(np.flatnonzero(X.sum(axis=0) == 0)) == set(empty_genes)
    path = write_h5ad(small_adata)
    with caplog.at_level(logging.INFO, logger="batchfix.data.io"):
        inp = read_for_training(path, label_key="cell_type")
    text = caplog.text
    assert f"Dropped 7 empty cells (no non-zero values) of {N_SUBSET_CELLS}" in text
    assert f"Dropped 11 empty genes (no non-zero values) of {N_SUBSET_GENES}" in text

    keep_cells = np.setdiff1d(np.arange(N_SUBSET_CELLS), empty_cells)
    keep_genes = np.setdiff1d(np.arange(N_SUBSET_GENES), empty_genes)
    assert inp.counts.shape == (len(keep_cells), len(keep_genes))
    np.testing.assert_array_equal(inp.counts.toarray(), X[keep_cells][:, keep_genes])
    assert list(inp.obs_names) == list(small_adata.obs_names[keep_cells])
    assert list(inp.var.index) == list(small_adata.var_names[keep_genes])
    np.testing.assert_array_equal(inp.batch, small_adata.obs["batch"].astype(str).to_numpy()[keep_cells])
    assert list(inp.var["gene_symbol"].astype(str)) == list(
        small_adata.var["gene_symbol"].astype(str).to_numpy()[keep_genes])


def test_no_drop_log_when_nothing_is_empty(small_h5ad, caplog):
    with caplog.at_level(logging.INFO, logger="batchfix.data.io"):
        inp = read_for_training(small_h5ad)
    assert "Dropped" not in caplog.text
    assert inp.counts.shape == (N_SUBSET_CELLS, N_SUBSET_GENES)


def test_explicit_zeros_in_sparse_input_count_as_empty(small_adata, write_h5ad, caplog):
    X = sp.csr_matrix(small_adata.X)
    row = X.indptr[4], X.indptr[5]
    X.data[row[0]:row[1]] = 0  # stored zeros: cell 4 is empty
    small_adata.X = X
    path = write_h5ad(small_adata)
    with caplog.at_level(logging.INFO, logger="batchfix.data.io"):
        inp = read_for_training(path)
    assert "Dropped 1 empty cells" in caplog.text
    assert small_adata.obs_names[4] not in set(inp.obs_names)


def test_all_empty_matrix_rejected(small_adata, write_h5ad):
    small_adata.X = np.zeros_like(small_adata.X)
    path = write_h5ad(small_adata)
    with pytest.raises(InputError) as err:
        read_for_training(path)
    assert str(path) in str(err.value) and "no non-empty" in str(err.value)


def test_float16_counts_are_read_exactly(small_adata, write_h5ad):
    """Counts stored as float16 (whole numbers up to 2048 are exact there) arrive as the same float32 counts."""
    counts = np.asarray(small_adata.X, dtype=np.float64)
    counts[0, :3] = [2047, 2048, 1025]
    small_adata.X = counts.astype(np.float16)
    assert (small_adata.X.astype(np.float64) == counts).all()  # the file holds these counts exactly
    read = expression_input(read_h5ad(write_h5ad(small_adata, "float16.h5ad")), DataKeys())
    assert read.counts.dtype == np.float32 and (read.counts.toarray() == counts).all()


def test_a_condition_constant_within_each_batch_is_named_with_its_de_route(caplog):
    from batchfix.data.io import batch_level_columns

    batch = np.array(["d1", "d1", "d2", "d3", "d3", "d4"])
    columns = {"disease": ["covid", "covid", "healthy", "covid", "covid", "healthy"],  # per donor: named
               "sample": ["s1", "s1", "s2", "s3", "s3", "s4"],  # another name of the batch: not a condition
               "cell_type": ["T", "B", "T", "T", "B", "B"],  # varies within a batch
               "batch": batch}
    assert batch_level_columns(columns.items(), batch, "batch") == ["disease"]
    assert "obs column 'disease' is constant within each batch (covid: d1, d3; healthy: d2, d4)" in caplog.text
    assert "~disease with the batches as replicates" in caplog.text


def test_missing_batch_values_name_the_cells_and_what_to_do(small_adata, write_h5ad):
    small_adata.obs["batch"] = small_adata.obs["batch"].astype(object)
    small_adata.obs.iloc[[3, 9], small_adata.obs.columns.get_loc("batch")] = np.nan
    cells = small_adata.obs_names[[3, 9]].tolist()
    with pytest.raises(InputError) as err:
        read_for_training(write_h5ad(small_adata))
    assert str(err.value) == (f"obs column 'batch' has 2 missing values (cells {cells}): every cell needs one. Drop "
                              "those cells (adata[adata.obs['batch'].notna()]) or fill them in.")
