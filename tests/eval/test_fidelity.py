"""Gene-level fidelity scores (batchfix.eval.fidelity) on constructed cases with known answers and
on the bundled CellBench data."""
from __future__ import annotations

import json
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy.stats import spearmanr

from batchfix.data.normalize import log_cp10k
from batchfix.eval import fidelity
from batchfix.eval.fidelity import DE_RANK, GENE_METRICS, HVG_CONSERVATION, MARKER_RECALL, WITHIN_TYPE

DATA = Path(__file__).resolve().parents[2] / "data" / "cellbench5.h5ad"
BATCHES, LABELS = ["b0", "b1", "b2"], ["A", "B", "C"]


def make_counts(seed: int = 0, cells_per_group: int = 40, n_genes: int = 300):
    """Negative-binomial counts: 3 batches x 3 labels, 20 up-regulated marker genes per label,
    and a multiplicative batch effect on every gene (which the within-batch reference ignores)."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0.0, 1.0, n_genes)
    label_fold = np.ones((len(LABELS), n_genes))
    for i in range(len(LABELS)):
        label_fold[i, 20 * i: 20 * (i + 1)] = rng.uniform(3, 8, 20)
    counts, batch, labels = [], [], []
    for b in range(len(BATCHES)):
        batch_fold = rng.lognormal(0.0, 0.7, n_genes)
        for i, label in enumerate(LABELS):
            library = rng.lognormal(0.0, 0.3, (cells_per_group, 1))
            mean = base * label_fold[i] * batch_fold * library
            counts.append(rng.negative_binomial(5, 5 / (5 + mean)))
            batch += [BATCHES[b]] * cells_per_group
            labels += [label] * cells_per_group
    return np.vstack(counts).astype(np.float32), np.array(batch), np.array(labels)


@pytest.fixture(scope="module")
def synthetic():
    counts, batch, labels = make_counts()
    return counts, log_cp10k(counts.astype(np.float64)), batch, labels


def scores(result: dict) -> dict:
    return {k: result[k] for k in GENE_METRICS}


def per_batch_shift(values: np.ndarray, batch: np.ndarray, seed: int = 1) -> np.ndarray:
    """`values` plus a different random per-gene vector for each batch."""
    rng = np.random.default_rng(seed)
    shifted = values.copy()
    for b in np.unique(batch):
        shifted[batch == b] += rng.normal(0.0, 2.0, values.shape[1])
    return shifted


# ---------------------------------------------------------------- reference and definitions


def test_reference_is_log1p_counts_per_10k_over_the_given_genes_for_every_array_kind():
    counts = np.array([[1, 3, 0], [0, 0, 0], [5, 5, 10]], dtype=float)
    expected = np.log1p(np.array([[2500, 7500, 0], [0, 0, 0], [2500, 2500, 5000]], dtype=float))
    np.testing.assert_allclose(log_cp10k(counts), expected, rtol=1e-12)
    sparse = log_cp10k(sp.csr_matrix(counts))
    assert sp.issparse(sparse)
    np.testing.assert_allclose(sparse.toarray(), expected, rtol=1e-12)
    np.testing.assert_allclose(log_cp10k(torch.tensor(counts)).numpy(), expected, rtol=1e-12)


def test_the_reference_itself_scores_one_everywhere(synthetic):
    counts, reference, batch, labels = synthetic
    for c, r in ((counts, reference), (sp.csr_matrix(counts), sp.coo_matrix(reference))):
        result = fidelity.gene_fidelity(c, r, batch, labels)
        assert scores(result) == {k: pytest.approx(1.0, abs=1e-12) for k in GENE_METRICS}
        assert (result["n_labels_scored"], result["n_groups_scored"], result["n_batches_scored"]) == (3, 9, 3)
        assert "note" not in result
    json.dumps(result, allow_nan=False)


def test_scores_match_a_brute_force_computation_of_the_definitions(synthetic):
    counts, reference, batch, labels = synthetic
    rng = np.random.default_rng(2)
    corrected = reference + rng.normal(0.0, 0.6, reference.shape)
    # label C keeps only 9 cells in batch b2: b2 no longer qualifies for C (needs >= 10)
    keep = np.ones(len(batch), bool)
    keep[np.flatnonzero((batch == "b2") & (labels == "C"))[9:]] = False
    counts, reference, corrected = counts[keep], reference[keep], corrected[keep]
    batch, labels = batch[keep], labels[keep]
    result = fidelity.gene_fidelity(counts, corrected, batch, labels)

    de, markers = [], []
    for label in LABELS:
        qualifying = [b for b in BATCHES if ((batch == b) & (labels == label)).sum() >= 10]
        assert result["per_label"][label]["batches"] == qualifying
        diffs = []
        for values in (reference, corrected):
            diffs.append(np.mean([
                values[(batch == b) & (labels == label)].mean(0) - values[(batch == b) & (labels != label)].mean(0)
                for b in qualifying
            ], axis=0))
        de.append(spearmanr(*diffs).statistic)
        tops = [set(np.argsort(-d)[:50]) for d in diffs]
        markers.append(len(tops[0] & tops[1]) / 50)
    assert result["per_label"]["C"]["batches"] == ["b0", "b1"]
    assert result[DE_RANK] == pytest.approx(np.mean(de), abs=1e-12)
    assert result[MARKER_RECALL] == pytest.approx(np.mean(markers), abs=1e-12)
    assert 0.3 < result[DE_RANK] < 0.99 and 0.2 < result[MARKER_RECALL] < 1.0  # a non-trivial case

    def knn(values):  # PCA by SVD, neighbours by a full distance matrix
        centred = values - values.mean(0)
        u, s, _ = np.linalg.svd(centred, full_matrices=False)
        pcs = u[:, :10] * s[:10]
        dist = ((pcs[:, None] - pcs[None]) ** 2).sum(-1)
        np.fill_diagonal(dist, np.inf)
        return np.argsort(dist, axis=1)[:, :10]

    groups = []
    for b in BATCHES:
        for label in LABELS:
            cells = (batch == b) & (labels == label)
            if cells.sum() >= 30:
                nr, nc = knn(reference[cells]), knn(corrected[cells])
                groups.append(np.mean([len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in zip(nr, nc)]))
    assert result["n_groups_scored"] == len(groups) == 8  # (b2, C) has 9 cells
    assert result[WITHIN_TYPE] == pytest.approx(np.mean(groups), abs=1e-9)

    hvg = []
    for b in BATCHES:
        tops = [set(np.argsort(-v[batch == b].var(0))[:200]) for v in (reference, corrected)]
        hvg.append(len(tops[0] & tops[1]) / 200)
    assert result[HVG_CONSERVATION] == pytest.approx(np.mean(hvg), abs=1e-12)


def test_negated_reference_has_known_scores(synthetic):
    """-reference: every DE difference flips sign (rank correlation -1, no shared top markers),
    while distances and variances are unchanged (neighbours and HVGs kept exactly)."""
    counts, reference, batch, labels = synthetic
    result = fidelity.gene_fidelity(counts, -reference, batch, labels)
    assert result[DE_RANK] == pytest.approx(-1.0, abs=1e-12)
    assert result[MARKER_RECALL] == 0.0
    assert result[WITHIN_TYPE] == pytest.approx(1.0, abs=1e-12)
    assert result[HVG_CONSERVATION] == pytest.approx(1.0, abs=1e-12)


def test_hvg_conservation_counts_the_lost_top_genes_exactly(synthetic):
    counts, reference, batch, labels = synthetic
    corrected = reference.copy()
    for b in BATCHES:  # flatten the 50 most variable genes of each batch to a constant
        rows = batch == b
        top = np.argsort(-reference[rows].var(0))[:50]
        corrected[np.ix_(rows, top)] = 1.0
    result = fidelity.gene_fidelity(counts, corrected, batch, labels)
    assert result[HVG_CONSERVATION] == pytest.approx(150 / 200)
    assert result["per_batch"] == {b: pytest.approx(0.75) for b in BATCHES}
    # with n_hvg=50 exactly those genes were the top: none is kept
    assert fidelity.gene_fidelity(counts, corrected, batch, labels, n_hvg=50)[HVG_CONSERVATION] == 0.0


# ---------------------------------------------------------------- invariances and failures


def test_a_pure_per_batch_shift_keeps_every_score(synthetic):
    counts, reference, batch, labels = synthetic
    shifted = per_batch_shift(reference, batch)
    result = fidelity.gene_fidelity(counts, shifted, batch, labels)
    assert scores(result) == {k: pytest.approx(1.0, abs=1e-6) for k in GENE_METRICS}
    # the same shift applied to one label's cells in one batch is not a batch effect: DE moves
    partial = reference.copy()
    cells = (batch == "b0") & (labels == "A")
    partial[cells] = shifted[cells]
    assert fidelity.gene_fidelity(counts, partial, batch, labels)[DE_RANK] < 0.9


def test_values_shuffled_across_cells_or_genes_score_low(synthetic):
    counts, reference, batch, labels = synthetic
    rng = np.random.default_rng(3)
    cells = fidelity.gene_fidelity(counts, reference[rng.permutation(len(batch))], batch, labels)
    assert abs(cells[DE_RANK]) < 0.25
    assert cells[MARKER_RECALL] < 0.35
    assert cells[WITHIN_TYPE] < 0.25  # chance: 10 random of 39 neighbours, Jaccard ~0.15
    # n_hvg=30 of 300 genes: a chance overlap is 0.1 (the default 200 would be 0.67 by chance)
    permuted = reference[:, rng.permutation(reference.shape[1])]
    genes = fidelity.gene_fidelity(counts, permuted, batch, labels, n_hvg=30)
    assert abs(genes[DE_RANK]) < 0.25
    assert genes[MARKER_RECALL] < 0.3  # chance: 50 / 300
    assert genes[HVG_CONSERVATION] < 0.35
    assert genes[WITHIN_TYPE] == pytest.approx(1.0, abs=1e-9)  # distances ignore the gene order


def test_without_labels_only_hvg_conservation_is_computed(synthetic):
    counts, reference, batch, _ = synthetic
    result = fidelity.gene_fidelity(counts, per_batch_shift(reference, batch), batch)
    assert result[HVG_CONSERVATION] == pytest.approx(1.0, abs=1e-6)
    assert all(result[k] is None for k in fidelity.LABEL_METRICS)
    assert result["note"] == fidelity.NO_LABELS_NOTE
    assert result["n_labels_scored"] == result["n_groups_scored"] == 0 and not result["labels_given"]
    json.dumps(result, allow_nan=False)


def test_thresholds_are_keywords_and_unscored_parts_are_named(synthetic):
    counts, reference, batch, labels = synthetic
    result = fidelity.gene_fidelity(counts, reference, batch, labels, min_cells_group=41, min_cells_de=41)
    assert result[DE_RANK] is None and result[MARKER_RECALL] is None and result[WITHIN_TYPE] is None
    assert result[HVG_CONSERVATION] == 1.0
    assert "['A', 'B', 'C']" in result["note"] and ">= 41" in result["note"] and "within-type" in result["note"]
    small = fidelity.gene_fidelity(counts, reference, batch, labels, n_markers=5, n_pcs=3, n_neighbors=4)
    assert small["parameters"]["n_markers"] == 5 and small[MARKER_RECALL] == 1.0


@pytest.mark.parametrize("change, message", [
    (lambda c, r, b, l: (c, r[:, :-1], b, l), r"Shape mismatch: counts \(360, 300\) vs corrected \(360, 299\)"),
    (lambda c, r, b, l: (c, np.where(np.eye(*r.shape, dtype=bool), np.nan, r), b, l), "corrected matrix holds 300 NaN"),
    (lambda c, r, b, l: (np.where(c > 50, np.nan, c), r, b, l), "counts matrix holds .* NaN"),
    (lambda c, r, b, l: (r, r, b, l), "does not hold raw counts .* non-integer"),
    (lambda c, r, b, l: (-c, r, b, l), "does not hold raw counts .* negative"),
    (lambda c, r, b, l: (c, r, b[:-1], l), "batch has 359 entries for 360 cells"),
    (lambda c, r, b, l: (c, r, b, l[:10]), "labels has 10 entries for 360 cells"),
    (lambda c, r, b, l: (c, r, b, np.where(l == "A", None, l)), "labels holds 120 missing values"),
    (lambda c, r, b, l: (c, r.ravel(), b, l), "corrected matrix must be 2-D"),
])
def test_bad_input_is_refused_with_the_problem_named(synthetic, change, message):
    counts, reference, batch, labels = synthetic
    with pytest.raises(ValueError, match=message):
        fidelity.gene_fidelity(*change(counts, reference, batch, labels))


# ---------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def cellbench():
    """The bundled CellBench data (1,021 cells, 5 batches, 5 cell lines) on its 2,000 genes of
    highest mean count."""
    adata = ad.read_h5ad(DATA)
    counts = adata.X.toarray() if sp.issparse(adata.X) else np.asarray(adata.X)
    genes = np.argsort(-counts.mean(0), kind="stable")[:2000]
    return (counts[:, genes].astype(np.float32), adata.obs["batch"].astype(str).to_numpy(),
            adata.obs["cell_type"].astype(str).to_numpy())


@pytest.mark.slow  # three scorings of the whole bundled data: CI's slow step
def test_real_data(cellbench):
    counts, batch, labels = cellbench
    reference = log_cp10k(counts.astype(np.float64))
    result = fidelity.gene_fidelity(sp.csr_matrix(counts), reference, batch, labels)
    assert scores(result) == {k: pytest.approx(1.0, abs=1e-12) for k in GENE_METRICS}
    # every cell line has a batch with >= 10 of its cells and >= 10 others; 15 groups of >= 30
    assert (result["n_labels_scored"], result["n_groups_scored"], result["n_batches_scored"]) == (5, 15, 5)
    assert result["per_label"]["A549"]["batches"] == ["sc_celseq2_5cl_p1", "sc_celseq2_5cl_p2", "sc_celseq2_5cl_p3"]

    # batch-mean centring (a per-batch shift) is a correction that keeps every gene-level score
    centred = reference.copy()
    for b in np.unique(batch):
        centred[batch == b] += reference.mean(0) - reference[batch == b].mean(0)
    shifted = fidelity.gene_fidelity(counts, centred, batch, labels)
    assert all(shifted[k] > 0.999 for k in GENE_METRICS), scores(shifted)

    # the same values on shuffled cells carry no label signal
    shuffled = fidelity.gene_fidelity(
        counts, reference[np.random.default_rng(0).permutation(len(batch))], batch, labels
    )
    assert abs(shuffled[DE_RANK]) < 0.2 and shuffled[MARKER_RECALL] < 0.3 and shuffled[WITHIN_TYPE] < 0.15, \
        scores(shuffled)


def test_group_pca_above_the_full_svd_size_keeps_the_exact_neighbours():
    """Groups larger than FULL_SVD_MAX use ARPACK: the same 10-NN as LAPACK's full SVD."""
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(0)
    values = np.log1p(rng.poisson(rng.gamma(0.5, 2, size=(fidelity.FULL_SVD_MAX + 200, 600)))).astype(np.float32)
    values[: len(values) // 2] += rng.normal(size=600).astype(np.float32) * 0.5
    exact = fidelity._knn(PCA(10, svd_solver="full").fit_transform(values), 10)
    used = fidelity._knn(fidelity._pca(values, 10), 10)
    jaccard = np.mean([len(set(a) & set(b)) / len(set(a) | set(b)) for a, b in zip(exact, used)])
    assert jaccard > 0.99
