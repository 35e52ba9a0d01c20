"""Scoring with scib-metrics on a real subset of the bundled CellBench data."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scanpy as sc

from batchfix.data.io import OutputKeys
from batchfix.data.normalize import log_cp10k
from batchfix.eval import fidelity, matrix_scores, metrics, reports, umap_plots
from batchfix.eval.evaluate import evaluate_file

DATA = Path(__file__).resolve().parents[2] / "data" / "cellbench5.h5ad"
N_CELLS = 300
N_GENES = 1000


@pytest.fixture(scope="module")
def small() -> ad.AnnData:
    """300 random cells, 1000 batch-aware HVGs, raw counts in X."""
    adata = ad.read_h5ad(DATA)
    keep = np.sort(np.random.default_rng(0).choice(adata.n_obs, N_CELLS, replace=False))
    adata = adata[keep].copy()
    hvg = sc.pp.highly_variable_genes(
        adata, flavor="seurat_v3", n_top_genes=N_GENES, batch_key="batch", inplace=False
    )
    return adata[:, hvg["highly_variable"].to_numpy()].copy()


@pytest.fixture(scope="module")
def log_expr(small) -> np.ndarray:
    return np.asarray(log_cp10k(small.X), dtype=np.float32)


@pytest.fixture(scope="module")
def combat_log_expr(small, log_expr) -> np.ndarray:
    corrected = ad.AnnData(log_expr.copy(), obs=small.obs)
    sc.pp.combat(corrected, key="batch")
    return np.asarray(corrected.X)


def batch_centred(embedding: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """The embedding with each batch's mean subtracted: the simplest real integration."""
    centred = embedding.copy()
    for b in np.unique(batch):
        centred[batch == b] -= centred[batch == b].mean(axis=0)
    return centred


@pytest.fixture(scope="module")
def embeddings(small, log_expr, combat_log_expr) -> dict[str, np.ndarray]:
    """Unintegrated PCA, ComBat PCA and the batch-centred PCA of the small data (no optional packages)."""
    unintegrated = metrics.pca_embedding(log_expr, n_comps=30)
    return {
        "Unintegrated": unintegrated,
        "ComBat": metrics.pca_embedding(combat_log_expr, n_comps=30),
        "Batch-centred PCA": batch_centred(unintegrated, small.obs["batch"].astype(str).to_numpy()),
    }


def test_pca_embedding_shape_and_determinism(log_expr):
    first = metrics.pca_embedding(log_expr, n_comps=20, seed=0)
    assert first.shape == (N_CELLS, 20)
    np.testing.assert_allclose(first, metrics.pca_embedding(log_expr, n_comps=20, seed=0))


@pytest.mark.slow  # every scIB metric on three embeddings of the bundled data: CI's slow step
def test_scores_are_bounded_and_correction_mixes_batches_better(small, embeddings):
    names = ["Unintegrated", "ComBat", "Batch-centred PCA"]
    table = metrics.score_embeddings(
        small.obs, {n: embeddings[n] for n in names}, embeddings["Unintegrated"], "batch", "cell_type"
    )
    assert list(table.index) == names
    for column in ["BRAS", "iLISI", "KBET", "Graph connectivity", "PCR comparison",
                   "Isolated labels", "KMeans NMI", "KMeans ARI", "Silhouette label", "cLISI"]:
        assert column in table.columns
    assert ((table >= 0) & (table <= 1)).all().all(), table
    np.testing.assert_allclose(
        table["Total"], 0.4 * table["Batch correction"] + 0.6 * table["Bio conservation"]
    )
    assert table.loc["Unintegrated", "PCR comparison"] == 0
    batch = table["Batch correction"]
    assert batch["ComBat"] > batch["Unintegrated"] + 0.1
    assert batch["Batch-centred PCA"] > batch["Unintegrated"] + 0.1


def test_without_labels_only_label_free_batch_metrics(small, embeddings):
    table = metrics.score_embeddings(
        small.obs, {"ComBat": embeddings["ComBat"]}, embeddings["Unintegrated"], "batch", None
    )
    assert list(table.columns) == ["iLISI", "PCR comparison",
                                   "Batch correction", "Bio conservation", "Total"]
    assert np.isnan(table.loc["ComBat", "Bio conservation"])
    assert np.isnan(table.loc["ComBat", "Total"])
    assert 0 < table.loc["ComBat", "Batch correction"] <= 1
    result = metrics.results_dict(table, "batch", None)
    assert result["bio_conservation_scored"] is False
    assert "not scored" in result["note"]
    assert result["scores"]["ComBat"]["Total"] is None


def test_score_embeddings_rejects_bad_input(small, embeddings):
    with pytest.raises(ValueError, match="obs has"):
        metrics.score_embeddings(small.obs, {"x": embeddings["ComBat"]},
                                 embeddings["Unintegrated"], "sample", None)
    with pytest.raises(ValueError, match="shape"):
        metrics.score_embeddings(small.obs, {"x": embeddings["ComBat"][:10]},
                                 embeddings["Unintegrated"], "batch", None)


@pytest.fixture(scope="module")
def corrected_file(small, embeddings, combat_log_expr, tmp_path_factory) -> Path:
    """A file shaped like batchfix output: ComBat as the corrected layer, the batch-centred PCA as latent."""
    adata = small.copy()
    modelled = np.zeros(adata.n_vars, dtype=bool)
    modelled[: N_GENES - 200] = True
    adata.var["batchfix_modelled"] = modelled
    adata.layers["batchfix"] = combat_log_expr
    adata.obsm["X_batchfix"] = embeddings["Batch-centred PCA"]
    path = tmp_path_factory.mktemp("corrected") / "corrected.h5ad"
    adata.write_h5ad(path)
    return path


def test_evaluate_file_writes_report_and_leaves_input_alone(corrected_file, tmp_path):
    before = hashlib.sha256(corrected_file.read_bytes()).hexdigest()
    result = evaluate_file(corrected_file, "batch", "cell_type", tmp_path / "eval")
    assert hashlib.sha256(corrected_file.read_bytes()).hexdigest() == before

    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == result
    assert result["n_genes_scored"] == N_GENES - 200
    assert result["bio_conservation_scored"] is True
    scores = result["scores"]
    assert set(scores) == {metrics.UNINTEGRATED, metrics.LATENT, metrics.CORRECTED}
    for name in (metrics.LATENT, metrics.CORRECTED):
        assert scores[name]["Batch correction"] > scores[metrics.UNINTEGRATED]["Batch correction"]
    genes = result["gene_fidelity"]
    assert genes["n_genes"] == N_GENES - 200 and genes["labels_given"] and "note" not in genes
    # ComBat keeps each cell's own values up to a per-batch affine map: near the uncorrected structure.
    assert genes[fidelity.DE_RANK] > 0.95 and genes[fidelity.MARKER_RECALL] > 0.8
    assert 0.5 < genes[fidelity.WITHIN_TYPE] <= 1 and 0.5 < genes[fidelity.HVG_CONSERVATION] <= 1
    markdown = (tmp_path / "eval" / "metrics.md").read_text()
    assert "| Embedding |" in markdown and metrics.LATENT in markdown
    assert "Gene-level fidelity of layers['batchfix']" in markdown
    assert f"| {genes[fidelity.DE_RANK]:.3f} |" in markdown
    cnv = result["cnv_fidelity"]  # ComBat moves each gene per batch: lines keep their profiles along the genome
    assert cnv["n_groups"] >= 5 and cnv["retention_r"] > 0.8 * cnv["uncorrected_r"] > 0
    assert "CNV profile retention of layers['batchfix']" in markdown and f"| {cnv['retention_r']:.3f} |" in markdown
    matrix = result["matrix_scores"]  # ComBat on the log scale fills zeros; the raw data are the reference
    assert matrix["layer"] == "batchfix" and matrix["n_genes"] == N_GENES - 200 and "batch-free" in matrix["reference"]
    assert matrix[matrix_scores.ZEROS_RAISED] > 0.5 and matrix[matrix_scores.DETECTION_SPREAD_RAW] > 0
    assert matrix[matrix_scores.FALSE_DE_ZERO_RAW] is not None and matrix[matrix_scores.BATCH_DE_CALLS] is not None
    assert "Matrix scores of layers['batchfix']" in markdown
    assert f"| {matrix[matrix_scores.ZEROS_RAISED]:.3f} |" in markdown
    png = (tmp_path / "eval" / "umap.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


def test_evaluate_file_names_what_exists_when_keys_are_missing(corrected_file, tmp_path):
    with pytest.raises(ValueError, match=r"label key 'celltype'.*cell_type"):
        evaluate_file(corrected_file, "batch", "celltype", tmp_path)
    with pytest.raises(ValueError, match=r"corrected layer 'corrected'.*batchfix.*another key_added"):
        evaluate_file(corrected_file, "batch", "cell_type", tmp_path, key_added="corrected")
    without_latent = ad.read_h5ad(corrected_file)
    del without_latent.obsm["X_batchfix"]
    without_latent.obsm["X_scvi"] = np.zeros((without_latent.n_obs, 2), dtype=np.float32)
    without_latent.write_h5ad(tmp_path / "no_latent.h5ad")
    with pytest.raises(ValueError, match=r"latent obsm key 'X_batchfix'.*X_scvi"):
        evaluate_file(tmp_path / "no_latent.h5ad", "batch", "cell_type", tmp_path)
    assert not (tmp_path / "metrics.json").exists()


def test_evaluate_file_honours_key_added(corrected_file, tmp_path):
    """A file corrected with key_added=other is scored on var['other_modelled'], layers['other'], obsm['X_other']."""
    adata = ad.read_h5ad(corrected_file)
    renamed = ad.AnnData(adata.X, obs=adata.obs, var=adata.var[[]].copy())
    renamed.var["other_modelled"] = adata.var["batchfix_modelled"].to_numpy()
    renamed.layers["other"] = adata.layers["batchfix"]
    renamed.obsm["X_other"] = adata.obsm["X_batchfix"]
    renamed.write_h5ad(tmp_path / "other.h5ad")
    result = evaluate_file(tmp_path / "other.h5ad", "batch", "cell_type", tmp_path / "eval", key_added="other")
    assert result["n_genes_scored"] == N_GENES - 200 and result["genes"] == "var['other_modelled']"
    assert result["corrected_layer"] == "other" and result["latent_key"] == "X_other"


def test_evaluation_without_labels_scores_batch_mixing_only(corrected_file, tmp_path):
    adata = ad.read_h5ad(corrected_file)
    result = evaluate_file(corrected_file, "batch", None, tmp_path / "eval")
    assert result["bio_conservation_scored"] is False and "not scored" in result["note"]
    json.dumps(result, allow_nan=False)
    for scores in result["scores"].values():
        assert set(scores) == {"iLISI", "PCR comparison", "Batch correction",
                               "Bio conservation", "Total"}
        assert scores["Total"] is None and 0 <= scores["Batch correction"] <= 1
    genes = result["gene_fidelity"]
    assert genes["note"] == fidelity.NO_LABELS_NOTE and not genes["labels_given"]
    assert all(genes[m] is None for m in fidelity.LABEL_METRICS)
    assert 0.5 < genes[fidelity.HVG_CONSERVATION] <= 1
    assert "No labels" in reports.gene_markdown(genes)

    out = tmp_path / "umap.png"
    umap_plots.plot_umaps({"latent": adata.obsm["X_batchfix"]}, adata.obs["batch"], None, out)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_evaluate_file_scores_a_stratified_subsample_of_a_large_file(corrected_file, tmp_path):
    """Above evaluation.max_cells only a subsample is read and scored, each batch x label keeping its share."""
    before = hashlib.sha256(corrected_file.read_bytes()).hexdigest()
    result = evaluate_file(corrected_file, "batch", "cell_type", tmp_path / "eval", max_cells=120, neighbors="exact")
    assert hashlib.sha256(corrected_file.read_bytes()).hexdigest() == before
    assert result["n_cells"] == 120
    assert result["subsample"] == {"n_cells": 120, "of_cells": N_CELLS, "max_cells": 120,
                                   "stratified_by": ["batch", "cell_type"], "seed": 0}
    assert result["neighbors"] == "exact"
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == result
    markdown = (tmp_path / "eval" / "metrics.md").read_text()
    assert f"subsample of 120 of {N_CELLS} cells (evaluation.max_cells=120), stratified by batch x cell_type" \
        in markdown
    assert (tmp_path / "eval" / "umap.png").read_bytes().startswith(b"\x89PNG")
    for name in (metrics.LATENT, metrics.CORRECTED):  # still scores, and still better than uncorrected
        assert result["scores"][name]["Batch correction"] > result["scores"][metrics.UNINTEGRATED]["Batch correction"]


def test_subsample_read_from_disk_matches_the_file(corrected_file):
    """The cells read row by row from disk are those of the file, every stratum represented in proportion."""
    from batchfix.data.subsample import stratified_rows
    from batchfix.eval.evaluate import read_for_scoring

    full = ad.read_h5ad(corrected_file)
    adata, info = read_for_scoring(corrected_file, "batch", "cell_type", 100, OutputKeys("batchfix"), None)
    rows = stratified_rows([full.obs["batch"].astype(str).to_numpy(), full.obs["cell_type"].astype(str).to_numpy()],
                           100)
    assert adata.n_obs == 100 and info["n_cells"] == 100
    assert list(adata.obs_names) == list(full.obs_names[rows])
    np.testing.assert_array_equal(np.asarray(adata.X.todense() if hasattr(adata.X, "todense") else adata.X),
                                  np.asarray(full.X[rows].todense() if hasattr(full.X, "todense") else full.X[rows]))
    np.testing.assert_array_equal(adata.layers["batchfix"], full.layers["batchfix"][rows])
    np.testing.assert_array_equal(adata.obsm["X_batchfix"], full.obsm["X_batchfix"][rows])
    strata = full.obs.groupby(["batch", "cell_type"], observed=True).size()
    kept = adata.obs.groupby(["batch", "cell_type"], observed=True).size()
    assert set(kept.index) == set(strata.index)  # no batch x label lost
    # proportional shares, give or take the one cell every stratum is guaranteed
    assert np.all(np.abs(kept[strata.index] - strata * 100 / N_CELLS) < 2)
    whole, none = read_for_scoring(corrected_file, "batch", "cell_type", N_CELLS, OutputKeys("batchfix"), None)
    assert none is None and whole.n_obs == N_CELLS


@pytest.mark.slow  # pynndescent's compilation: CI's slow step
def test_exact_neighbours_agree_with_approximate_ones_on_real_cells(small, embeddings):
    """Exact neighbour graphs give pynndescent's scores, except kBET: it weighs every neighbour, and moves
    (by 0.14 here, 0.024 on the bundled data; the README says so)."""
    subset = {name: embeddings[name] for name in ("Unintegrated", "ComBat")}
    exact = metrics.score_embeddings(small.obs, subset, subset["Unintegrated"], "batch", "cell_type", "exact")
    approximate = metrics.score_embeddings(small.obs, subset, subset["Unintegrated"], "batch", "cell_type",
                                           "approximate")
    difference = (exact - approximate).abs().max()
    aggregates = ["KBET", "Batch correction", "Total"]
    assert difference.drop(aggregates).max() < 1e-3, difference
    assert difference["Batch correction"] <= difference["KBET"] / 5 + 1e-3  # kBET is one of five batch metrics
    assert exact.loc["ComBat", "Batch correction"] > exact.loc["Unintegrated", "Batch correction"]
    with pytest.raises(ValueError, match="neighbors must be one of"):
        metrics.score_embeddings(small.obs, subset, subset["Unintegrated"], "batch", "cell_type", "fast")
    result = metrics.exact_neighbors(subset["ComBat"], 5)
    assert (result.indices[:, 0] == np.arange(len(small))).mean() > 0.99 and (result.distances[:, 0] < 1e-3).all()


def test_exact_scoring_compiles_no_pynndescent(corrected_file, tmp_path, monkeypatch):
    """With exact neighbours (the default up to 50,000 cells) no pynndescent index is built anywhere: not for
    the scores' graphs, not inside kBET's diffusion-map search, not for the UMAP; so nothing is compiled."""
    import pynndescent

    def refuse(*args, **kwargs):
        raise AssertionError("pynndescent used")

    monkeypatch.setattr(pynndescent.NNDescent, "__init__", refuse)  # the class every caller builds
    result = evaluate_file(corrected_file, "batch", "cell_type", tmp_path / "eval")
    assert result["neighbors"] == "exact"
    assert result["scores"][metrics.CORRECTED]["KBET"] is not None
    with pytest.raises(AssertionError, match="pynndescent used"):  # the guard itself works
        evaluate_file(corrected_file, "batch", "cell_type", tmp_path / "approx", neighbors="approximate")


def test_auto_neighbours_are_exact_up_to_the_limit():
    limit = metrics.EXACT_NEIGHBORS_MAX_CELLS
    assert metrics.resolve_neighbors("auto", limit) == "exact"
    assert metrics.resolve_neighbors("auto", limit + 1) == "approximate"
    assert metrics.resolve_neighbors("approximate", 10) == "approximate"
    assert metrics.resolve_neighbors("exact", 10 * limit) == "exact"
    with pytest.raises(ValueError, match=r"neighbors must be one of \['auto', 'exact', 'approximate'\]"):
        metrics.resolve_neighbors("fast", 10)


def test_exact_diffusion_neighbours_are_exact_and_restored():
    """kBET's diffusion-map search is exact inside the context, and scib-metrics' own search is back after."""
    import scib_metrics.nearest_neighbors as scib_neighbors
    from scib_metrics.utils import diffusion_nn
    from scipy.sparse import csr_matrix

    rng = np.random.default_rng(0)
    points = rng.normal(size=(200, 5))
    distances = np.linalg.norm(points[:, None] - points[None], axis=-1)
    graph = csr_matrix(np.exp(-distances**2) * (distances < 1.5))
    original = scib_neighbors.pynndescent
    with metrics.exact_diffusion_neighbors():
        result = diffusion_nn(graph, k=10, n_comps=20)
    assert scib_neighbors.pynndescent is original
    assert result.indices.shape == (200, 11) and (np.diff(result.distances, axis=1) >= -1e-6).all()


def test_umap_starts_from_pca_on_a_graph_of_many_components():
    """Spectral initialisation solves an eigenproblem per connected component; beyond
    MAX_SPECTRAL_COMPONENTS components (resampled cells gave 761) UMAP starts from the PCA instead."""
    from scipy.sparse import block_diag, csr_matrix

    clique = csr_matrix(np.ones((4, 4)) - np.eye(4))
    few = block_diag([clique] * umap_plots.MAX_SPECTRAL_COMPONENTS)
    many = block_diag([clique] * (umap_plots.MAX_SPECTRAL_COMPONENTS + 1))
    assert umap_plots.umap_initialisation(few) == "spectral"
    assert umap_plots.umap_initialisation(many) == "pca"
    points = np.repeat(np.arange(30.0)[:, None] * 100, 6, axis=0) + np.random.default_rng(0).normal(size=(180, 3))
    coords = umap_plots.umap_coordinates(points.astype(np.float32), neighbors="exact")  # 30 far-apart clusters
    assert coords.shape == (180, 2) and np.isfinite(coords).all()


def test_frozen_heap_is_undone():
    import gc

    with metrics.frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_subsample_allocation_keeps_small_strata():
    from batchfix.data.subsample import allocate, stratified_rows

    sizes = np.array([1000, 10, 1, 0])
    quota = allocate(sizes, 101)
    assert quota.sum() == 101 and quota[2] == 1 and quota[3] == 0 and quota[1] >= 1
    batch = np.repeat(["a", "b", "c"], [500, 30, 2])
    rows = stratified_rows([batch], 50)
    assert len(rows) == 50 and np.all(np.diff(rows) > 0) and set(batch[rows]) == {"a", "b", "c"}
    np.testing.assert_array_equal(rows, stratified_rows([batch], 50))  # the same subsample every run
    np.testing.assert_array_equal(stratified_rows([batch], 600), np.arange(532))


@pytest.mark.slow
def test_umap_of_8192_cells_or_more(log_expr):
    """From 8,192 cells scanpy's neighbours go through pynndescent (whose sparse-array output scanpy 1.11
    cannot read on its own): the UMAP still comes out, and close cells stay close."""
    pcs = metrics.pca_embedding(log_expr, n_comps=10)
    rng = np.random.default_rng(0)
    source = rng.integers(0, len(pcs), size=8300)
    embedding = pcs[source] + rng.normal(scale=0.01, size=(8300, pcs.shape[1])).astype(np.float32)
    coords = umap_plots.umap_coordinates(embedding)
    assert coords.shape == (8300, 2) and np.isfinite(coords).all()
    twins = np.flatnonzero(source == source[0])[1:]  # resampled copies of the first cell
    spread = np.linalg.norm(coords - coords.mean(axis=0), axis=1).mean()
    assert np.linalg.norm(coords[twins] - coords[0], axis=1).mean() < 0.2 * spread


def test_the_cnv_table_writes_an_undefined_relative_r_as_n_a():
    """Where the uncorrected profiles do not correlate (r <= 0), cnv.py leaves relative_r None: the table says n/a."""
    scores = {"retention_r": 0.12, "uncorrected_r": -0.05, "relative_r": None, "amplitude_ratio": 0.7, "n_genes": 900,
              "n_windows": 12}
    assert "| 0.120 | -0.050 | n/a | 0.700 | 900 | 12 |" in reports.cnv_markdown(scores)
