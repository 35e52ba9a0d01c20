"""CNV profiles and their scores (batchfix.eval.cnv) on the real 200-cell subset of the bundled data."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from batchfix.data.normalize import log_cp10k
from batchfix.eval import cnv


@pytest.fixture(scope="module")
def placed(subset):
    """The subset's placed genes, its log values, batches and labels."""
    genes = subset.var["chromosome"].notna().to_numpy()
    adata = subset[:, genes]
    return adata, np.asarray(log_cp10k(adata.X)), adata.obs["batch"].to_numpy(), adata.obs["cell_type"].to_numpy()


def test_windows_follow_the_genome_within_chromosomes():
    chromosome = ["2", "1", "1", "1", "X", "chr2", None]
    start = [50, 300, 100, 200, 10, 20, 5]
    windows = cnv.genomic_windows(chromosome, start, window=2, step=1)
    assert windows.chromosome.tolist() == ["1", "1", "2", "X"]
    assert windows.members.tolist() == [[2, 3], [3, 1], [5, 0], [4, -1]]  # chr1 by start; X shorter than a window
    values = np.arange(7, dtype=float)[None, :]
    assert windows.average(values).tolist() == [[2.5, 2.0, 2.5, 4.0]]


def test_windows_refuse_genes_with_no_placed_chromosome():
    with pytest.raises(ValueError, match="chromosome values seen"):
        cnv.genomic_windows(["MT", "unplaced"], [1, 2])
    with pytest.raises(ValueError, match="var columns"):
        cnv.windows_of(pd.DataFrame({"start": [1]}))


def test_uncorrected_values_keep_their_own_profiles(placed):
    adata, log_values, batch, labels = placed
    windows = cnv.windows_of(adata.var, window=30, step=10)
    result = cnv.profile_retention(log_values, log_values, batch, labels, windows, min_cells=5)
    assert result["n_groups"] >= 5
    assert result["retention_r"] == pytest.approx(result["uncorrected_r"])
    assert result["amplitude_ratio"] == pytest.approx(1.0)
    assert result["uncorrected_r"] > 0.3  # a line's expression along the genome is seen from other batches


def test_scored_labels_restrict_the_groups_not_the_reference(placed):
    adata, log_values, batch, labels = placed
    windows = cnv.windows_of(adata.var, window=30, step=10)
    every = cnv.profile_retention(log_values, log_values, batch, labels, windows, min_cells=5)
    one = cnv.profile_retention(log_values, log_values, batch, labels, windows, min_cells=5,
                                scored_labels=[labels[0]])
    assert 0 < one["n_groups"] < every["n_groups"] and {g["label"] for g in one["groups"]} == {labels[0]}
    assert [g["r"] for g in one["groups"]] == [g["r"] for g in every["groups"] if g["label"] == labels[0]]


def test_flattened_profiles_lose_retention_and_amplitude(placed):
    """Replacing each gene by its batch mean erases every group's regional signal: r and the slope fall."""
    adata, log_values, batch, labels = placed
    windows = cnv.windows_of(adata.var, window=30, step=10)
    flattened = log_values.copy()
    for b in np.unique(batch):
        flattened[batch == b] = log_values[batch == b].mean(axis=0)
    result = cnv.profile_retention(log_values, flattened, batch, labels, windows, min_cells=5)
    kept = cnv.profile_retention(log_values, log_values, batch, labels, windows, min_cells=5)
    assert result["retention_r"] < kept["retention_r"] - 0.2
    assert abs(result["amplitude_ratio"]) < 0.5


def test_a_per_batch_gene_shift_changes_no_profile_of_the_corrected_values(placed):
    """A per-batch constant on every gene leaves r unchanged; a regional one in one group shows in its depth."""
    adata, log_values, batch, labels = placed
    windows = cnv.windows_of(adata.var, window=30, step=10)
    shifted = log_values + (batch == batch[0])[:, None] * 0.7
    same = cnv.profile_retention(log_values, shifted, batch, labels, windows, min_cells=5)
    kept = cnv.profile_retention(log_values, log_values, batch, labels, windows, min_cells=5)
    assert same["retention_r"] == pytest.approx(kept["retention_r"], abs=1e-9)

    on_chr1 = (adata.var["chromosome"].astype(str) == "1").to_numpy()
    group = (labels == labels[0]) & (batch == batch[0])
    lost = log_values - np.outer(group, on_chr1) * 0.5
    profiles = cnv.group_profiles(lost, np.where(group, "clone", "rest"), windows, min_cells=5)
    before = cnv.group_profiles(log_values, np.where(group, "clone", "rest"), windows, min_cells=5)
    depth = cnv.segment_depths(profiles - before, windows, {"1": ("1", 0, np.inf), "2": ("2", 0, np.inf)})
    assert depth.loc["clone", "1"] == pytest.approx(-0.5 * (1 - group.mean()), abs=1e-6)
    assert depth.loc["clone", "2"] == pytest.approx(0.0, abs=1e-9)  # other chromosomes stay flat
    assert depth.loc["rest", "1"] == pytest.approx(0.5 * group.mean(), abs=1e-6)  # the reference moved down


def test_segment_mask_names_the_chromosomes_there_are(placed):
    windows = cnv.windows_of(placed[0].var, window=30, step=10)
    with pytest.raises(ValueError, match="windows exist on"):
        cnv.segment_mask(windows, "Y")


def test_regional_artefact_sees_a_batchs_regional_shift_above_the_floor(placed):
    """On the real subset's log values: a chromosome raised in every cell of one batch is an artefact above the
    floor; the halves' floor does not move with it."""
    adata, values, batch, labels = placed
    windows = cnv.windows_of(adata.var, window=30, step=10)
    values, batch, labels = np.asarray(values, dtype=np.float64), batch.astype(str), labels.astype(str)
    before = cnv.regional_artefact(values, batch, labels, windows, min_cells=6)
    shifted = values.copy()
    on_chr1 = adata.var["chromosome"].astype(str).str.replace("chr", "").to_numpy() == "1"
    shifted[np.ix_(batch == batch[0], on_chr1)] += 0.5
    after = cnv.regional_artefact(shifted, batch, labels, windows, min_cells=6)
    assert before["n_groups"] >= 5 and after["n_groups"] == before["n_groups"]
    assert after["floor"] == pytest.approx(before["floor"])
    assert after["above_floor"] > before["above_floor"] + 0.01 and after["artefact"] > after["floor"]
