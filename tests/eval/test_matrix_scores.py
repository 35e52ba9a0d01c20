"""The matrix-score registry (batchfix.eval.matrix_scores) on the real bundled counts."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import batchfix
from batchfix.data.normalize import log_cp10k
from batchfix.eval import detection, matrix_scores
from batchfix.eval.matrix_scores import MatrixInput, corrected_matrix_scores, score_matrix
from batchfix.training import extra_decoder

TINY = dict(genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8, decoder_hidden=32, batch_size=64,
            threads=1, enable_progress_bar=False, max_epochs=1, seed=0)


@pytest.fixture(scope="module")
def bundled_genes(bundled_adata):
    """All 1,021 cells; the 300 most-detected genes and the 100 least-detected ones (zero in many groups)."""
    counts = sp.csr_matrix(bundled_adata.X)
    detected = np.asarray((counts > 0).sum(axis=0)).ravel()
    order = np.argsort(-detected, kind="stable")
    genes = np.sort(np.concatenate([order[:300], order[-100:]]))
    raw = counts[:, genes].toarray().astype(np.float32)
    return (raw, bundled_adata.obs["cell_type"].astype(str).to_numpy(),
            bundled_adata.obs["batch"].astype(str).to_numpy())


def test_every_registered_score_has_a_function_and_what_it_applies_to():
    names = [name for name, _, _ in matrix_scores.SCORES]
    assert len(set(names)) == len(names)
    for _, function, applies in matrix_scores.SCORES:
        assert callable(function) and applies in (matrix_scores.ANY, matrix_scores.LABELLED, matrix_scores.MODELLED)


def test_the_uncorrected_log_matrix_raises_no_zero_and_invents_no_call(bundled_genes):
    raw, labels, batches = bundled_genes
    scores = score_matrix(MatrixInput(sp.csr_matrix(log_cp10k(raw)), raw, labels, batches))
    assert set(scores) == set(matrix_scores.COLUMNS) and np.isnan(scores[matrix_scores.PIT_FAILS])  # no model
    assert scores[matrix_scores.ZEROS_RAISED] == 0.0 and scores[matrix_scores.FALSE_DE_ZERO_RAW] == 0.0
    assert scores[matrix_scores.DETECTION_SPREAD] == pytest.approx(scores[matrix_scores.DETECTION_SPREAD_RAW])
    assert 0.5 < scores[matrix_scores.DETECTION_WITHIN] <= 1.0
    assert scores[matrix_scores.BATCH_DE_CALLS] > 0  # the batches differ: the raw data has calls between them
    assert [scores[column] for column in matrix_scores.BATCH_EFFECT_LEFT.values()] == [1.0, 1.0, 1.0]  # all left


def test_a_shift_that_fills_one_batchs_zeros_is_seen(bundled_genes):
    """The defect of issue 40: a log-space shift that gives every zero of one batch a small value."""
    raw, labels, batches = bundled_genes
    values = log_cp10k(raw)
    one = batches == "sc_dropseq"
    values[one] += np.random.default_rng(0).uniform(0.05, 0.18, (one.sum(), values.shape[1]))
    honest = score_matrix(MatrixInput(log_cp10k(raw), raw, labels, batches))
    filled = score_matrix(MatrixInput(values, raw, labels, batches))
    zeros = sp.csr_matrix(raw)
    share = one.sum() * raw.shape[1] - zeros[one].nnz
    assert filled[matrix_scores.ZEROS_RAISED] == pytest.approx(share / (np.prod(raw.shape) - zeros.nnz))
    assert filled[matrix_scores.FALSE_DE_ZERO_RAW] > 0
    assert filled[matrix_scores.DETECTION_WITHIN] < honest[matrix_scores.DETECTION_WITHIN]
    assert filled[matrix_scores.DETECTION_SPREAD] > honest[matrix_scores.DETECTION_SPREAD_RAW]


def test_without_labels_only_the_label_free_scores_are_computed(bundled_genes):
    raw, _, batches = bundled_genes
    scores = score_matrix(MatrixInput(log_cp10k(raw), raw, None, batches))
    assert scores[matrix_scores.ZEROS_RAISED] == 0.0
    label_scores = [matrix_scores.DETECTION_WITHIN, matrix_scores.FALSE_DE_ZERO_RAW, matrix_scores.BATCH_DE_CALLS,
                    *matrix_scores.BATCH_EFFECT_LEFT.values()]
    assert all(np.isnan(scores[name]) for name in label_scores)


# ---------------------------------------------------------------- the checks of the model that corrected the file


@pytest.fixture(scope="module")
def tiny_checkpoint(subset, tmp_path_factory):
    """A tiny model (1 epoch, 200 genes) trained on the real subset and saved."""
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(extra_decoder, "MAX_STEPS", 50)
        model = batchfix.train(subset.copy(), n_top_genes=200, **TINY)
    return model.save(tmp_path_factory.mktemp("model") / "model.ckpt")


def checked(adata, batch_key: str = "batch") -> dict:
    return corrected_matrix_scores(adata, "batchfix", adata.var["batchfix_modelled"].to_numpy(), batch_key, None)


def test_the_model_checks_are_stored_at_correct_time_and_scored_without_the_model(subset, tiny_checkpoint,
                                                                                    tmp_path):
    """Issue 54: the PIT and the model's detection are summed while correcting (uns['batchfix']['model_checks'])
    and scored from there: the checkpoint deleted, evaluate never touches the model."""
    moved = shutil.copy(tiny_checkpoint, tmp_path / "moved.ckpt")
    adata = subset.copy()
    batchfix.correct(adata, moved)
    (tmp_path / "moved.ckpt").unlink()
    checks = adata.uns["batchfix"]["model_checks"]
    genes = adata.var_names[adata.var["batchfix_modelled"].to_numpy()]
    assert list(checks["genes"]) == list(genes) and list(checks["batches"]) == sorted(set(adata.obs["batch"]))
    assert checks["pit_histograms"].shape == (5, len(genes), 10)
    assert checks["pit_histograms"].sum(axis=2).tolist() == [[40] * len(genes)] * 5  # every cell of 200 checked
    assert checks["pair_cells"].sum() == adata.n_obs and checks["detected"].shape == (len(checks["pair_cells"]),
                                                                                      len(genes))
    counts = adata.layers["batchfix_counts"][:, adata.var["batchfix_modelled"].to_numpy()]
    assert checks["detected"].sum() == counts.nnz  # the corrected counts' detection, cell by cell
    scores = checked(adata)
    assert 0 <= scores[matrix_scores.PIT_FAILS] < 0.5 and "model_checks_missing" not in scores
    assert scores["model_checks_cells"] == adata.n_obs
    assert scores[matrix_scores.MODEL_DETECTION_WITHIN] is None  # no (batch, state group) of 20 checked cells
    sums = {name: np.asarray(values, dtype=np.float64) for name, values in checks.items() if name not in (
        "genes", "batches")}
    corrected, raw = (detection.summed_calibration(sums["pair_cells"], sums[name], sums["expected"], sums["variance"],
                                                   sums["drawn"], min_cells=4) for name in ("detected", "observed"))
    assert corrected["within_tolerance"] >= corrected["calibrated_within"] - 0.05  # as calibrated as the model's draws
    assert corrected["within_sampling"] > raw["within_sampling"]  # the raw counts keep their batches' detection
    assert set(scores["pit_failing_genes"]) <= set(checks["batches"])
    assert {g for names in scores["pit_failing_genes"].values() for g in names} <= set(genes)


def test_a_file_corrected_with_all_batches_new_gets_its_model_checks(subset, tiny_checkpoint):
    adata = subset.copy()
    adata.obs["batch"] = "new_" + adata.obs["batch"].astype(str)
    batchfix.correct(adata, tiny_checkpoint, all_batches_new=True)
    scores = checked(adata)
    assert scores[matrix_scores.PIT_FAILS] is not None and "model_checks_missing" not in scores
    assert set(adata.uns["batchfix"]["model_checks"]["batches"]) >= set(adata.obs["batch"])


def test_a_renamed_batch_column_keeps_its_model_checks(subset, tiny_checkpoint):
    adata = subset.copy()
    batchfix.correct(adata, tiny_checkpoint)
    adata.obs = adata.obs.rename(columns={"batch": "donor"})
    assert checked(adata, batch_key="donor")[matrix_scores.PIT_FAILS] is not None


def test_a_file_corrected_before_the_checks_were_stored_says_so(subset, tiny_checkpoint, caplog):
    """No PIT, one warning and the reason in the result (metrics.json's matrix_scores); the other scores stay."""
    adata = subset.copy()
    batchfix.correct(adata, tiny_checkpoint)
    del adata.uns["batchfix"]["model_checks"]
    caplog.set_level("INFO", logger="batchfix")
    scores = checked(adata)
    assert scores[matrix_scores.PIT_FAILS] is None and scores[matrix_scores.ZEROS_RAISED] is not None
    assert "holds no model checks" in scores["model_checks_missing"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [scores["model_checks_missing"] + "."]


def test_summed_detection_calibration_is_the_per_cell_one():
    """detection.summed_calibration of group sums gives detection_calibration's shares on the same groups."""
    rng = np.random.default_rng(0)
    probability = rng.uniform(0.05, 0.9, (300, 40))
    counts = (rng.random(probability.shape) < probability).astype(np.float64)
    groups = np.repeat(["a", "b", "c"], 100)
    summary, _ = detection.detection_calibration(counts, counts, probability, groups, np.zeros(300))
    onehot = np.stack([groups == g for g in ("a", "b", "c")]).astype(np.float64)  # (groups, cells)
    summed = detection.summed_calibration(onehot.sum(axis=1), onehot @ counts, onehot @ probability,
                                          onehot @ (probability * (1 - probability)), onehot @ counts)
    assert summed["within_tolerance"] == pytest.approx(summary["within_tolerance"])
    assert summed["within_sampling"] == pytest.approx(summary["within_sampling"])
