"""Correction with a trained checkpoint: files in, files out, on real data.

A tiny model is trained once for the module on three of the five batches of a real subset
(conftest: 200 cells x 600 genes); the correction tests then use the full subset, whose other
two batches the model never saw.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io as stdio
import logging
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch

import batchfix
from batchfix.config import CorrectConfig, ResolvedCorrection, validated
from batchfix.correction import outputs
from batchfix.correction.writers import correct_file
from batchfix.data import ondisk
from batchfix.data.normalize import log_cp10k
from batchfix.errors import CheckpointError, InputError
from batchfix.training.trained import load_trained

ROOT = Path(__file__).resolve().parents[2]
TRAINING_BATCHES = 3
N_TOP_GENES = 300


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def dense(matrix) -> np.ndarray:
    return matrix.toarray() if sp.issparse(matrix) else np.asarray(matrix)


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def trained_run(subset, tmp_path_factory) -> dict:
    """Train a tiny model (1 epoch) on the subset's first three batches; return its paths and batches."""
    from hydra import compose, initialize_config_module

    from batchfix import tasks
    from batchfix.config import TrainConfig

    folder = tmp_path_factory.mktemp("trained")
    batches = sorted(subset.obs["batch"].astype(str).unique())
    seen = batches[:TRAINING_BATCHES]
    training = subset[subset.obs["batch"].astype(str).isin(seen)].copy()
    training.write_h5ad(folder / "train.h5ad")
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        cfg = compose("train", overrides=[
            f"data.path={folder / 'train.h5ad'}", f"data.n_top_genes={N_TOP_GENES}", "model.genes_per_token=16",
            "trainer.max_epochs=1", "trainer.enable_progress_bar=false", "evaluate=false", "threads=1",
        ])
    torch.set_num_threads(1)
    tasks.train(validated(cfg, TrainConfig), folder / "run")
    checkpoint = folder / "run" / "model.ckpt"
    assert checkpoint.is_file()
    return {"checkpoint": checkpoint, "seen": seen, "unseen": batches[TRAINING_BATCHES:],
            "genes": load_trained(checkpoint).genes}


@pytest.fixture
def rich_input(subset, tmp_path) -> tuple[ad.AnnData, Path]:
    """The subset with everything a real file carries besides X, written to tmp_path/input.h5ad."""
    adata = subset.copy()
    rng = np.random.default_rng(1)
    adata.layers["counts"] = sp.csr_matrix(adata.X)
    adata.layers["scaled"] = (adata.X / 2).astype(np.float32)
    adata.obsm["X_pca"] = rng.normal(size=(adata.n_obs, 5)).astype(np.float32)
    adata.obsp["connectivities"] = sp.random(adata.n_obs, adata.n_obs, density=0.02, format="csr", random_state=0)
    adata.varm["loadings"] = rng.normal(size=(adata.n_vars, 3))
    adata.uns["note"] = "kept as is"
    adata.uns["params"] = {"k": 3, "names": ["a", "b"]}
    adata.obs["qc"] = rng.random(adata.n_obs)
    path = tmp_path / "input.h5ad"
    adata.write_h5ad(path)
    return adata, path


def correct_quiet(source, target, checkpoint, counts_layer=None, overwrite=False, **options) -> Path:
    """correct_file with the checkpoint loaded and `options` as its ResolvedCorrection, no progress bar."""
    return correct_file(source, target, load_trained(checkpoint), ResolvedCorrection(**options),
                        counts_layer=counts_layer, overwrite=overwrite, progress=False)


def check_gene_flags(out: ad.AnnData, adata: ad.AnnData, trained_run: dict) -> np.ndarray:
    """var's modelled genes (also var['highly_variable'], which the input lacks) and corrected genes (every gene
    detected in 3 training cells); returns the corrected ones' mask."""
    modelled = out.var["batchfix_modelled"].to_numpy()
    order = list(out.var_names).index
    assert modelled.dtype == bool and list(out.var_names[modelled]) == sorted(trained_run["genes"], key=order)
    np.testing.assert_array_equal(out.var["highly_variable"], modelled)
    corrected = out.var["batchfix_corrected"].to_numpy()
    seen = adata.obs["batch"].astype(str).isin(trained_run["seen"]).to_numpy()
    detected = np.asarray((dense(adata.X)[seen] > 0).sum(axis=0)).ravel()
    np.testing.assert_array_equal(corrected, detected >= 3)
    assert corrected[modelled].all()
    return corrected


def check_count_layers(out: ad.AnnData, counts_in) -> None:
    """The counts output of `out` (corrected from `counts_in`): layers['batchfix_counts'] of integer counts, the
    genes not in var['batchfix_corrected'] as in the input, and layers['batchfix'] their normalize_total + log1p,
    both CSR float32 of the full width with no stored zeros."""
    counts, log_layer = out.layers["batchfix_counts"], out.layers["batchfix"]
    for layer in (counts, log_layer):
        assert isinstance(layer, sp.csr_matrix) and layer.dtype == np.float32 and layer.shape == out.shape
        assert np.isfinite(layer.data).all() and (layer.data > 0).all(), "zeros are not stored"
    assert (counts.data == np.round(counts.data)).all(), "corrected counts are integers"
    corrected = out.var["batchfix_corrected"].to_numpy()
    raw = sp.csr_matrix(dense(counts_in), dtype=np.float32)
    assert (counts[:, ~corrected] != raw[:, ~corrected]).nnz == 0, "the other genes keep their input counts"
    np.testing.assert_allclose(dense(log_layer), dense(log_cp10k(counts)), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The file route


@pytest.mark.parametrize("storage", ["dense", "csr"])
def test_round_trip_keeps_everything_and_adds_the_correction(trained_run, rich_input, tmp_path, storage):
    adata, source = rich_input
    if storage == "csr":
        adata.X = sp.csr_matrix(adata.X)
        source = tmp_path / "input_csr.h5ad"
        adata.write_h5ad(source)
    before = sha256(source)
    target = tmp_path / "out" / "corrected.h5ad"

    assert correct_quiet(source, target, trained_run["checkpoint"], chunk_size=64) == target

    assert sha256(source) == before, "the input file was modified"
    assert files_in(target.parent) == ["corrected.h5ad"], "a temporary file was left behind"
    out = ad.read_h5ad(target)
    assert list(out.obs_names) == list(adata.obs_names) and list(out.var_names) == list(adata.var_names)
    np.testing.assert_array_equal(dense(out.X), dense(adata.X))
    assert sp.issparse(out.X) == sp.issparse(adata.X)
    for name in ("counts", "scaled"):
        np.testing.assert_array_equal(dense(out.layers[name]), dense(adata.layers[name]))
    pd.testing.assert_frame_equal(out.obs, adata.obs)
    added = ["batchfix_modelled", "batchfix_corrected", "highly_variable"]  # the input has no HVG column
    coordinates = ["chromosome", "start", "end"]  # rewritten as infercnvpy reads them ('chr1', ...)
    pd.testing.assert_frame_equal(out.var.drop(columns=added + coordinates), adata.var.drop(columns=coordinates))
    placed = adata.var["chromosome"].notna().to_numpy()
    np.testing.assert_array_equal(out.var["chromosome"].astype(str)[placed],
                                  "chr" + adata.var["chromosome"].astype(str)[placed])
    np.testing.assert_array_equal(out.obsm["X_pca"], adata.obsm["X_pca"])
    np.testing.assert_array_equal(dense(out.obsp["connectivities"]), dense(adata.obsp["connectivities"]))
    np.testing.assert_array_equal(out.varm["loadings"], adata.varm["loadings"])
    assert out.uns["note"] == "kept as is" and out.uns["params"]["k"] == 3
    assert list(out.uns["params"]["names"]) == ["a", "b"]

    corrected = check_gene_flags(out, adata, trained_run)
    check_count_layers(out, adata.X)
    latent = out.obsm["X_batchfix"]
    assert latent.shape == (adata.n_obs, load_trained(trained_run["checkpoint"]).module.model_config.latent_dim)
    assert np.isfinite(latent).all()

    info = out.uns["batchfix"]
    assert info["version"] == batchfix.__version__
    assert info["checkpoint_sha256"] == sha256(trained_run["checkpoint"])
    assert info["reference_batch"] == "average"
    assert info["output_mode"] == info["params"]["output_mode"] == "counterfactual"
    assert list(info["modelled_genes"]) == trained_run["genes"]
    assert list(info["training_batches"]) == trained_run["seen"]
    assert info["n_missing_genes"] == 0 and len(info["missing_genes"]) == 0
    assert set(info["layers"]) == {"batchfix", "batchfix_counts"}
    assert (info["n_corrected_genes"], info["n_uncorrected_genes"]) == (corrected.sum(), (~corrected).sum())
    assert 0 < info["n_zeros_made_positive"] < info["n_observed_zeros"]
    assert info["params"]["chunk_size"] == 64 and info["params"]["model"]["genes_per_token"] == 16


def test_output_is_valid_anndata_in_backed_mode(trained_run, rich_input, tmp_path):
    _, source = rich_input
    target = correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"])
    backed = ad.read_h5ad(target, backed="r")
    try:
        rows = backed.layers["batchfix"][10:20]
        assert rows.shape == (10, backed.n_vars)
    finally:
        backed.file.close()
    with h5py.File(target, "r") as f:
        assert dict(f["layers/batchfix"].attrs)["encoding-type"] == "csr_matrix"
        assert dict(f["obsm/X_batchfix"].attrs)["encoding-type"] == "array"


def test_the_file_gene_order_does_not_change_the_correction(trained_run, rich_input, tmp_path):
    """Genes go into genomic order on the way in and back to the file's order on the way out: a file
    with its genes shuffled gets, gene by gene, the same corrected values and the same latent."""
    adata, source = rich_input
    permutation = np.random.default_rng(3).permutation(adata.n_vars)
    shuffled = adata[:, permutation].copy()
    shuffled.write_h5ad(tmp_path / "shuffled.h5ad")
    original = ad.read_h5ad(correct_quiet(source, tmp_path / "a.h5ad", trained_run["checkpoint"]))
    reordered = ad.read_h5ad(correct_quiet(tmp_path / "shuffled.h5ad", tmp_path / "b.h5ad", trained_run["checkpoint"]))
    assert list(reordered.var_names) == list(adata.var_names[permutation])
    back = reordered[:, adata.var_names]
    np.testing.assert_allclose(dense(back.layers["batchfix"]), dense(original.layers["batchfix"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(back.var["batchfix_modelled"], original.var["batchfix_modelled"])
    np.testing.assert_allclose(reordered.obsm["X_batchfix"], original.obsm["X_batchfix"], rtol=1e-5, atol=1e-5)
    assert not np.allclose(dense(reordered.layers["batchfix"]), dense(original.layers["batchfix"])), \
        "the shuffle moved modelled genes to other columns"


def test_unseen_batches_are_corrected(trained_run, rich_input, tmp_path):
    adata, source = rich_input
    unseen = adata.obs["batch"].astype(str).isin(trained_run["unseen"]).to_numpy()
    assert unseen.sum() == 80, "two of the five batches (40 cells each) were not in the training data"
    out = ad.read_h5ad(correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"]))
    modelled = out.var["batchfix_modelled"].to_numpy()
    values = dense(out.layers["batchfix"][unseen][:, modelled])
    assert np.isfinite(values).all() and (values >= 0).all()
    assert np.isfinite(out.obsm["X_batchfix"][unseen]).all()
    assert list(out.uns["batchfix"]["unseen_batches_estimated"]) == trained_run["unseen"]
    # Decoded as one training batch, unseen cells get that batch's expression profile.
    reference = trained_run["seen"][0]
    as_reference = batchfix.correct(adata, trained_run["checkpoint"], reference=reference, copy=True)
    assert as_reference.uns["batchfix"]["reference_batch"] == reference
    assert not np.allclose(dense(as_reference.layers["batchfix"][unseen]), dense(out.layers["batchfix"][unseen]))


def test_unknown_reference_batch_names_the_training_batches(trained_run, rich_input, tmp_path):
    _, source = rich_input
    with pytest.raises(InputError, match="not one the model was trained on") as err:
        correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"], reference="nope")
    assert trained_run["seen"][0] in str(err.value)
    assert files_in(tmp_path) == ["input.h5ad"]


def test_some_missing_genes_are_filled_and_reported(trained_run, rich_input, tmp_path, caplog):
    adata, _ = rich_input
    genes = trained_run["genes"]
    dropped = genes[::20]  # 5% of the modelled genes
    source = tmp_path / "missing.h5ad"
    adata[:, ~adata.var_names.isin(dropped)].copy().write_h5ad(source)

    with caplog.at_level(logging.WARNING, logger="batchfix"):
        out = ad.read_h5ad(correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"]))
    assert f"{len(dropped)} of {len(genes)} modelled genes missing" in caplog.text
    info = out.uns["batchfix"]
    assert info["n_missing_genes"] == len(dropped) and list(info["missing_genes"]) == dropped
    assert out.var["batchfix_modelled"].sum() == len(genes) - len(dropped)
    corrected = out.var["batchfix_corrected"].to_numpy()
    assert corrected[out.var["batchfix_modelled"].to_numpy()].all() and info["n_corrected_genes"] == corrected.sum()
    check_count_layers(out, adata[:, ~adata.var_names.isin(dropped)].X)


def test_too_many_missing_genes_stop_with_the_count(trained_run, rich_input, tmp_path):
    adata, _ = rich_input
    genes = trained_run["genes"]
    dropped = genes[: len(genes) // 2]
    source = tmp_path / "missing.h5ad"
    adata[:, ~adata.var_names.isin(dropped)].copy().write_h5ad(source)
    with pytest.raises(InputError, match=f"{len(dropped)} of the model's {len(genes)} genes"):
        correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"], max_missing_fraction=0.2)
    assert files_in(tmp_path) == ["input.h5ad", "missing.h5ad"]
    # The share is configurable.
    correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"], max_missing_fraction=0.6)
    assert (tmp_path / "out.h5ad").is_file()


def test_existing_output_is_refused_and_left_unchanged(trained_run, rich_input, tmp_path):
    _, source = rich_input
    target = tmp_path / "out.h5ad"
    target.write_bytes(b"an earlier result")
    with pytest.raises(FileExistsError, match="overwrite=true"):
        correct_quiet(source, target, trained_run["checkpoint"])
    assert target.read_bytes() == b"an earlier result"
    assert files_in(tmp_path) == ["input.h5ad", "out.h5ad"]

    correct_quiet(source, target, trained_run["checkpoint"], overwrite=True)
    assert "batchfix" in ad.read_h5ad(target).layers
    with pytest.raises(InputError, match="is the input file"):
        correct_quiet(source, source, trained_run["checkpoint"], overwrite=True)


@pytest.mark.parametrize("failing_step", ["first chunk", "third chunk", "last write"])
def test_crash_while_writing_leaves_no_output_and_no_temporary_file(trained_run, rich_input, tmp_path, monkeypatch,
                                                                   failing_step):
    _, source = rich_input
    before = sha256(source)
    if failing_step == "last write":
        def fail(*args, **kwargs):
            raise RuntimeError("disk full (simulated)")

        monkeypatch.setattr(ondisk, "write_uns_entry", fail)
    else:
        fail_at = 0 if failing_step == "first chunk" else 2
        real_apply = outputs.OutputKind.apply
        calls = []

        def apply(self, chunk, first_cell=0):
            calls.append(first_cell)
            if len(calls) > fail_at:
                raise RuntimeError("killed (simulated)")
            return real_apply(self, chunk, first_cell)

        monkeypatch.setattr(outputs.OutputKind, "apply", apply)

    with pytest.raises(RuntimeError, match="simulated"):
        correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"], chunk_size=50)
    assert files_in(tmp_path) == ["input.h5ad"], "partial output or temporary file left behind"
    assert sha256(source) == before

    # With overwrite=true the previous output survives a failed run.
    (tmp_path / "out.h5ad").write_bytes(b"previous")
    with pytest.raises(RuntimeError, match="simulated"):
        correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"], chunk_size=50, overwrite=True)
    assert (tmp_path / "out.h5ad").read_bytes() == b"previous"
    assert files_in(tmp_path) == ["input.h5ad", "out.h5ad"]


def test_counts_layer_is_read_instead_of_x(trained_run, rich_input, tmp_path):
    adata, source = rich_input
    from_x = ad.read_h5ad(correct_quiet(source, tmp_path / "x.h5ad", trained_run["checkpoint"]))
    logged = adata.copy()
    logged.X = np.log1p(logged.X)  # X no longer holds counts; the counts layer does
    path = tmp_path / "logged.h5ad"
    logged.write_h5ad(path)
    with pytest.raises(InputError, match="does not hold raw counts"):
        correct_quiet(path, tmp_path / "bad.h5ad", trained_run["checkpoint"])
    from_layer = ad.read_h5ad(correct_quiet(path, tmp_path / "layer.h5ad", trained_run["checkpoint"],
                                            counts_layer="counts"))
    np.testing.assert_array_equal(from_layer.layers["batchfix"].toarray(), from_x.layers["batchfix"].toarray())
    with pytest.raises(InputError, match="Layers present"):
        correct_quiet(path, tmp_path / "none.h5ad", trained_run["checkpoint"], counts_layer="raw")


def test_correcting_a_corrected_file_replaces_the_earlier_correction(trained_run, rich_input, tmp_path):
    _, source = rich_input
    first = correct_quiet(source, tmp_path / "first.h5ad", trained_run["checkpoint"])
    second = correct_quiet(first, tmp_path / "second.h5ad", trained_run["checkpoint"],
                           reference=trained_run["seen"][0])
    earlier, out = ad.read_h5ad(first), ad.read_h5ad(second)
    assert out.uns["batchfix"]["reference_batch"] == trained_run["seen"][0]
    assert list(out.var.columns) == list(earlier.var.columns) and set(out.layers) == set(earlier.layers)
    np.testing.assert_array_equal(out.obsm["X_batchfix"], earlier.obsm["X_batchfix"])  # the latent: same cells
    assert not np.allclose(dense(out.layers["batchfix_counts"]), dense(earlier.layers["batchfix_counts"]))
    # The earlier layers are replaced, not read: the same as correcting the input with that reference.
    direct = ad.read_h5ad(correct_quiet(source, tmp_path / "direct.h5ad", trained_run["checkpoint"],
                                        reference=trained_run["seen"][0]))
    for name in ("batchfix_counts", "batchfix"):
        assert (out.layers[name] != direct.layers[name]).nnz == 0, name


# --------------------------------------------------------------------------------------------
# In memory (the notebook API) against the file route


@pytest.mark.parametrize("output_mode", ["counterfactual", "denoised"])
def test_streaming_and_in_memory_give_the_same_numbers(trained_run, rich_input, tmp_path, output_mode):
    adata, source = rich_input
    streamed = ad.read_h5ad(correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"], chunk_size=37,
                                          output_mode=output_mode))
    in_memory = adata.copy()
    assert batchfix.correct(in_memory, trained_run["checkpoint"], output_mode=output_mode) is None
    assert in_memory.uns["batchfix"]["output_mode"] == streamed.uns["batchfix"]["output_mode"] == output_mode
    layer = in_memory.layers["batchfix"]
    assert isinstance(layer, sp.csr_matrix)
    np.testing.assert_array_equal(layer.indices, streamed.layers["batchfix"].indices)
    np.testing.assert_array_equal(layer.indptr, streamed.layers["batchfix"].indptr)
    np.testing.assert_allclose(layer.data, streamed.layers["batchfix"].data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(in_memory.obsm["X_batchfix"], streamed.obsm["X_batchfix"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(in_memory.var["batchfix_modelled"], streamed.var["batchfix_modelled"])
    assert in_memory.uns["batchfix"]["checkpoint_sha256"] == streamed.uns["batchfix"]["checkpoint_sha256"]


def test_api_errors_leave_the_anndata_unchanged(trained_run, subset):
    adata = subset.copy()
    with pytest.raises(InputError, match="Layer 'raw' not found"):
        batchfix.correct(adata, trained_run["checkpoint"], counts_layer="raw")
    with pytest.raises(InputError, match="are missing from the input"):
        batchfix.correct(adata[:, ~adata.var_names.isin(trained_run["genes"])].copy(), trained_run["checkpoint"])
    with pytest.raises(InputError, match="not one the model was trained on"):
        batchfix.correct(adata, trained_run["checkpoint"], reference=trained_run["unseen"][0])
    assert not adata.layers and not adata.obsm and not adata.uns and "batchfix_modelled" not in adata.var


def test_api_copy_and_key_added(trained_run, subset):
    adata = subset.copy()
    result = batchfix.correct(adata, trained_run["checkpoint"], key_added="bf", copy=True)
    assert set(adata.layers) == set() and "X_bf" not in adata.obsm and "bf" not in adata.uns, "input changed"
    assert {"bf", "bf_counts"} == set(result.layers) == set(result.uns["bf"]["layers"])
    assert "X_bf" in result.obsm and {"bf_modelled", "bf_corrected"} <= set(result.var)
    assert result.uns["bf"]["n_modelled_genes"] == len(trained_run["genes"])
    np.testing.assert_array_equal(result.X, adata.X)


# --------------------------------------------------------------------------------------------
# Checkpoints that must not load


class Payload:
    """Would create `marker` if unpickled with full pickle powers."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


class Arbitrary:
    """Some class that is not a tensor or a plain value."""

    value = 1


def test_tampered_checkpoint_is_refused_without_running_its_code(trained_run, rich_input, tmp_path):
    _, source = rich_input
    saved = torch.load(trained_run["checkpoint"], map_location="cpu", weights_only=True)
    marker = tmp_path / "code-was-executed"
    malicious = tmp_path / "malicious.ckpt"
    torch.save({**saved, "callbacks": Payload(marker)}, malicious)
    arbitrary = tmp_path / "arbitrary.ckpt"
    torch.save({**saved, "hyper_parameters": {**saved["hyper_parameters"], "extra": Arbitrary()}}, arbitrary)
    for path in (malicious, arbitrary):
        with pytest.raises(CheckpointError, match="refused for safety"):
            load_trained(path)
        with pytest.raises(CheckpointError):
            correct_quiet(source, tmp_path / "out.h5ad", path)
    assert not marker.exists(), "code from the checkpoint ran"
    assert not (tmp_path / "out.h5ad").exists()

    # A pickle edited inside the zip archive (its data.pkl replaced by one calling os.makedirs).
    edited = tmp_path / "edited.ckpt"
    with zipfile.ZipFile(trained_run["checkpoint"]) as zin, zipfile.ZipFile(edited, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = pickle.dumps(Payload(marker), protocol=2)
            zout.writestr(item, data)
    with pytest.raises(CheckpointError, match="refused for safety"):
        load_trained(edited)
    assert not marker.exists()


def test_truncated_and_foreign_checkpoints_give_clear_errors(trained_run, tmp_path):
    data = Path(trained_run["checkpoint"]).read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        load_trained(truncated)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        load_trained(empty)
    foreign = tmp_path / "foreign.ckpt"
    buffer = stdio.BytesIO()
    torch.save({"weights": torch.zeros(3)}, buffer)
    foreign.write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError, match="not a batchfix checkpoint"):
        load_trained(foreign)
    with pytest.raises(CheckpointError, match="not found"):
        load_trained(tmp_path / "nowhere.ckpt")


# --------------------------------------------------------------------------------------------
# The command line


def test_cli_writes_the_output_and_reports_errors(trained_run, rich_input, tmp_path):
    _, source = rich_input
    target = tmp_path / "cli.h5ad"
    args = ["correct", f"input={source}", f"output={target}", f"checkpoint={trained_run['checkpoint']}",
            f"correction.reference={trained_run['seen'][1]}", "inference.chunk_size=64", "threads=1", "progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "batchfix", *args], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert files_in(tmp_path) == ["cli.h5ad", "input.h5ad"], "correct wrote more than its output"
    out = ad.read_h5ad(target)
    assert out.uns["batchfix"]["reference_batch"] == trained_run["seen"][1]
    assert out.var["batchfix_modelled"].sum() == len(trained_run["genes"])
    assert set(out.layers) >= {"batchfix", "batchfix_counts"} and out.layers["batchfix_counts"].nnz > 0

    # The same options again are refused (checked in this process: a new one takes long to start).
    from hydra import compose, initialize_config_module

    from batchfix import tasks

    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        cfg = validated(compose("correct", overrides=args[1:]), CorrectConfig)
    before = sha256(target)
    with pytest.raises(FileExistsError, match="exists; pass overwrite=true"):
        tasks.correct(cfg)
    assert sha256(target) == before


@pytest.mark.parametrize("output_mode", ["counterfactual", "denoised"])
def test_fused_attention_of_the_correction_changes_values_by_float_noise_only(trained_run, subset, output_mode,
                                                                               counts_nearly_equal):
    """Correction runs the attention through torch's fused kernel: the written-out guarded softmax gives the
    same values up to float rounding (counts: a count on a quantile boundary may move by one), and the model's
    own backend is left as it was."""
    from batchfix.correction.corrector import BoundModel
    from batchfix.correction.estimates import estimate
    from batchfix.nn.attention import MultiHeadSelfAttention

    model = load_trained(trained_run["checkpoint"])
    attention = [m for m in model.net.modules() if isinstance(m, MultiHeadSelfAttention)]
    assert attention and all(m.backend == "guarded" for m in attention)
    settings = ResolvedCorrection(output_mode=output_mode)
    batch = subset.obs["batch"].astype(str).to_numpy()
    bound = BoundModel(model, subset.var_names, settings, batch=batch, batch_key="batch", obs_names=subset.obs_names)
    output = outputs.output_kind(bound, *estimate(bound, ondisk.InMemoryRows(subset.X), subset.n_obs))
    fused_result = output.apply(subset.X, 0)
    fused_latent, fused = fused_result.latent, fused_result.layers
    assert all(m.backend == "guarded" for m in attention)  # restored
    with torch.inference_mode():
        written_result = output.rows_output(subset.X, 0)  # the guarded softmax, as trained
    written_latent, written = written_result.latent, written_result.layers
    assert set(fused) == set(written) == ({"counts", "log"} if output_mode == "counterfactual" else {"log"})
    if output_mode == "counterfactual":
        counts_nearly_equal(fused["counts"], written["counts"])  # measured: none differ
    else:
        np.testing.assert_allclose(fused["log"].toarray(), written["log"].toarray(), atol=1e-4)
    np.testing.assert_allclose(fused_latent, written_latent, atol=1e-4)


@pytest.mark.slow  # a train and corrects (4 s): with the slow checks, which CI runs
def test_correct_refuses_nan_or_infinite_values_in_genes_the_model_does_not_read(subset, tmp_path):
    """A NaN in any gene would spread through its cell's library to every corrected value of the cell: refused in
    one line naming the cells, the input untouched, no output."""
    from batchfix import tasks

    model = batchfix.train(subset, batch_key="batch", n_top_genes=200, genes_per_token=16, d_model=16, n_layers=1,
                           latent_dim=8, decoder_hidden=32, threads=1, max_epochs=1, enable_progress_bar=False)
    unread = np.flatnonzero(~subset.var_names.isin(model.genes))[:2]
    bad = subset.copy()
    bad.X[3, unread[0]], bad.X[7, unread[1]] = np.nan, np.inf
    path = tmp_path / "bad.h5ad"
    bad.write_h5ad(path)
    before = path.read_bytes()
    with pytest.raises(InputError, match=r"holds 2 NaN or infinite values; clean them first"):
        batchfix.correct(bad, model, copy=True)
    model.save(tmp_path / "model.ckpt")
    cfg = validated(dict(input=str(path), checkpoint=str(tmp_path / "model.ckpt"), output=str(tmp_path / "out.h5ad")),
                    CorrectConfig)
    with pytest.raises(InputError, match=r"in cells 0-\d+, holds 2 NaN or infinite values"):
        tasks.correct(cfg)
    assert path.read_bytes() == before and not (tmp_path / "out.h5ad").exists()
    assert load_trained(tmp_path / "model.ckpt").genes == model.genes


def test_the_model_checks_of_a_streamed_file_are_scored_on_any_subsample(trained_run, rich_input, tmp_path):
    """Detection calibration (issue 40) and the PIT from the checks `correct` stored while streaming the file
    (issue 54): the same on the whole file and on the subsample evaluate reads from disk, and the same as the
    in-memory correction stored."""
    from batchfix.data.io import OutputKeys
    from batchfix.eval import matrix_scores
    from batchfix.eval.evaluate import read_for_scoring

    _, source = rich_input
    path = correct_quiet(source, tmp_path / "out.h5ad", trained_run["checkpoint"])
    out = ad.read_h5ad(path)
    genes = out.var["batchfix_modelled"].to_numpy()
    part, subsample = read_for_scoring(path, "batch", "cell_type", 100, OutputKeys("batchfix"), None)
    assert subsample["n_cells"] == part.n_obs < out.n_obs
    whole, sampled = (matrix_scores.corrected_matrix_scores(adata, "batchfix", genes, "batch", "cell_type")
                      for adata in (out, part))
    for name in matrix_scores.MODEL_COLUMNS:  # stored over every checked cell, whatever evaluate reads
        assert whole[name] == sampled[name], name
    assert "batch-free" in whole["reference"] and 0 <= whole[matrix_scores.PIT_FAILS] < 0.5
    in_memory = ad.read_h5ad(source)
    batchfix.correct(in_memory, trained_run["checkpoint"])
    for name, values in out.uns["batchfix"]["model_checks"].items():
        np.testing.assert_array_equal(values, in_memory.uns["batchfix"]["model_checks"][name], err_msg=name)


def test_any_row_range_is_corrected_from_the_model_the_estimates_and_its_rows_alone(trained_run, subset,
                                                                                     counts_nearly_equal):
    """Estimate once, apply anywhere: row ranges corrected in any order give the rows of one pass over the file,
    and an output kind without the estimate pass's latents (a shard on another process) the same counts up to a
    quantile-boundary flip."""
    from batchfix.correction.corrector import BoundModel
    from batchfix.correction.estimates import estimate

    model = load_trained(trained_run["checkpoint"])
    batch = subset.obs["batch"].astype(str).to_numpy()
    bound = BoundModel(model, subset.var_names, ResolvedCorrection(batch_size=32), batch=batch, batch_key="batch",
                       obs_names=subset.obs_names)
    estimates, latents = estimate(bound, ondisk.InMemoryRows(subset.X), subset.n_obs)
    assert bound.batches.unseen  # the unseen batches' tables come from the estimate pass too
    with pytest.raises(dataclasses.FrozenInstanceError):
        estimates.state = None
    output = outputs.output_kind(bound, estimates, latents)
    whole = output.apply(subset.X, 0)
    for start, stop in ((160, 200), (64, 160), (0, 64)):  # backwards, forward batches aligned as in one pass
        part = output.apply(subset.X[start:stop], start)
        for kind in ("counts", "log"):
            assert (part.layers[kind] != whole.layers[kind][start:stop]).nnz == 0, kind
        np.testing.assert_array_equal(part.latent, whole.latent[start:stop])
    shard = outputs.output_kind(bound, estimates).apply(subset.X[100:170], 100)  # encoded again, other batches
    counts_nearly_equal(shard.layers["counts"], whole.layers["counts"][100:170])
    np.testing.assert_allclose(shard.latent, whole.latent[100:170], atol=1e-4)
    total = sum((output.apply(subset.X[s:s + 50], s).tallies for s in range(0, 200, 50)), outputs.Tallies())
    assert total == whole.tallies and total.n_zeros > 0


def test_the_estimates_are_recorded_in_the_provenance(trained_run, subset):
    out = batchfix.correct(subset, load_trained(trained_run["checkpoint"]), copy=True)
    recorded = out.uns["batchfix"]["estimates"]
    assert set(recorded["batches_with_mean_shift"]) == set(subset.obs["batch"].astype(str))
    assert recorded["state_shrink"] and recorded["regional_split"] == "decoder_term"
    assert recorded["gene_sets_with_count_tables"] >= 1


# --------------------------------------------------------------------------------------------
# What the output may replace: never a file the command reads, never what the input holds and batchfix did not write


def correct_task(source, target, checkpoint, key_added: str | None = None, overwrite: bool = False) -> Path:
    """`tasks.correct` as the command line runs it (key_added given on its command line when named)."""
    from batchfix import tasks
    from batchfix.config import CorrectionChoice

    cfg = validated(dict(input=str(source), output=str(target), checkpoint=str(checkpoint), overwrite=overwrite,
                         threads=1, progress=False), CorrectConfig)
    return tasks.correct(cfg, CorrectionChoice(None, {} if key_added is None else {"key_added": key_added}))


def test_the_checkpoint_is_never_the_output(trained_run, rich_input, tmp_path):
    import re
    import shutil

    _, source = rich_input
    checkpoint = Path(shutil.copy2(trained_run["checkpoint"], tmp_path / "model.ckpt"))
    before = sha256(checkpoint)
    with pytest.raises(InputError, match=rf"^The output {re.escape(str(checkpoint))} is the checkpoint file"):
        correct_task(source, checkpoint, checkpoint, overwrite=True)
    assert sha256(checkpoint) == before and files_in(tmp_path) == ["input.h5ad", "model.ckpt"]


def test_a_key_added_naming_what_the_input_holds_is_refused(trained_run, rich_input, tmp_path):
    """rich_input's layers['counts'] (its raw counts), obsm['X_pca'] and uns['params'] are the user's: key_added
    counts, pca or params would replace them, in a file or in memory."""
    adata, source = rich_input
    checkpoint = trained_run["checkpoint"]
    for key, clash in (("counts", r"layers\['counts'\]"), ("pca", r"obsm\['X_pca'\]"), ("params", r"uns\['params'\]")):
        with pytest.raises(InputError, match=rf"^correction.key_added={key} would replace the input's {clash},"):
            correct_task(source, tmp_path / "out.h5ad", checkpoint, key_added=key)
        with pytest.raises(InputError, match=rf"key_added={key} would replace the input's {clash},"):
            batchfix.correct(adata, checkpoint, key_added=key)
    assert files_in(tmp_path) == ["input.h5ad"]
    assert set(adata.layers) == {"counts", "scaled"} and set(adata.obsm) == {"X_pca"}
    np.testing.assert_array_equal(dense(adata.layers["counts"]), dense(adata.X))


@pytest.mark.slow  # two corrects in fresh processes (5 s): with the slow checks, which CI runs
def test_a_corrected_input_is_corrected_again_under_the_same_key(trained_run, rich_input, tmp_path):
    adata, source = rich_input
    checkpoint = trained_run["checkpoint"]
    first = correct_task(source, tmp_path / "first.h5ad", checkpoint, key_added="bf")
    second = correct_task(first, tmp_path / "second.h5ad", checkpoint, key_added="bf")
    out = ad.read_h5ad(second)
    assert set(out.layers) == {"counts", "scaled", "bf", "bf_counts"} == set(ad.read_h5ad(first).layers)
    np.testing.assert_array_equal(dense(out.layers["counts"]), dense(adata.X))  # the user's layer, as it was
    again = ad.read_h5ad(first)  # in memory: the file's correction, then the same again
    for _ in range(2):
        batchfix.correct(again, checkpoint, key_added="bf")
    assert again.uns["bf"]["layers"].keys() == out.uns["bf"]["layers"].keys()


def test_correct_names_a_condition_that_is_constant_within_each_batch(trained_run, subset, caplog):
    adata = subset.copy()
    first = sorted(adata.obs["batch"].astype(str).unique())[:2]
    adata.obs["disease"] = np.where(adata.obs["batch"].astype(str).isin(first), "case", "control")
    batchfix.correct(adata, load_trained(trained_run["checkpoint"]), copy=True)
    assert "obs column 'disease' is constant within each batch" in caplog.text


def test_repeated_cell_names_are_named_since_their_draws_are_shared(trained_run, subset, caplog):
    adata = subset.copy()
    adata.obs_names = ["cell"] * 10 + list(adata.obs_names[10:])
    batchfix.correct(adata, load_trained(trained_run["checkpoint"]), copy=True)
    assert "9 cells share their obs_name with an earlier cell" in caplog.text


def test_a_checkpoint_that_cannot_be_loaded_for_lack_of_memory_is_not_called_corrupt(trained_run, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(torch, "load", out_of_memory)
    with pytest.raises(MemoryError, match="simulated"):
        load_trained(trained_run["checkpoint"])
