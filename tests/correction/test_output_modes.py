"""The two output modes on a constructed case whose answer is known, on real counts.

Real counts (the 200-cell x 600-gene subset, five batches) get a pure per-batch effect on top:
every batch multiplies each gene's counts by its own whole number from 1 to 6 (whole numbers keep
them counts). What a correction should give back within a batch is then known: the cells' own
values before the multiplication. A tiny model is trained once on four of the five batches; the
fifth is a batch it never saw.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import subprocess
import sys

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from scipy.stats import spearmanr

import batchfix
from batchfix.config import CorrectConfig, ResolvedCorrection, TrainConfig, validated
from batchfix.correction import calibration
from batchfix.correction.writers import correct_file
from batchfix.data.normalize import log_cp10k
from batchfix.data.prepare import PreparedData
from batchfix.errors import ConfigError, InputError
from batchfix.nn import attention

N_TOP_GENES = 200
UNSEEN = "sc_dropseq"
TINY = dict(n_top_genes=N_TOP_GENES, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8,
            decoder_hidden=32, batch_size=64, max_epochs=30, threads=1, enable_progress_bar=False)


def dense(matrix) -> np.ndarray:
    return matrix.toarray() if sp.issparse(matrix) else np.asarray(matrix)


@pytest.fixture(scope="module")
def shifted(bundled_adata, _subset_index) -> ad.AnnData:
    """The real subset with each batch's counts multiplied per gene by a whole number in 1..6.

    layers['truth'] holds the counts before; uns['log_factor'] the log of each (batch, gene) factor.
    """
    cells, genes = _subset_index
    adata = bundled_adata[cells][:, genes].copy()
    truth = np.asarray(adata.X, dtype=np.float32)
    batches = sorted(adata.obs["batch"].astype(str).unique())
    factor = np.random.default_rng(7).integers(1, 7, size=(len(batches), adata.n_vars)).astype(np.float32)
    code = np.searchsorted(batches, adata.obs["batch"].astype(str).to_numpy())
    adata.X = truth * factor[code]
    adata.layers["truth"] = truth
    adata.uns["log_factor"] = pd.DataFrame(np.log(factor), index=batches, columns=adata.var_names)
    return adata


@pytest.fixture(scope="module")
def model(shifted) -> batchfix.BatchfixModel:
    torch.set_num_threads(1)
    seen = shifted[shifted.obs["batch"] != UNSEEN].copy()
    return batchfix.train(seen, seed=0, **TINY)


@pytest.fixture(scope="module")
def outputs(shifted, model) -> dict[str, ad.AnnData]:
    """Both outputs of the whole shifted subset (the unseen batch included), on the modelled genes."""
    done = {}
    for mode in ("counterfactual", "denoised"):
        corrected = batchfix.correct(shifted, model, output_mode=mode, copy=True)
        done[mode] = corrected[:, corrected.var["batchfix_modelled"].to_numpy()].copy()
    return done


def within_batch_agreement(values: np.ndarray, truth_log: np.ndarray, batch: np.ndarray) -> float:
    """Mean over batches and genes of the Spearman correlation, across the batch's cells, with the truth."""
    scores = []
    for b in np.unique(batch):
        rows = batch == b
        for g in range(values.shape[1]):
            if np.ptp(truth_log[rows, g]) > 0 and np.ptp(values[rows, g]) > 0:
                scores.append(spearmanr(values[rows, g], truth_log[rows, g])[0])
    return float(np.mean(scores))


def factor_left(values: np.ndarray, adata: ad.AnnData) -> float:
    """How much of the injected log factors the (batch, gene) means of `values` follow: the least-squares
    slope of those means, centred per gene over batches, on the log factors centred the same way."""
    batch = adata.obs["batch"].astype(str).to_numpy()
    names = sorted(set(batch))
    means = np.stack([values[batch == b].mean(axis=0) for b in names])
    factor = adata.uns["log_factor"].loc[names, adata.var_names].to_numpy()
    x, y = (factor - factor.mean(axis=0)).ravel(), (means - means.mean(axis=0)).ravel()
    return float(x @ y / (x @ x))


def test_counterfactual_keeps_each_cells_own_values_and_denoised_does_not(outputs):
    out = outputs["counterfactual"]
    truth_log = dense(log_cp10k(dense(out.layers["truth"])))
    batch = out.obs["batch"].astype(str).to_numpy()
    agreement = {mode: within_batch_agreement(dense(o.layers["batchfix"]), truth_log, batch)
                 for mode, o in outputs.items()}
    # The multiplied counts themselves agree at ~1.0; the counterfactual adds the model's batch effect for each
    # cell's state, which moves observed zeros by different amounts in different cells (ties in the truth).
    assert agreement["counterfactual"] > 0.75, agreement
    assert agreement["counterfactual"] > agreement["denoised"] + 0.5, agreement
    unseen = batch == UNSEEN
    assert within_batch_agreement(dense(out.layers["batchfix"])[unseen], truth_log[unseen], batch[unseen]) > 0.75


def test_both_outputs_remove_the_per_batch_factors(outputs):
    shifted_log = dense(log_cp10k(dense(outputs["counterfactual"].X)))
    before = factor_left(shifted_log, outputs["counterfactual"])
    assert before > 0.2, "the constructed batch effect shows in the batch means"
    # Before clipping, the counterfactual's batch means are the denoised output's plus one constant per gene;
    # values raised to 0 (observed zeros where a batch's factor is large) leave some of the factor behind.
    assert factor_left(dense(outputs["counterfactual"].layers["batchfix"]), outputs["counterfactual"]) < 0.35 * before
    assert factor_left(dense(outputs["denoised"].layers["batchfix"]), outputs["denoised"]) < 0.1 * before


def test_uns_records_the_mode_and_the_unseen_batch(outputs):
    info = outputs["counterfactual"].uns["batchfix"]
    assert info["output_mode"] == info["params"]["output_mode"] == "counterfactual"
    assert info["params"]["batch_key"] == "batch"
    assert list(info["unseen_batches_estimated"]) == [UNSEEN] and len(info["unseen_batches_uncorrected"]) == 0
    assert UNSEEN not in list(info["training_batches"])
    denoised = outputs["denoised"].uns["batchfix"]
    assert denoised["output_mode"] == denoised["params"]["output_mode"] == "denoised"
    assert "batch_key" not in denoised["params"] and "unseen_batches_estimated" not in denoised


def test_observed_zeros_made_positive_are_counted(model, shifted):
    """The counts output raises an observed zero only where the reference expects the gene more often, and counts
    every one it raises (corrected genes only: the others keep their counts)."""
    out = batchfix.correct(shifted, model, copy=True)
    raw = dense(shifted.X)
    corrected = dense(out.layers["batchfix_counts"])
    raised = int(((raw == 0) & (corrected > 0)).sum())
    info = out.uns["batchfix"]
    assert raised == info["n_zeros_made_positive"] and 0 < raised < 0.2 * info["n_observed_zeros"]
    assert "n_clipped_to_zero" not in info  # counts are never below 0


def test_an_unseen_batch_with_too_few_cells_keeps_its_counts(shifted, model, outputs, caplog):
    few = np.flatnonzero(shifted.obs["batch"] == UNSEEN)[calibration.MIN_UNSEEN_CELLS - 1:]
    adata = shifted[np.setdiff1d(np.arange(shifted.n_obs), few)].copy()
    small = (adata.obs["batch"] == UNSEEN).to_numpy()
    assert small.sum() == calibration.MIN_UNSEEN_CELLS - 1
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        out = batchfix.correct(adata, model, copy=True)
    assert f"fewer than {calibration.MIN_UNSEEN_CELLS} cells: ['{UNSEEN}']. Their cells keep their counts" in caplog.text
    assert list(out.uns["batchfix"]["unseen_batches_uncorrected"]) == [UNSEEN]
    np.testing.assert_array_equal(dense(out.layers["batchfix_counts"])[small], dense(adata.X)[small])
    assert not np.array_equal(dense(out.layers["batchfix_counts"])[~small], dense(adata.X)[~small])


def test_missing_genes_get_no_value_and_barely_move_the_others(shifted, model, outputs):
    modelled = outputs["counterfactual"].var_names
    dropped = list(modelled[::20])  # 5% of the modelled genes
    out = batchfix.correct(shifted[:, ~shifted.var_names.isin(dropped)].copy(), model, copy=True)
    assert list(out.uns["batchfix"]["missing_genes"]) == sorted(dropped, key=model.genes.index)
    kept = out[:, out.var["batchfix_modelled"].to_numpy()]
    assert kept.n_vars == len(modelled) - len(dropped)
    full = dense(outputs["counterfactual"][:, kept.var_names].layers["batchfix"])
    values = dense(kept.layers["batchfix"])
    assert values.min() >= 0 and np.isfinite(values).all()
    assert np.corrcoef(values.ravel(), full.ravel())[0, 1] > 0.99


@pytest.mark.slow  # four corrections (about 10 s): with the slow checks, which CI runs
def test_the_batch_column_is_needed_only_by_the_counterfactual_output(shifted, model, tmp_path):
    renamed = shifted.copy()
    renamed.obs = renamed.obs.rename(columns={"batch": "sample"})
    with pytest.raises(InputError, match=r"no column 'batch'.*'sample'.*output_mode=denoised"):
        batchfix.correct(renamed, model)
    assert "batchfix" not in renamed.layers
    via_key = batchfix.correct(renamed, model, batch_key="sample", copy=True)
    assert via_key.uns["batchfix"]["params"]["batch_key"] == "sample"
    np.testing.assert_array_equal(via_key.layers["batchfix"].data,
                                  batchfix.correct(shifted, model, copy=True).layers["batchfix"].data)
    denoised = batchfix.correct(renamed, model, output_mode="denoised", copy=True)
    assert denoised.uns["batchfix"]["output_mode"] == "denoised"

    # The streaming file route (as the command line runs it) reads the same column, and names it when absent.
    path, checkpoint = tmp_path / "renamed.h5ad", model.save(tmp_path / "model.ckpt")
    renamed.write_h5ad(path)
    with pytest.raises(InputError, match=r"no column 'batch'.*'sample'"):
        correct_file(path, tmp_path / "no.h5ad", model, ResolvedCorrection(), progress=False)
    assert not (tmp_path / "no.h5ad").exists()
    run = subprocess.run([sys.executable, "-m", "batchfix", "correct", f"input={path}", f"checkpoint={checkpoint}",
                          f"output={tmp_path / 'cli.h5ad'}", "data.batch_key=sample", "threads=1", "progress=false"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    streamed = ad.read_h5ad(tmp_path / "cli.h5ad")
    assert streamed.uns["batchfix"]["params"]["output_mode"] == "counterfactual"
    assert streamed.uns["batchfix"]["params"]["batch_key"] == "sample"
    np.testing.assert_allclose(streamed.layers["batchfix"].data, via_key.layers["batchfix"].data, rtol=1e-5,
                               atol=1e-5)


def training_cells(shifted: ad.AnnData, model: batchfix.BatchfixModel) -> PreparedData:
    """The model's training cells (the batches it saw) on its genes, as calibration reads them."""
    seen = shifted[shifted.obs["batch"] != UNSEEN]
    codes = pd.Categorical(seen.obs["batch"].astype(str), categories=model.batch_categories).codes
    return PreparedData(counts=sp.csr_matrix(seen[:, model.genes].X), batch_index=codes.astype(np.int64),
                        batch_categories=model.batch_categories, genes=model.genes, coordinates=None,
                        gene_mean=None, gene_std=None)


def test_calibration_with_the_fused_kernel_matches_the_written_out_attention(shifted, model, monkeypatch):
    """Calibration runs the fused attention (as correction does): the statistics of the guarded softmax."""
    prepared = training_cells(shifted, model)
    net, tables = copy.deepcopy(model.net), copy.deepcopy(model.tables)
    fused_calls = []
    kernel = attention.sdpa_attention
    monkeypatch.setattr(attention, "sdpa_attention", lambda *args: fused_calls.append(1) or kernel(*args))
    calibration.calibrate(net, tables, prepared)
    assert fused_calls, "calibration did not run the fused kernel"
    assert all(m.backend == "guarded" for m in net.modules() if hasattr(m, "backend")), "backend not restored"
    fused = tables.residual_location.clone(), tables.residual_spread.clone()
    monkeypatch.setattr(calibration, "fused_attention", lambda net: contextlib.nullcontext())
    fused_calls.clear()
    calibration.calibrate(net, tables, prepared)
    assert not fused_calls
    torch.testing.assert_close(fused[0], tables.residual_location, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[1], tables.residual_spread, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused[1], model.tables.residual_spread, atol=1e-6, rtol=1e-5)  # as the fit stored them


def test_calibration_cells_keep_small_batches_whole_and_draw_the_rest():
    batch_index = np.repeat([0, 1, 2], [5, 40, 12])
    cells = calibration.calibration_cells(batch_index, 3, per_batch=12)
    assert (np.diff(cells) > 0).all()  # sorted, no repeats: read in file order
    assert np.bincount(batch_index[cells]).tolist() == [5, 12, 12]
    assert set(cells[batch_index[cells] != 1]) == set(np.flatnonzero(batch_index != 1))  # small batches whole
    assert (calibration.calibration_cells(batch_index, 3, per_batch=12) == cells).all()  # the same draw


def test_calibration_on_a_sample_of_each_large_batch_estimates_the_full_statistics(shifted, model, monkeypatch):
    prepared = training_cells(shifted, model)
    net, tables = copy.deepcopy(model.net), copy.deepcopy(model.tables)
    calibration.calibrate(net, tables, prepared)  # every batch below the cap: every cell, as the fit stored them
    torch.testing.assert_close(tables.residual_spread, model.tables.residual_spread)
    per_batch = np.bincount(prepared.batch_index).min() // 2
    monkeypatch.setattr(calibration, "CALIBRATION_CELLS_PER_BATCH", int(per_batch))
    served = []
    real = calibration.in_order
    monkeypatch.setattr(calibration, "in_order", lambda *args: served.append(args[2]) or real(*args))
    calibration.calibrate(net, tables, prepared)
    assert len(served[0]) == per_batch * len(model.batch_categories)
    # A sample's estimates, within their sampling error: a per-gene location drawn from n of N cells is off by
    # about spread * sqrt(1/n - 1/N) (root-mean-square over genes; the spread is that of the per-gene sd).
    torch.testing.assert_close(tables.residual_spread, model.tables.residual_spread, rtol=0.1, atol=0.0)
    full = model.tables.residual_spread.numpy()
    sampling_error = full * np.sqrt(1.0 / per_batch - 1.0 / np.bincount(prepared.batch_index))
    off = (tables.residual_location - model.tables.residual_location).square().mean(dim=1).sqrt().numpy()
    assert (off < 2.0 * sampling_error).all(), (off, sampling_error)


def test_an_uncalibrated_checkpoint_is_refused_for_the_counterfactual_output(shifted, model, tmp_path):
    path = model.save(tmp_path / "model.ckpt")
    state = torch.load(path, weights_only=True)
    state["state_dict"]["tables.residual_spread"].zero_()
    torch.save(state, tmp_path / "uncalibrated.ckpt")
    from batchfix.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no residual calibration"):
        batchfix.correct(shifted, tmp_path / "uncalibrated.ckpt")
    batchfix.correct(shifted, tmp_path / "uncalibrated.ckpt", output_mode="denoised")


def test_output_mode_is_validated_where_it_is_defined():
    for make in (lambda: ResolvedCorrection(output_mode="smooth"),
                 lambda: validated({"checkpoint": "m.ckpt", "correction": {"output_mode": "smooth"}}, CorrectConfig),
                 lambda: validated({"correction": {"output_mode": "smooth"}}, TrainConfig)):
        with pytest.raises(ConfigError, match=r"output_mode must be one of \['counterfactual', 'denoised'\]"):
            make()
    with pytest.raises(ConfigError, match=r"correction\.output_mode"):
        validated({"correction": {"output_mode": "smooth"}}, TrainConfig)
    with pytest.raises(ConfigError, match="output_mode"):
        batchfix.correct(ad.AnnData(np.ones((2, 2), dtype=np.float32)), "unused.ckpt", output_mode="smooth")
    with pytest.raises(ConfigError, match="batch_key"):
        validated({"checkpoint": "m.ckpt", "data": {"batch_key": " "}}, CorrectConfig)
    assert CorrectConfig(checkpoint="m.ckpt").correction.output_mode == TrainConfig().correction.output_mode \
        == "counterfactual"
