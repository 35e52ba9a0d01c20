"""correction.normal_key / normal_values: reference (normal) cells set each batch's regional correction.

Real counts of the 200-cell subset with two injected regional changes (scripts/inject_clones.py): a clone in every
cell but the reference line's of one batch (chr1 gained, chr2 lost: a patient whose malignant cells all carry
it) and a technical artefact in every cell of another batch (chr3 gained, chr6 lost), then a tiny NB model.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import batchfix
from batchfix.correction import reference_cells
from batchfix.correction.regional import GenomeSmoother
from batchfix.data.normalize import log_cp10k
from batchfix.errors import ConfigError, InputError
from batchfix.eval.cnv import segment_shift
from scripts import inject_clones

NORMAL_LINE, CLONE_BATCH, ARTEFACT_BATCH = "H1975", "sc_celseq2", "sc_dropseq"
# The correction that reads the normal line as reference cells
REFERENCE_CELLS = dict(regional_shift="reference_cells", normal_key="cell_type", normal_values=[NORMAL_LINE])
TINY = dict(genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8, decoder_hidden=32, batch_size=64,
            max_epochs=20, threads=1, enable_progress_bar=False, n_top_genes=None)


@pytest.fixture(scope="module")
def injected(subset):
    """(injected AnnData, clone cells): the clone and the artefact injected into the subset's counts."""
    labels, batch = subset.obs["cell_type"].astype(str).to_numpy(), subset.obs["batch"].astype(str).to_numpy()
    adata, clone = subset, np.zeros(subset.n_obs, dtype=bool)
    for i, label in enumerate(sorted(set(labels[batch == CLONE_BATCH]) - {NORMAL_LINE})):
        adata = inject_clones.inject(adata, inject_clones.Clone(label, [CLONE_BATCH], "1", "2"), "cell_type", "batch", i)
        clone |= adata.obs["clone"].to_numpy(dtype=bool)
    for i, label in enumerate(sorted(set(labels[batch == ARTEFACT_BATCH]))):
        adata = inject_clones.inject(adata, inject_clones.Clone(label, [ARTEFACT_BATCH], "3", "6"), "cell_type",
                                     "batch", 10 + i)
    return adata, clone


@pytest.fixture(scope="module")
def model(injected):
    torch.set_num_threads(1)
    return batchfix.train(injected[0], batch_key="batch", seed=0, **TINY)


def contrasts(adata, values, chromosome: str, own: str) -> dict:
    """seg(cells of a label in batch `own`) - seg(same label elsewhere) on the chromosome's genes, by label."""
    labels, batch = adata.obs["cell_type"].astype(str).to_numpy(), adata.obs["batch"].astype(str).to_numpy()
    genes = inject_clones.segment_genes(adata.var, chromosome)
    return {label: segment_shift(values, genes, (labels == label) & (batch == own), (labels == label) & (batch != own))
        for label in sorted(set(labels[batch == own])) if ((labels == label) & (batch != own)).sum() >= 5}


def scores(adata, clone, values, before) -> dict:
    """Clone kept (its cells' cross-batch contrast over the injected shift, mean of gain and loss), the reference
    line's cells moved there, and the artefact left (the artefact batch's contrast over the injected one)."""
    after = np.asarray(log_cp10k(np.asarray(adata.X)))
    out = {"clone kept": [], "normal moved": [], "artefact left": []}
    for chromosome in ("1", "2"):
        genes = inject_clones.segment_genes(adata.var, chromosome)
        truth = inject_clones.injected_shift(before, after, clone, genes)
        by_label = contrasts(adata, values, chromosome, CLONE_BATCH)
        out["clone kept"].append(np.mean([v for k, v in by_label.items() if k != NORMAL_LINE]) / truth)
        out["normal moved"].append(by_label[NORMAL_LINE] / truth)
    for chromosome in ("3", "6"):
        genes = inject_clones.segment_genes(adata.var, chromosome)
        cells = adata.obs["batch"].to_numpy() == ARTEFACT_BATCH
        truth = inject_clones.injected_shift(before, after, cells, genes)
        out["artefact left"].append(np.mean(list(contrasts(adata, values, chromosome, ARTEFACT_BATCH).values())) / truth)
    return {name: float(np.mean(v)) for name, v in out.items()}


def test_reference_cells_keep_a_clone_every_malignant_cell_carries_and_remove_a_batch_artefact(
        subset, injected, model, monkeypatch):
    monkeypatch.setattr(reference_cells, "MIN_NORMAL_CELLS", 5)  # the subset holds 40 cells per batch
    adata, clone = injected
    before = np.asarray(log_cp10k(np.asarray(subset.X)))
    runs = {name: scores(adata, clone, batchfix.correct(adata, model, copy=True, **options).layers["batchfix"].toarray(),
                         before)
            for name, options in {"keep": {}, "reference cells": REFERENCE_CELLS}.items()}
    uncorrected = scores(adata, clone, np.asarray(log_cp10k(np.asarray(adata.X))), before)
    assert runs["reference cells"]["clone kept"] > 0.8  # batch-wide against the other batches, yet kept
    assert runs["reference cells"]["clone kept"] > runs["keep"]["clone kept"] + 0.2
    assert abs(runs["reference cells"]["artefact left"]) < 0.3 < uncorrected["artefact left"]
    assert abs(runs["reference cells"]["normal moved"]) < 0.3


def test_a_batch_without_reference_cells_keeps_its_regional_profile_and_is_named(injected, model, monkeypatch,
                                                                                  caplog):
    """A549 is not in sc_celseq2 nor sc_dropseq: by the documented rule those batches' cells keep their regional
    profile (the artefact too), and a warning names them."""
    monkeypatch.setattr(reference_cells, "MIN_NORMAL_CELLS", 5)
    adata, clone = injected
    out = batchfix.correct(adata, model, copy=True, regional_shift="reference_cells", normal_key="cell_type",
                           normal_values=["A549"])
    assert "fewer than 5 reference cells: ['sc_celseq2', 'sc_dropseq']" in caplog.text
    assert out.uns["batchfix"]["params"]["normal_key"] == "cell_type"
    assert list(out.uns["batchfix"]["params"]["normal_values"]) == ["A549"]


def test_reference_cells_are_checked_and_named(injected, model):
    adata = injected[0]
    reference = dict(regional_shift="reference_cells", copy=True)
    with pytest.raises(InputError, match=r"no such column.*cell_type"):
        batchfix.correct(adata, model, normal_key="tissue", normal_values=["normal"], **reference)
    with pytest.raises(InputError, match=r"Its values: \['A549', 'H1975'"):
        batchfix.correct(adata, model, normal_key="cell_type", normal_values=["T cell"], **reference)
    with pytest.raises(ConfigError, match="go together"):
        batchfix.correct(adata, model, normal_key="cell_type", **reference)
    with pytest.raises(ConfigError, match="regional_shift=reference_cells and correction.normal_key go together"):
        batchfix.correct(adata, model, normal_key="cell_type", normal_values=["A549"], copy=True)


def test_reference_cells_work_on_a_log_scale_model(subset, injected, monkeypatch):
    """The same two errors on log1p(counts per 10k) values (data.scale=log, as TPM data is read): the batch's
    regional level is taken from its reference cells' log output, and the regional change leaves through each
    region's nonzero values (an input zero stays zero), so the region's mean moves by it."""
    monkeypatch.setattr(reference_cells, "MIN_NORMAL_CELLS", 5)
    adata, clone = injected
    log_values = adata.copy()
    log_values.X = np.asarray(log_cp10k(np.asarray(adata.X)), dtype=np.float32)
    torch.set_num_threads(1)
    log_model = batchfix.train(log_values, batch_key="batch", seed=0, scale="log", likelihood="gaussian", **TINY)
    before = np.asarray(log_cp10k(np.asarray(subset.X)))
    runs = {name: scores(adata, clone, np.asarray(batchfix.correct(log_values, log_model, copy=True,
                                                                   **options).layers["batchfix"].toarray()), before)
            for name, options in {"keep": {}, "reference cells": REFERENCE_CELLS}.items()}
    uncorrected = scores(adata, clone, log_values.X, before)
    assert runs["reference cells"]["clone kept"] > 0.8
    assert runs["reference cells"]["clone kept"] > runs["keep"]["clone kept"] + 0.2
    assert runs["reference cells"]["artefact left"] < min(uncorrected["artefact left"] - 0.3,
                                                          runs["keep"]["artefact left"])
    assert abs(runs["reference cells"]["normal moved"]) < 0.3


def test_the_reference_level_is_shrunk_by_its_noise_and_an_artefact_above_it_is_removed_whole():
    """Constructed levels of 4 batches on 3 chromosomes of 200 genes: batch 0 carries a gain of 0.3 on chromosome
    1, every level carries noise of the stated variance. The artefact (noise sd of a 100-gene mean: 0.02) passes
    nearly whole; on the chromosomes without one the offset is shrunk well below the raw running mean's noise."""
    rng = np.random.default_rng(0)
    chromosome = ["1"] * 200 + ["2"] * 200 + ["3"] * 200
    smoother, prior = GenomeSmoother(chromosome, 100), GenomeSmoother(chromosome, 500)
    variance = np.full((4, 600), 0.04)
    level = rng.normal(0.0, 0.2, size=(4, 600))
    level[0, :200] += 0.3
    offset = reference_cells.regional_offset(smoother, prior, level, variance, np.ones(4, dtype=bool)).numpy()
    raw = -smoother(torch.from_numpy(level - level.mean(axis=0))).numpy()
    artefact = -0.3 * 0.75  # batch 0 less the mean of the four
    assert offset[0, 50:150].mean() == pytest.approx(artefact, abs=0.03)
    assert np.abs(offset[:, 200:]).mean() < 0.5 * np.abs(raw[:, 200:]).mean()
    assert smoother.mean_variance(torch.from_numpy(variance))[0, 100].item() == pytest.approx(0.04 / 100)
    fewer = reference_cells.regional_offset(smoother, prior, level[:3], variance[:3], np.array([True, True, True, False]))
    assert fewer[3].abs().max() == 0.0  # a batch without enough reference cells keeps its profile


def test_normal_values_that_match_no_cell_are_named(subset, caplog):
    """Of the values given, those no cell has are named in a warning (the others still pick the reference cells);
    none matching is refused with the column's values."""
    from batchfix.config import ResolvedCorrection
    from batchfix.correction.writers import normal_cells

    columns = list(subset.obs.columns)
    settings = ResolvedCorrection(regional_shift="reference_cells", normal_key="cell_type",
                                  normal_values=["A549", "T cell", "H1975"])
    with caplog.at_level("WARNING", logger="batchfix"):
        normal = normal_cells(subset.obs["cell_type"], settings, columns)
    assert (normal == subset.obs["cell_type"].isin(["A549", "H1975"]).to_numpy()).all() and normal.any()
    assert "correction.normal_values ['T cell'] match no cell of obs column 'cell_type'" in caplog.text
    assert "those of ['A549', 'H1975']. Its values: ['A549', 'H1975'" in caplog.text
    with pytest.raises(InputError, match=r"no cell of obs column 'cell_type' has one of them. Its values: \['A549'"):
        normal_cells(subset.obs["cell_type"], ResolvedCorrection(regional_shift="reference_cells",
                                                                 normal_key="cell_type", normal_values=["T cell"]),
                     columns)
