"""The lab scripts' rows on a tiny model of the real 200-cell subset, and the seed table of their CSVs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import batchfix
from batchfix.data.normalize import log_cp10k
from batchfix.eval import fidelity
from scripts.lab import count_scaling, decoding_scale, marker_loss, residual_forms, residual_weight, shift_forms

pytestmark = pytest.mark.lab
ROOT = Path(__file__).resolve().parents[2]
TINY = dict(n_top_genes=None, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8,
            decoder_hidden=32, batch_size=64, max_epochs=30, threads=1, enable_progress_bar=False)


@pytest.fixture(scope="module")
def tiny_model(subset):
    return batchfix.train(subset, batch_key="batch", seed=0, **TINY)


def test_the_residual_weight_script_rebuilds_batchfix_correct_and_scores_against_a_truth(subset, tiny_model, tmp_path):
    """scripts/lab/residual_weight.py's rows for one saved model: its checked rows (weights 1 and 0.75, spread=gene with
    state 0.5 at weights 1 and 0.9) are batchfix.correct's, or it stops; with a truth layer equal to X and the same
    model as the truth's, every gene score against the truth equals the one against the data and every contrast truth
    error is 0."""
    adata = subset.copy()
    adata.layers["truth"] = adata.X.copy()
    for part in ("model", "truth"):
        tiny_model.save(tmp_path / f"{part}_0.ckpt")
    args = decoding_scale.parse_args(["unused.h5ad", "--truth-layer", "truth", "--model-dir", str(tmp_path)])
    table = decoding_scale.seed_scores(adata, args, 0, build=residual_weight.weight_rows)
    weights = [f"residual weight {w:g}" for w in residual_weight.WEIGHTS]
    assert list(table.index) == ["uncorrected", "ComBat", *weights, "spread gene", "spread gene, state 0.5",
                                 "spread gene, state 0.5, weight 0.9"]
    scored = [metric for metric in fidelity.GENE_METRICS if table[metric].notna().all()]
    assert len(scored) >= 2  # the scores this small subset allows
    for metric in fidelity.GENE_METRICS:
        pd.testing.assert_series_equal(table[metric], table[f"{metric} (truth)"], check_names=False)
    assert np.allclose(table[decoding_scale.CONTRAST], 0.0, atol=1e-6)
    assert table.loc["residual weight 0", fidelity.HVG_CONSERVATION] < table.loc["residual weight 1",
                                                                                 fidelity.HVG_CONSERVATION]


def test_the_shift_forms_script_keeps_each_batchs_expected_counts_and_a_lower_log_mean_reference(subset, tiny_model,
                                                                                                  tmp_path):
    """scripts/lab/shift_forms.py on one saved model: its default row is batchfix.correct's (or it stops); the factor
    form keeps each batch's mean expected count of every gene (f is their ratio to the reference's); the log-mean
    reference is the mean of the batches' log1p values, below the log1p of their mean (concavity) and not equal."""
    tiny_model.save(tmp_path / "model_0.ckpt")
    genes, counts, rows = shift_forms.shift_rows(subset, "batch", 0, tmp_path / "model_0.ckpt")
    assert list(rows) == ["uncorrected", "ComBat", "default", "state 0.5", "default, recalibrated",
                          "factor, state 0", "factor, state 0.25", "factor, state 0.5", "log-mean reference",
                          "log-mean reference, state 0.5", "log-mean reference, level kept",
                          "log-mean reference, level kept, state 0.5"]
    assert genes == list(tiny_model.genes) and counts.shape == rows["default"].shape
    outputs = [values for name, values in rows.items() if name not in ("uncorrected", "ComBat")]
    assert all(np.isfinite(values).all() and (values >= 0).all() for values in outputs)  # ComBat has no floor
    terms = marker_loss.counterfactual_terms(subset, tiny_model, "batch")
    structured = shift_forms.factor_own(terms)
    for code in np.unique(terms.codes):
        cells = terms.codes == code
        np.testing.assert_allclose(np.expm1(structured[cells]).mean(axis=0), np.expm1(terms.own[cells]).mean(axis=0),
                                   rtol=1e-6, atol=1e-9)
    log_mean = shift_forms.log_mean_reference(subset, tiny_model)
    assert (log_mean <= terms.reference + 1e-5).all() and (terms.reference - log_mean).max() > 1e-3


def test_the_residual_forms_script_rebuilds_batchfix_correct_and_names_its_rows(subset, tiny_model, tmp_path):
    """scripts/lab/residual_forms.py on one saved model: its default row is batchfix.correct's (or it stops), and every
    form is a floored matrix of the default's shape that differs from it."""
    tiny_model.save(tmp_path / "model_0.ckpt")
    genes, counts, rows = residual_forms.residual_rows(subset, "batch", 0, tmp_path / "model_0.ckpt")
    forms = ["residual weight 0.75", "residual weight 0.5", "local mean kept, 0.75", "local mean kept, 0.5",
             "cluster swap 5", "cluster swap 30", "linear swap", "quantile match 20", "quantile match 100", "state 0.5",
             "state 0.5, cluster swap 5"]
    assert list(rows) == ["uncorrected", "ComBat", "default", *forms]
    for name in forms:
        assert rows[name].shape == rows["default"].shape and (rows[name] >= 0).all(), name
        # 30 clusters of 200 cells leave no cluster with two (batch, cluster) groups of 10 cells: nothing is swapped
        assert (np.abs(rows[name] - rows["default"]).max() > 1e-3) == (name != "cluster swap 30"), name


def test_a_seed_table_is_the_mean_and_sd_over_seeds_of_each_row(tmp_path):
    """scripts/lab/seed_table.py: per (data, output), "mean ± sd" over the seeds of each score, rows in their first
    order, dropped rows left out, and a score one data set lacks left blank (as the decoding-scale table has)."""
    runs = tmp_path / "runs.csv"
    runs.write_text(",Total,Marker recall,seed\n"
                    "uncorrected,0.5,1.0,0\ndefault,0.80,0.90,0\nComBat,0.70,0.95,0\n"
                    "uncorrected,0.5,1.0,1\ndefault,0.84,0.96,1\nComBat,0.70,0.95,1\n")
    stress = tmp_path / "stress.csv"
    stress.write_text(",Total,Marker recall,\"Truth error (group contrasts, relative)\",seed\n"
                      "default,0.6,0.8,0.25,0\ndefault,0.6,0.8,0.35,1\n")
    one_seed = tmp_path / "one_seed.csv"  # one seed: the mean alone; a latent has no gene scores: blank
    one_seed.write_text(",Total,Marker recall,seed\ndefault,0.9,0.97,0\nlatent,0.85,,0\n")
    out = tmp_path / "table.csv"
    subprocess.run([sys.executable, "-m", "scripts.lab.seed_table", str(out), f"bundled={runs}", f"stress sd 1.0={stress}",
                    f"stress sd 0.5={one_seed}", "--drop", "uncorrected"], cwd=ROOT, check=True, capture_output=True)
    assert out.read_text().splitlines() == [
        "data,output,Total,markers,truth error (contrasts)",
        "bundled,default,0.820 ± 0.028,0.930 ± 0.042,",
        "bundled,ComBat,0.700 ± 0.000,0.950 ± 0.000,",
        "stress sd 1.0,default,0.600 ± 0.000,0.800 ± 0.000,0.300 ± 0.071",
        "stress sd 0.5,default,0.900,0.970,",
        "stress sd 0.5,latent,0.850,,",
    ]


def test_a_factor_per_gene_and_batch_keeps_every_count_ratio_yet_moves_the_log1p_markers(subset):
    """scripts/lab/count_scaling.py: its factor form changes each gene of a batch by one positive factor (every count
    ratio within a batch kept, the batches' mean fractions of the cells' totals made equal), and on the real subset
    that alone moves the within-batch log1p differences the gene scores rank, which a per-gene, per-batch log shift
    does not."""
    counts = np.asarray(subset.X, dtype=np.float64)
    batch = subset.obs["batch"].astype(str).to_numpy()
    labels = subset.obs["cell_type"].astype(str).to_numpy()
    scaled = count_scaling.factor_to_mean_fraction(counts, batch)
    fractions = scaled / counts.sum(axis=1, keepdims=True)  # of each cell's own total before the scaling
    means = np.stack([fractions[batch == name].mean(axis=0) for name in np.unique(batch)])
    detected = (means > 0).all(axis=0)
    assert detected.sum() > 100
    np.testing.assert_allclose(means[:, detected], np.broadcast_to(means[:1, detected], means[:, detected].shape),
                               rtol=1e-9)
    for name in np.unique(batch):
        rows, positive = batch == name, counts[batch == name] > 0
        factors = scaled[rows][positive] / counts[rows][positive]
        genes = np.nonzero(positive)[1]
        spread = pd.Series(factors).groupby(genes).agg(lambda f: f.max() / f.min())
        np.testing.assert_allclose(spread, 1.0, rtol=1e-9)  # one factor per gene and batch
    log_raw = np.asarray(log_cp10k(counts), dtype=np.float64)
    shifts = np.random.default_rng(0).normal(size=(5, counts.shape[1]))[np.unique(batch, return_inverse=True)[1]]
    shifted = fidelity.gene_fidelity(counts, log_raw + shifts, batch, labels)
    factored = fidelity.gene_fidelity(counts, log_cp10k(scaled), batch, labels)
    assert shifted[fidelity.DE_RANK] > 0.9999 and shifted[fidelity.MARKER_RECALL] == 1.0
    assert factored[fidelity.DE_RANK] < 0.999


def test_the_count_draws_middle_form_changes_only_the_positive_counts_and_moves_fewer(subset, tiny_model):
    """scripts/lab/count_draws.py: its middle form maps zeros with the shipped draws and positive counts from the
    middle of their interval, where a small shift moves none."""
    from scripts.lab import count_draws

    shipped = batchfix.correct(subset, tiny_model, copy=True, shrink="none").layers["batchfix_counts"]
    with count_draws.middle_form():
        middle = batchfix.correct(subset, tiny_model, copy=True, shrink="none").layers["batchfix_counts"]
    shipped, middle = (np.asarray(m.toarray() if hasattr(m, "toarray") else m) for m in (shipped, middle))
    raw = np.asarray(subset.X)
    zero = raw == 0
    assert np.array_equal(shipped[zero], middle[zero])
    moved_drawn, moved_middle = (int((m[~zero] != raw[~zero]).sum()) for m in (shipped, middle))
    assert 0 < moved_middle < moved_drawn, (moved_middle, moved_drawn)


def test_the_evidence_forms_differ_as_their_names_say():
    """scripts/lab/evidence_forms.py: shifts within their noise get weight exactly 0 by the shipped posterior median
    and a small positive one by the posterior mean; the form without covariance takes each level's variance as its
    shift's."""
    import contextlib

    from batchfix.correction import evidence
    from scripts.lab import evidence_forms

    rng = np.random.default_rng(0)
    variance = np.full(500, 0.04)
    shift = rng.normal(0.0, 0.2, 500)  # noise only
    shift[:50] += 1.5  # and 50 real shifts far beyond it
    sums = evidence.ShiftEvidenceSums(2, 1)
    sums.n_cells[:] = 100
    members = np.ones((2, 1), dtype=bool)
    weights = {}
    for name, patches in evidence_forms.FORMS.items():
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            weights[name] = evidence.shrinkage(shift, variance)[0]
            weights[name, "variance"] = sums.shift_variance(np.full((2, 1), 0.04), None, members)[:, 0]
    shipped, mean = weights["batchfix"], weights["batchfix, posterior mean"]
    assert (shipped[50:] == 0).mean() > 0.75 and (mean[50:] > 0).all()  # measured: 86 % exactly 0
    assert shipped[:50].min() > 0.8 and mean[:50].min() > 0.8
    assert np.allclose(weights["batchfix", "variance"], 0.02)  # two batches: half of each level's variance
    assert np.allclose(weights["batchfix, mean without covariance", "variance"], 0.04)


def test_the_library_shift_rows_are_both_depths_of_one_trained_model(subset, tiny_model, monkeypatch):
    """scripts/lab/library_shift.py: one model per seed, corrected with depth=keep (batchfix.correct's default
    layer, entry for entry) and depth=reference, whose libraries the subset's plates (depths about twofold apart)
    bring closer together."""
    from scripts.lab import library_shift

    monkeypatch.setattr(batchfix, "train", lambda *args, **kwargs: tiny_model)
    rows = library_shift.batchfix_rows(subset, "batch", "cell_type", seed=0)
    assert list(rows) == ["batchfix", "batchfix, depth=reference"]
    shipped = batchfix.correct(subset, tiny_model, copy=True, progress=False).layers["batchfix_counts"]
    assert (rows["batchfix"] != shipped).nnz == 0
    batch = subset.obs["batch"].astype(str).to_numpy()

    def depth_spread(counts) -> float:
        library = np.asarray(counts.sum(axis=1)).ravel()
        medians = [np.median(library[batch == name]) for name in np.unique(batch)]
        return max(medians) / min(medians)

    assert depth_spread(rows["batchfix, depth=reference"]) < depth_spread(rows["batchfix"])


def test_the_gene_location_measures_a_planted_location_and_calls_sampling_noise_noise():
    """scripts/lab/gene_location.py on counts with a known answer: two batches of Poisson counts with the same shares,
    one gene's doubled in batch b. Its location is half of log 2 each way (the reference is the batches' mean log
    level), every other gene's location over its sd has variance about 1 (the variance is the sampling noise's), the
    evidence weights apply the planted gene nearly whole and the others' noise a quarter at most, and the unweighted
    form leaves that gene's mean share equal between the batches."""
    from scipy import sparse

    from scripts.lab import gene_location

    rng = np.random.default_rng(0)
    n_cells, n_genes = 1500, 400
    shares = rng.dirichlet(np.full(n_genes, 2.0))
    batch = np.repeat(["a", "b"], n_cells)
    planted = np.tile(shares, (2 * n_cells, 1))
    planted[n_cells:, 0] *= 2.0
    counts = sparse.csr_matrix(rng.poisson(planted * 2000.0).astype(np.float64))
    groups = np.zeros(2 * n_cells, dtype=int)
    location = gene_location.gene_location(counts, batch, groups)
    np.testing.assert_allclose([location["a"][0][0], location["b"][0][0]], [np.log(2) / 2, -np.log(2) / 2], atol=0.02)
    z = location["b"][0][1:] / np.sqrt(location["b"][1][1:])
    assert 0.8 < z.var() < 1.25
    forms, summary = gene_location.located(counts, batch, groups)
    assert 0.8 < summary["b"][1] < 1.25 * np.log(2) ** 2 / location["b"][1][0]  # the planted gene's z^2 counts too

    def applied(form: str) -> np.ndarray:  # (genes,) batch b's log factor on each gene
        return np.log(np.asarray(forms[form][batch == "b"].sum(axis=0)).ravel()
                      / np.asarray(counts[batch == "b"].sum(axis=0)).ravel())

    weighted, unweighted = applied("weighted"), applied("unweighted")
    assert weighted[0] < -0.3 and np.abs(weighted[1:]).mean() < 0.25 * np.abs(unweighted[1:]).mean()
    level = [np.mean(forms["unweighted"][batch == name, 0].toarray().ravel()
                     / np.asarray(forms["unweighted"][batch == name].sum(axis=1)).ravel()) for name in ("a", "b")]
    np.testing.assert_allclose(level[0], level[1], rtol=0.01)


def test_the_planted_effect_decomposition_finds_a_known_share_of_each_part():
    """scripts/lab/planted_effect.py on values with a known answer: three batches, two labels, each batch's values
    the untouched ones plus half its planted log factor. The coefficients are 0.5 on the planted factor and 1 on the
    data's own deviations; an output that keeps no difference between batches within a label scores 0 on both; the
    uncorrected one keeps the planted whole."""
    from scripts.lab import planted_effect

    rng = np.random.default_rng(0)
    n_cells, n_genes = 600, 40
    batch = np.array(["a", "b", "c"])[np.arange(n_cells) % 3]
    labels = np.array(["x", "y"])[(np.arange(n_cells) // 3) % 2]
    truth_log = rng.gamma(2.0, 0.5, size=(n_cells, n_genes))
    planted = rng.normal(0.0, 1.0, size=(3, n_genes))
    codes = np.searchsorted(["a", "b", "c"], batch)
    label_means = {label: truth_log[labels == label].mean(axis=0) for label in ("x", "y")}
    flat = np.vstack([label_means[label] for label in labels])
    outputs = {"half": truth_log + 0.5 * planted[codes], "flat": flat, "uncorrected": truth_log + planted[codes]}
    table = planted_effect.decomposition(outputs, truth_log, planted, batch, labels)
    np.testing.assert_allclose(table.loc["half", ["planted", "own"]].to_numpy(dtype=float), [0.5, 1.0], atol=1e-9)
    np.testing.assert_allclose(table.loc["flat", ["planted", "own", "deviation sd"]].to_numpy(dtype=float), 0.0,
                               atol=1e-9)
    assert table.loc["uncorrected", "planted"] == pytest.approx(1.0)
