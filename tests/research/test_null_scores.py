"""scripts/null_split.py, scripts/null_scores.py and scripts/donor_biology.py on small real subsets of the bundled
data written to disk: the split keeps its cells and fractions, a file scored against itself shows nothing, and
known alterations show exactly what was done."""
from __future__ import annotations

import json

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

from scripts import donor_biology, null_scores, null_split

SPLIT_BATCH = "sc_celseq2"
N_GENES = 800  # genes of every detection level of the bundled file, and XIST for the donor set
N_ALTERED = 40  # genes whose counts one pseudo-batch gets four times


@pytest.fixture(scope="module")
def small_h5ad(bundled_adata, tmp_path_factory):
    """The bundled cells of three batches, N_GENES genes evenly spaced over the ranking of those detected in 3 or
    more of their cells (every expression level) and XIST, raw counts in X, on disk."""
    cells = bundled_adata.obs["batch"].isin([SPLIT_BATCH, "sc_dropseq", "sc_celseq2_5cl_p1"]).to_numpy()
    detected = np.asarray((bundled_adata.X[cells] > 0).sum(axis=0)).ravel()
    ranked = np.argsort(-detected, kind="stable")[:(detected >= 3).sum()]
    xist = np.flatnonzero(bundled_adata.var["gene_symbol"].astype(str).to_numpy() == "XIST")
    genes = np.union1d(ranked[np.linspace(0, len(ranked) - 1, N_GENES).astype(int)], xist)
    adata = bundled_adata[cells][:, genes].copy()
    adata.X = sp.csr_matrix(adata.X, dtype=np.float32)
    path = tmp_path_factory.mktemp("null") / "small.h5ad"
    adata.write_h5ad(path)
    return path


@pytest.fixture(scope="module")
def split(small_h5ad):
    """A 50/50 null split of SPLIT_BATCH with sc_dropseq kept whole, written by the command line."""
    out = small_h5ad.with_name("null.h5ad")
    null_split.main([str(small_h5ad), str(out), "--batch", SPLIT_BATCH, "--fractions", "0.5", "0.5",
                     "--keep-batch", "sc_dropseq"])
    return out


def test_the_split_keeps_each_cell_and_draws_the_fractions(small_h5ad, tmp_path):
    """Every cell of the batch lands in exactly one pseudo-batch of the asked size with its own counts and obs,
    the kept batch is unchanged, and the same seed draws the same split (another seed another)."""
    source = ad.read_h5ad(small_h5ad)
    out = tmp_path / "split.h5ad"
    null_split.main([str(small_h5ad), str(out), "--batch", SPLIT_BATCH, "--fractions", "0.25", "0.75",
                     "--seed", "3", "--keep-batch", "sc_dropseq"])
    written = ad.read_h5ad(out)
    in_batch = source.obs["batch"] == SPLIT_BATCH
    expected_cells = source.obs_names[in_batch | (source.obs["batch"] == "sc_dropseq")]
    assert list(written.obs_names) == list(expected_cells)
    sizes = written.obs["batch"].value_counts()
    n = int(in_batch.sum())
    assert sizes[f"{SPLIT_BATCH}_a"] == round(0.25 * n) and sizes[f"{SPLIT_BATCH}_b"] == n - round(0.25 * n)
    assert sizes["sc_dropseq"] == (source.obs["batch"] == "sc_dropseq").sum()
    assert (written.obs["source_batch"].astype(str) == source.obs.loc[written.obs_names, "batch"].astype(str)).all()
    assert (written.obs["cell_type"] == source.obs.loc[written.obs_names, "cell_type"]).all()
    assert (sp.csr_matrix(written.X) != sp.csr_matrix(source[written.obs_names].X)).nnz == 0
    again = null_split.null_split(source, SPLIT_BATCH, [0.25, 0.75], seed=3, keep_batches=("sc_dropseq",))
    other = null_split.null_split(source, SPLIT_BATCH, [0.25, 0.75], seed=4)
    assert (again.obs["batch"] == written.obs["batch"]).all()
    assert (other.obs["batch"].astype(str) != written.obs.loc[other.obs_names, "batch"].astype(str)).any()
    with pytest.raises(SystemExit):  # an existing output is never replaced
        null_split.main([str(small_h5ad), str(out), "--batch", SPLIT_BATCH])


def corrected_copy(path, alter=None):
    """The file at `path` with layers['batchfix_counts'] = X, changed by `alter(counts, obs)` when given."""
    adata = ad.read_h5ad(path)
    counts = sp.csr_matrix(adata.X, dtype=np.float32)
    adata.layers["batchfix_counts"] = alter(counts, adata.obs) if alter else counts
    return adata


@pytest.mark.slow  # ~45 s on 2 cores (ComBat and Wilcoxon on a real batch): in the slow run, which CI runs too
def test_a_file_scored_against_itself_shows_no_change(split, tmp_path):
    """No count changed, no zero raised, every neighbour kept and no DE gene; ComBat, scored beside, changes counts."""
    corrected = tmp_path / "same.h5ad"
    corrected_copy(split).write_h5ad(corrected)
    null_scores.main([str(split), str(corrected), "--combat", "--out", str(tmp_path / "scores.json")])
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["split_cells"] == sum(scores["cells_per_pseudo_batch"].values())
    assert set(scores["cells_per_pseudo_batch"]) == {f"{SPLIT_BATCH}_a", f"{SPLIT_BATCH}_b"}
    same = scores["methods"]["batchfix_counts"]
    assert same["counts_changed"] == 0 and same["zeros_raised"] == 0 and same["mean_abs_log_change"] == 0
    assert same["shift_gap"] == 0 and same["shift_gap_shuffled"] == 0
    assert same["knn_kept"] == 1.0 and same["de_genes"] == 0 and scores["methods"]["raw"]["de_genes"] == 0
    assert scores["methods"]["ComBat"]["counts_changed"] > 0.5


@pytest.mark.slow  # ComBat-seq on a real batch's split (about 10 s): in the slow run
def test_combat_seq_is_scored_on_the_split_without_a_corrected_file(split, tmp_path):
    """Without a corrected file only the raw cells and the baselines asked for are scored: ComBat-seq's adjusted
    counts of the whole file move counts of the split cells (its null artefact), and keep their zeros."""
    null_scores.main([str(split), "--combat-seq", "--out", str(tmp_path / "baselines.json")])
    scores = json.loads((tmp_path / "baselines.json").read_text())
    assert set(scores["methods"]) == {"raw", "ComBat-seq"} and scores["pseudobulk"] == {"skipped": "no corrected file"}
    moved = scores["methods"]["ComBat-seq"]
    assert moved["counts_changed"] > 0.05 and moved["zeros_raised"] < 0.01 and moved["knn_kept"] < 1.0


def quadruple_and_raise(counts: sp.csr_matrix, obs) -> sp.csr_matrix:
    """Counts of the first N_ALTERED genes times 4 in the cells of pseudo-batch a, their zeros there set to 1."""
    dense = counts.toarray()
    rows = np.flatnonzero(obs["batch"].astype(str).to_numpy() == f"{SPLIT_BATCH}_a")
    block = dense[np.ix_(rows, np.arange(N_ALTERED))]
    dense[np.ix_(rows, np.arange(N_ALTERED))] = np.where(block > 0, 4 * block, 1)
    return sp.csr_matrix(dense)


@pytest.mark.slow  # ~25 s on 2 cores (Wilcoxon and pseudobulk on a real batch): in the slow run, which CI runs too
def test_an_altered_copy_shows_the_changes_made_and_their_de_genes(split, tmp_path):
    """Quadrupled counts of some genes in one pseudo-batch: the shares of counts changed and zeros raised are exactly
    those altered, and the DE genes are among the altered genes."""
    raw = ad.read_h5ad(split)
    altered = corrected_copy(split, quadruple_and_raise)
    scores = null_scores.null_scores(raw, altered, "batchfix_counts")["methods"]["batchfix_counts"]
    rows = null_scores.split_rows(raw.obs, "batch")
    in_a = raw.obs["batch"].astype(str).to_numpy()[rows] == f"{SPLIT_BATCH}_a"
    block = raw.X[rows][:, :N_ALTERED][in_a].toarray()
    nonzero, zeros = raw.X[rows].nnz, np.prod(raw.X[rows].shape) - raw.X[rows].nnz
    assert scores["counts_changed"] == pytest.approx((block > 0).sum() / nonzero)
    assert scores["zeros_raised"] == pytest.approx((block == 0).sum() / zeros)
    assert scores["de_genes"] >= N_ALTERED // 2
    assert set(scores["de_genes_listed"]) <= set(raw.var_names[:N_ALTERED])
    assert scores["mean_abs_log_change"] > 0 and scores["shift_gap"] > 2 * scores["shift_gap_shuffled"] > 0


def test_the_donor_set_empties_its_genes_and_its_score_sees_counts_given_back(small_h5ad, tmp_path):
    """The set empties a gene of each level and XIST in one batch only; scored against itself every gene passes, and
    a copy that gives one gene its counts back in that batch, and takes another from the other batches, fails both."""
    source = ad.read_h5ad(small_h5ad)
    path = tmp_path / "donor.h5ad"
    donor_biology.main(["build", str(small_h5ad), str(path), "--batch", "sc_celseq2_5cl_p1", "--seed", "0"])
    donor = ad.read_h5ad(path)
    manifest = donor.uns["donor_biology"]
    genes = list(manifest["genes"])
    assert sorted(set(manifest["levels"])) == ["high", "low", "mid", "sex chromosome"]
    assert donor.var.loc[genes[list(manifest["levels"]).index("sex chromosome")], "gene_symbol"] == "XIST"
    in_batch = (donor.obs["batch"] == "sc_celseq2_5cl_p1").to_numpy()
    assert donor[in_batch, genes].X.nnz == 0 and (source[in_batch, genes].X > 0).sum(axis=0).min() > 0
    unchanged = np.setdiff1d(donor.var_names, genes)
    assert (donor[:, unchanged].X != source[:, unchanged].X).nnz == 0
    assert (donor[~in_batch].X != source[~in_batch].X).nnz == 0
    itself = donor_biology.score(donor, corrected_copy(path), "batchfix_counts")
    assert itself["passes"].all() and (itself["control_kept_ratio"] == 1).all()
    given_back, taken = genes[0], genes[1]

    def alter(counts, obs):
        restored = sp.lil_matrix(counts)
        restored[:, donor.var_names.get_loc(given_back)] = source[:, given_back].X.toarray()
        restored[np.flatnonzero(~in_batch), donor.var_names.get_loc(taken)] = 0
        return sp.csr_matrix(restored)

    table = donor_biology.score(donor, corrected_copy(path, alter), "batchfix_counts")
    assert table.loc[given_back, "emptied_share"] == pytest.approx(table.loc[given_back, "emptied_share_before"])
    assert table.loc[taken, "kept_ratio"] == 0
    assert not table.loc[[given_back, taken], "passes"].any() and table["passes"].sum() == len(genes) - 2


@pytest.mark.slow  # ComBat-seq on 3 batches x 800 genes (about 10 s): in the slow run
def test_combat_seq_of_the_donor_set_is_written_beside_and_scored(small_h5ad, tmp_path):
    """ComBat-seq's counts of the set in layers['combat_seq']: a gene with no count in a whole batch is left as it
    is (every entry), so it passes the donor score without being corrected in the other batches."""
    path, out = tmp_path / "donor.h5ad", tmp_path / "donor.combat_seq.h5ad"
    donor_biology.main(["build", str(small_h5ad), str(path), "--batch", "sc_celseq2_5cl_p1", "--seed", "0"])
    donor_biology.main(["combat-seq", str(path), str(out)])
    adjusted = ad.read_h5ad(out)
    genes = np.asarray(adjusted.uns["donor_biology"]["genes"]).astype(str)
    assert (adjusted[:, genes].layers["combat_seq"] != adjusted[:, genes].X).nnz == 0
    assert (adjusted.layers["combat_seq"] != adjusted.X).nnz > 0  # the other genes are adjusted
    assert donor_biology.score(ad.read_h5ad(path), adjusted, "combat_seq")["passes"].all()


def test_the_null_grid_names_its_runs_and_averages_seeds_per_batch_and_fractions():
    from scripts import null_grid

    assert null_grid.run_tag("sc_celseq2", (0.6667, 0.3333), 2) == "sc_celseq2_0666703333_s2"
    rows = [{"batch": "b", "fractions": "50/50", "seed": seed, "method": "batchfix", "counts_changed": value,
             "zeros_raised": 0.0, "knn_kept": 1.0 - value, "de_genes": seed} for seed, value in enumerate([0.1, 0.3])]
    result = null_grid.table(rows).iloc[0]
    assert result["counts_changed"] == pytest.approx(0.2) and result["knn_kept"] == pytest.approx(0.8)
    assert result["de_genes_max"] == 1 and result["seeds"] == 2
