"""correction.spread=gene: the counterfactual output's scale per gene and batch, shrunk toward the batch's level.

The estimator on known inputs, then a tiny model trained on real counts (the 200-cell subset, four of its five
batches; the fifth is a batch the model never saw; log-scale values, whose output is the log-scale formula)
corrected with both spreads.
"""
from __future__ import annotations

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch

import batchfix
from batchfix.config import ResolvedCorrection, TrainConfig, validated
from batchfix.correction import calibration
from batchfix.errors import ConfigError

UNSEEN = "sc_dropseq"
TINY = dict(n_top_genes=200, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8,
            decoder_hidden=32, batch_size=64, max_epochs=10, threads=1, enable_progress_bar=False,
            scale="log", likelihood="gaussian")

@pytest.fixture(scope="module")
def subset(log_scale_subset):
    """The subset on a log scale (conftest): these tests check the log-scale formula of a log-scale model."""
    return log_scale_subset



def dense(matrix) -> np.ndarray:
    return matrix.toarray() if sp.issparse(matrix) else np.asarray(matrix)


def test_few_cells_pull_a_gene_toward_its_batch_and_many_keep_its_own():
    ratio = np.random.default_rng(0).gamma(20.0, 1 / 20.0, size=500)  # variance ratios around 1
    ratio[0] = 3.0  # one gene far from its batch's level
    few = calibration.inverse_gamma_posterior(ratio, dof=2)
    many = calibration.inverse_gamma_posterior(ratio, dof=100_000)
    assert abs(few[0] - ratio.mean()) < 0.2 * abs(ratio[0] - ratio.mean())  # pulled most of the way
    assert abs(many[0] - 3.0) < 0.01  # keeps its own
    np.testing.assert_allclose(calibration.inverse_gamma_posterior(ratio, dof=0), ratio.mean())
    np.testing.assert_allclose(calibration.inverse_gamma_posterior(np.full(5, 2.0), dof=50), 2.0)


def test_shrunk_variances_pull_a_small_batch_toward_its_own_level_not_the_others():
    rng = np.random.default_rng(1)
    gene_level = rng.lognormal(0.0, 1.0, size=300)  # genes differ by orders of magnitude
    noise = rng.gamma(20.0, 1 / 20.0, size=(2, 300))
    variance = np.array([[1.0], [4.0]]) * gene_level * noise  # batch 1: four times noisier in every gene
    variance[1, 0] = 40.0 * gene_level[0]  # one outlying gene in batch 1
    small = calibration.shrunk_variances(variance, np.array([1000, 3]), n_training=2)
    large = calibration.shrunk_variances(variance, np.array([1000, 100_000]), n_training=2)
    assert large[1, 0] == pytest.approx(variance[1, 0], rel=0.01)
    level = np.mean(variance[1] / variance.mean(axis=0))  # batch 1's ratio to the genes' level
    assert small[1, 0] / variance.mean(axis=0)[0] == pytest.approx(level, rel=0.2)
    np.testing.assert_allclose(small[0, 1:], variance[0, 1:], rtol=0.05)  # 1000 cells: its own (gene 0's level
    # is raised by batch 1's outlier, which makes it an outlier of batch 0 too)


def test_spread_is_validated_where_it_is_defined():
    for make in (lambda: ResolvedCorrection(spread="cell"),
                 lambda: validated({"correction": {"spread": "cell"}}, TrainConfig)):
        with pytest.raises(ConfigError, match=r"spread must be one of \['batch', 'gene'\]"):
            make()
    assert ResolvedCorrection().spread == TrainConfig().correction.spread == "batch"


@pytest.fixture(scope="module")
def model(subset) -> batchfix.BatchfixModel:
    torch.set_num_threads(1)
    return batchfix.train(subset[subset.obs["batch"] != UNSEEN].copy(), seed=0, **TINY)


@pytest.fixture(scope="module")
def outputs(subset, model) -> dict[str, ad.AnnData]:
    """The counterfactual output of the whole subset (the unseen batch included) with each spread, on the
    modelled genes, every change applied in full (shrink=none); with the whole state shift removed (regional_shift=apply, state_dependence=1), the form in which
    k multiplies only the cell's residual (the regional part and the state share: test_regional_shift.py)."""
    corrected = {spread: batchfix.correct(subset, model, spread=spread, regional_shift="apply", state_dependence=1.0,
                                          shrink="none", copy=True)
                 for spread in ("batch", "gene")}
    return {spread: out[:, out.var["batchfix_modelled"].to_numpy()].copy() for spread, out in corrected.items()}


def test_gene_spread_equalizes_each_genes_scaled_spread_across_training_batches(model):
    """k_{b,g} * sd_b(g) is each batch's residual sd after scaling: per gene nearly the same in every training
    batch with spread=gene (up to shrinkage), while one k per batch leaves the genes' own differences."""
    raw_sd = model.tables.residual_gene_spread.numpy().astype(np.float64)  # (batches, G)
    kept = (raw_sd > 0).all(axis=0)
    dispersion = {}
    for spread in ("batch", "gene"):
        scale = calibration.Statistics(model.tables, None, [], spread_by=spread).scale.numpy()  # (batches, 1 or G)
        scaled = np.log(scale * raw_sd)[:, kept]
        dispersion[spread] = float(np.mean(scaled.std(axis=0)))
    assert dispersion["gene"] < 0.5 * dispersion["batch"], dispersion


def test_a_batch_that_lacks_a_gene_is_out_of_its_reference_spread_and_location(model):
    """The average reference of a gene one batch lacks (its `members`) is the other batches' alone: their mean
    location, and with spread=gene the root-mean-square of their shrunk spreads; the other genes' stay every
    batch's."""
    members = np.ones(model.tables.residual_location.shape, dtype=bool)  # (batches, G)
    members[0, 0] = False
    every = calibration.Statistics(model.tables, None, [], spread_by="gene")
    without = calibration.Statistics(model.tables, None, [], spread_by="gene", members=members)
    location = model.tables.residual_location.numpy().astype(np.float64)
    assert without.ref_location[0].item() == pytest.approx(location[1:, 0].mean(), rel=1e-5)
    np.testing.assert_allclose(without.ref_location[1:].numpy(), every.ref_location[1:].numpy())
    relative = 1.0 / np.square(every.scale.numpy()[:, 0])  # 1 / k^2: each batch's shrunk variance over their mean
    assert np.allclose(without.scale.numpy()[:, 0] / every.scale.numpy()[:, 0], np.sqrt(relative[1:].mean()))
    np.testing.assert_allclose(without.scale.numpy()[:, 1:], every.scale.numpy()[:, 1:])


def test_gene_spread_rescales_each_cells_own_residual_per_gene_and_batch(subset, model, outputs):
    """Both spreads add k times the cell's own residual to the same denoised value and reference location, so
    where neither was floored at 0 their ratio to it is k_gene / k_batch: one number per gene and batch (the
    within-batch order of cells kept), on seen and unseen batches."""
    denoised = batchfix.correct(subset, model, output_mode="denoised", copy=True)
    denoised = dense(denoised.layers["batchfix"][:, denoised.var["batchfix_modelled"].to_numpy()])
    in_model_order = [model.genes.index(g) for g in outputs["batch"].var_names]  # output columns -> model genes
    reference_location = model.tables.residual_location.numpy().mean(axis=0)[in_model_order]
    by_batch, by_gene = (dense(outputs[s].layers["batchfix"]) - denoised - reference_location for s in ("batch", "gene"))
    batch = subset.obs["batch"].astype(str).to_numpy()
    kept = (np.abs(by_batch) > 0.05) & (dense(outputs["batch"].layers["batchfix"]) > 0) & (
        dense(outputs["gene"].layers["batchfix"]) > 0)
    ratio = np.where(kept, by_gene / np.where(kept, by_batch, 1.0), np.nan)  # (cells, G)
    for b in np.unique(batch):
        per_gene = ratio[batch == b]
        assert (np.nanmax(per_gene, axis=0) - np.nanmin(per_gene, axis=0) < 1e-3 * np.nanmax(per_gene, axis=0)
                )[np.isfinite(per_gene).sum(axis=0) > 1].all(), b
        assert np.nanmin(per_gene) > 0 and np.nanstd(np.nanmedian(per_gene, axis=0)) > 0.01, b
    assert outputs["gene"].uns["batchfix"]["params"]["spread"] == "gene"
    assert list(outputs["gene"].uns["batchfix"]["unseen_batches_estimated"]) == [UNSEEN]
